"""`kvpilot.tuning.Tuning`: the one record of performance switches, its validated hook
(``KVPILOT_TUNING``, benchmark ``name=value`` lists), its documentation, and that `LLM` hands it
to the core, the runner and the model."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kvpilot.tuning import Tuning, parse_overrides

DOC = Path(__file__).resolve().parents[2] / "docs" / "tuning.md"


def test_defaults_are_the_measured_winners():
    t = Tuning()
    assert (t.cuda_graphs, t.fused_gemv, t.tp_async, t.async_output, t.triton_sampler) == (True,) * 5
    assert (t.tp_reduce_fp32, t.tp_invariant, t.step_timing, t.async_scheduling) == (False, 0, False, None)
    assert t.prefill_graph_tokens == 256 and t.overrides() == {} and t.to_json() == "{}"
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.cuda_graphs = False


def test_json_hook_overrides_known_fields_only(monkeypatch):
    t = Tuning.from_json('{"tp_async": false, "pipe_spin_us": 0, "tp_invariant": 2}')
    assert t == Tuning(tp_async=False, pipe_spin_us=0, tp_invariant=2)
    assert Tuning.from_json(t.to_json()) == t
    for text, match in (("{", "not JSON"), ("[1]", "JSON object"), ('{"cuda_graph": false}', "unknown Tuning fields"),
                        ('{"cuda_graphs": 0}', "cuda_graphs must be bool"), ('{"tp_invariant": true}', "tp_invariant"),
                        ('{"prefill_graph_tokens": 0}', "prefill_graph_tokens must be >= 1"),
                        ('{"go_spin_us": -1}', "go_spin_us")):
        with pytest.raises(ValueError, match=match):
            Tuning.from_json(text)
    monkeypatch.setenv("KVPILOT_TUNING", '{"fused_gemv": false}')
    assert Tuning.from_env() == Tuning(fused_gemv=False)
    monkeypatch.setenv("KVPILOT_TUNING", '{"fused_gemvs": false}')
    with pytest.raises(ValueError, match="KVPILOT_TUNING: unknown Tuning fields"):
        Tuning.from_env()
    monkeypatch.delenv("KVPILOT_TUNING")
    assert Tuning.from_env() == Tuning()


def test_command_line_overrides():
    assert parse_overrides("") == Tuning()
    assert parse_overrides("tp_async=0, cuda_graphs=off,pipe_spin_us=250,async_scheduling=none") == Tuning(
        tp_async=False, cuda_graphs=False, pipe_spin_us=250, async_scheduling=None)
    for text, match in (("tp_async", "not name=value"), ("nope=1", "unknown Tuning field"),
                        ("tp_async=maybe", "tp_async"), ("tp_invariant=x", "expected a number")):
        with pytest.raises(ValueError, match=match):
            parse_overrides(text)


def test_doc_lists_every_field():
    named = re.findall(r"^\| `(\w+)` \|", DOC.read_text(), re.M)
    assert named == [f.name for f in dataclasses.fields(Tuning)]


def test_llm_hands_its_tuning_to_the_core_runner_and_model(stories_model_dir, monkeypatch):
    from kvpilot import LLM, SamplingParams

    monkeypatch.setenv("KVPILOT_TUNING", '{"async_output": false}')  # ignored: an explicit record wins
    tuning = Tuning(async_output=True, async_scheduling=True, triton_sampler=False, fused_gemv=False)
    with LLM(str(stories_model_dir), max_batch_size=2, tuning=tuning) as llm:
        assert llm.tuning is tuning and llm._core.tuning is tuning and llm._executor.tuning is tuning
        assert llm._executor.model.tuning is tuning
        assert llm._core.async_output and llm._core.async_scheduling and llm._core.sampler.backend == "torch"
        assert not any(layer.fused_gemv for layer in llm._executor.model.layers)
        assert llm.generate("Once", SamplingParams(temperature=0, max_tokens=4)).outputs[0].token_ids
    with LLM(str(stories_model_dir), max_batch_size=2) as llm:  # no record given: KVPILOT_TUNING
        assert llm.tuning == Tuning(async_output=False) and not llm._core.async_output
    with pytest.raises(TypeError, match="kvpilot.tuning.Tuning"):
        LLM(str(stories_model_dir), tuning={"fused_gemv": False})
