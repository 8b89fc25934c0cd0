"""An empty token-id prompt: the BOS token alone, or the documented ValueError on a model without BOS;
``generate([])`` is that prompt, never an empty result."""

from __future__ import annotations

import json

import pytest

from support.engine import make_tiny_llama
from kvpilot import LLM, RequestOutput, SamplingParams


@pytest.fixture(scope="module")
def no_bos_llm(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("nobos"))
    cfg = json.loads((path / "config.json").read_text())
    cfg["bos_token_id"] = None
    (path / "config.json").write_text(json.dumps(cfg))
    with LLM(str(path), skip_tokenizer_init=True, device="cpu") as llm:
        yield llm


def test_empty_token_ids_without_bos_is_an_error(no_bos_llm):
    for call in (lambda: no_bos_llm.generate([], SamplingParams(max_tokens=2)),
                 lambda: no_bos_llm.generate([[]], SamplingParams(max_tokens=2)),
                 lambda: no_bos_llm.generate([[5], []], SamplingParams(max_tokens=2)),
                 lambda: no_bos_llm.generate_async([])):
        with pytest.raises(ValueError, match="empty token-id prompt and the model has no bos_token_id"):
            call()
    out = no_bos_llm.generate([5], SamplingParams(max_tokens=2, temperature=0))
    assert out.prompt_token_ids == [5] and len(out.outputs[0].token_ids) == 2


def test_generate_of_an_empty_list_is_the_bos_prompt(stories_model_dir):
    with LLM(str(stories_model_dir), max_num_tokens=64) as llm:
        out = llm.generate([], SamplingParams(max_tokens=4, temperature=0))
        assert isinstance(out, RequestOutput)
        assert out.prompt_token_ids == [1] and len(out.outputs[0].token_ids) == 4
        assert out.outputs[0].text == llm.generate("", SamplingParams(max_tokens=4, temperature=0)).outputs[0].text
