"""Start-up moves the heap out of the cyclic garbage collector's reach (`gc.freeze`); shutdown
gives it back."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvpilot import LLM, SamplingParams


@pytest.fixture()
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_llm_start_freezes_the_heap(stories_model_dir, unfrozen, monkeypatch):
    gc.collect()  # garbage left by earlier tests is not part of the heap start-up freezes
    tracked_before = len(gc.get_objects())
    llm = LLM(str(stories_model_dir))
    try:
        assert gc.get_freeze_count() >= tracked_before > 1000
        # what start-up left behind is no longer walked by a full collection
        assert len(gc.get_objects()) < gc.get_freeze_count() // 10
        out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=8))
        assert len(out[0].outputs[0].token_ids) == 8
    finally:
        llm.shutdown()


def test_shut_down_engine_is_collectable(stories_model_dir, unfrozen, monkeypatch):
    """A frozen object is never collected: shutdown unfreezes, so an engine dropped after shutdown
    (and its model, even inside reference cycles) is freed by the next collection."""
    llm = LLM(str(stories_model_dir))
    model = weakref.ref(llm._executor)
    assert gc.get_freeze_count() > 0
    llm.shutdown()
    assert gc.get_freeze_count() == 0
    del llm
    gc.collect()
    assert model() is None
