"""`LLM` requests at the edges: aborts of best_of/beam requests, sampling parameters mutated after
construction, running/waiting counts, ``end_id``, prompt input types, bad sampling parameters, prompt
logprob tokens, submitting after shutdown, sliding-window models refused, aborted non-streaming
requests and text held back for stop strings."""

from __future__ import annotations

import pytest

from support.engine import GOLDEN
from kvpilot import LLM, KvCacheConfig, RequestAborted, SamplingParams


@pytest.fixture(scope="module")
def llm(stories_model_dir):
    with LLM(str(stories_model_dir), max_batch_size=4) as llm:
        yield llm


@pytest.mark.parametrize("params", [
    SamplingParams(n=1, best_of=3, max_tokens=400, ignore_eos=True),
    SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=400, ignore_eos=True),
])
def test_abort_of_request_with_more_candidates_than_choices(llm, params):
    out = llm.generate_async("Once", params)
    out.abort()
    with pytest.raises(RequestAborted):
        out.result(timeout=30)
    assert [o.finish_reason for o in out.outputs] == ["abort"] * params.n
    assert GOLDEN.startswith(llm.generate("", SamplingParams(temperature=0, max_tokens=12)).outputs[0].text)
    assert llm._core.kv.num_used_blocks == 0


def test_params_mutated_after_construction_are_revalidated_and_never_written(llm):
    sp = SamplingParams(temperature=0, max_tokens=8, bad_words=["Lily"])
    sp.top_k = "5"
    with pytest.raises(TypeError, match="top_k"):
        llm.generate("", sp)
    sp.top_k = 0
    sp.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate("", sp)
    sp.max_tokens = 8
    llm.generate("", sp)
    assert sp._bad_words_ids == []  # the engine worked on its own copy


def test_running_and_waiting_count_sequences_like_vllm_child_requests(llm):
    # vLLM v1 runs n > 1 as n child requests; kvpilot's gauges count the same units.
    out = llm.generate_async("", SamplingParams(n=8, temperature=1.0, seed=1, max_tokens=30, ignore_eos=True))
    out.result(timeout=60)
    stats = llm.get_stats(timeout=1)
    assert max(s["numActiveRequests"] for s in stats) == 4  # max_batch_size
    assert max(s["numQueuedRequests"] for s in stats) == 4
    assert stats[-1]["numActiveRequests"] == stats[-1]["numQueuedRequests"] == 0


def test_end_id_replaces_the_end_of_sequence_ids(llm):
    full = llm.generate("", SamplingParams(temperature=0, max_tokens=40)).outputs[0]
    period = llm.tokenizer.encode(".", add_special_tokens=False)[-1]
    assert period in full.token_ids
    out = llm.generate("", SamplingParams(temperature=0, max_tokens=40, end_id=period)).outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == period
    assert out.token_ids == full.token_ids[:full.token_ids.index(period) + 1]


@pytest.mark.parametrize("bad", [None, 5, {"prompt": "hi"}, 3.5])
def test_generate_rejects_non_prompt_inputs(llm, bad):
    with pytest.raises(TypeError, match="inputs|prompt"):
        llm.generate(bad, SamplingParams(max_tokens=2))


def test_generate_accepts_a_tuple_of_token_ids(llm):
    out = llm.generate((1, 403), SamplingParams(temperature=0, max_tokens=4))
    assert out.prompt_token_ids == [1, 403]


@pytest.mark.parametrize("kwargs, exc, match", [
    ({"n": 129}, ValueError, "n must be in"),
    ({"best_of": 1000}, ValueError, "best_of"),
    ({"stop": 5}, TypeError, "stop must be"),
    ({"bad_words": 5}, TypeError, "bad_words"),
    ({"logit_bias": {1.7: 3}}, TypeError, "logit_bias"),
    ({"allowed_token_ids": [5], "bad_token_ids": [5]}, ValueError, "no token"),
])
def test_more_bad_sampling_params(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


def test_prompt_logprob_tokens_keep_their_spaces(llm):
    out = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    pieces = [e[t].decoded_token for e, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
    assert "".join(pieces) == "Once upon a time"


def test_shutdown_then_submit_fails_fast(stories_model_dir):
    llm = LLM(str(stories_model_dir), kv_cache_config=KvCacheConfig(max_tokens=1024))
    llm.shutdown()
    from kvpilot import EngineDeadError

    with pytest.raises(EngineDeadError):
        llm.generate("", SamplingParams(max_tokens=2))


def test_sliding_window_config_loads_with_the_window_kept_for_the_family(tmp_path):
    import json

    from kvpilot.model.config import ModelConfig

    cfg = {"architectures": ["MistralForCausalLM"], "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "sliding_window": 4096}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = ModelConfig.from_dir(tmp_path)
    assert loaded.architecture == "MistralForCausalLM"
    assert loaded.raw["sliding_window"] == 4096
    assert loaded.num_key_value_heads == 2


def test_aborted_non_streaming_request_keeps_what_it_generated(llm):
    import time

    from kvpilot import SamplingParams as SP

    out = llm.generate_async("", SP(temperature=0, max_tokens=400, ignore_eos=True))
    deadline = time.monotonic() + 30
    while llm._core.requests.get(out.request_id) is None or \
            llm._core.requests[out.request_id].seqs[0].num_output_tokens < 5:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    out.abort()
    with pytest.raises(RequestAborted):
        out.result(timeout=30)
    choice = out.outputs[0]
    assert choice.finish_reason == "abort" and len(choice.token_ids) >= 5
    assert GOLDEN.startswith(choice.text) and choice.text


def test_abort_never_sends_text_held_back_for_a_stop_string(llm):
    from kvpilot.core.detokenizer import hold_back_len
    from kvpilot.sampling_params import SamplingParams as SP
    from kvpilot.core.sequence import Request, Sequence
    from kvpilot.outputs import RequestOutput

    core = llm._core
    params = SP(max_tokens=10, stop=["red ball"])
    req = Request(10**9, [1], params, RequestOutput(10**9, "", [1], 1))
    seq = Sequence(request=req, index=0, token_ids=[1], seed=0)
    req.seqs.append(seq)
    seq.text, seq.sent_text_len = "she saw a big, red", 14  # " red" could still become "red ball"
    assert hold_back_len(seq.text, params.stop) == 3
    core.requests[req.request_id] = req
    core.abort_request(req.request_id)
    (output, update), = [(o, u) for o, u in core._outbox if o is req.output]
    core._outbox.clear()
    assert update.deltas[0].new_text == " " and update.deltas[0].finish_reason == "abort"  # not " red"
