"""Speculative decoding end to end on stories260K (CPU, float32): greedy output equals the output
without speculation token for token (n-gram, draft == target, a random-weight draft), in mixed
batches with requests that cannot speculate, under preemption, with stops inside accepted runs;
KV blocks of both pools return to zero; seeded sampling is reproducible; metrics count drafts."""

from __future__ import annotations

import pytest

from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.llmapi import DraftTargetDecodingConfig, NGramDecodingConfig

PROMPTS = ["Once upon a time", "The cat sat on the mat. The cat sat on the mat. The cat",
           "Lily and Tom went to the park. Lily and Tom", "A"]
MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
KW = dict(max_num_tokens=256, max_batch_size=16, kv_cache_config=KvCacheConfig(tokens_per_block=16))


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(stories_model_dir):
    with LLM(str(stories_model_dir), **KW) as llm:
        greedy = llm.generate(PROMPTS, GREEDY)
        penalised = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                            repetition_penalty=1.3))
        logprobs = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, logprobs=2))
    return greedy, penalised, logprobs


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory):
    from kvpilot.tools.random_model import TINY, write_random_llama

    return write_random_llama(tmp_path_factory.mktemp("draft"), dict(TINY, max_position_embeddings=512),
                              dtype=__import__("torch").float32, std=0.05)


@pytest.fixture(scope="module")
def ngram_llm(stories_model_dir):
    with LLM(str(stories_model_dir), speculative_config=NGramDecodingConfig(max_draft_len=4, max_matching_ngram_size=3),
             **KW) as llm:
        yield llm


@pytest.fixture(scope="module")
def self_draft_llm(stories_model_dir):
    cfg = DraftTargetDecodingConfig(max_draft_len=5, speculative_model=str(stories_model_dir))
    with LLM(str(stories_model_dir), speculative_config=cfg, **KW) as llm:
        yield llm


def _pools_empty(llm) -> None:
    core = llm._core
    assert core.kv.num_used_blocks == 0
    if core.spec.draft is not None:
        assert core.spec.draft.kv.num_used_blocks == 0 and not core.spec.draft.states


def test_ngram_greedy_equals_plain_greedy_in_a_mixed_batch(ngram_llm, baseline):
    greedy, penalised, logprobs = baseline
    before = ngram_llm._core.spec.totals.num_drafts
    # One batch: greedy prompts of different lengths, a request with a penalty (never speculates)
    # and one with logprobs (speculates, logprobs of the accepted tokens as without speculation).
    futs = [ngram_llm.generate_async(p, GREEDY) for p in PROMPTS]
    pen = ngram_llm.generate_async(PROMPTS[1], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                              repetition_penalty=1.3))
    lp = ngram_llm.generate_async(PROMPTS[2], SamplingParams(temperature=0, max_tokens=20, logprobs=2))
    assert _ids([f.result(timeout=120) for f in futs]) == _ids(greedy)
    assert pen.result(timeout=120).outputs[0].token_ids == penalised.outputs[0].token_ids
    got, want = lp.result(timeout=120).outputs[0], logprobs.outputs[0]
    assert got.token_ids == want.token_ids
    for a, b in zip(got.logprobs, want.logprobs):
        assert a.keys() == b.keys()
        for t in a:
            assert a[t].logprob == pytest.approx(b[t].logprob, abs=1e-4) and a[t].rank == b[t].rank
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
    totals = ngram_llm._core.spec.totals
    assert totals.num_drafts > before and 0 < totals.num_accepted_tokens <= totals.num_draft_tokens
    _pools_empty(ngram_llm)


def test_draft_equal_to_target_accepts_every_draft(self_draft_llm, baseline):
    spec = self_draft_llm._core.spec
    t0 = (spec.totals.num_draft_tokens, spec.totals.num_accepted_tokens)
    outs = self_draft_llm.generate(PROMPTS, GREEDY)
    assert _ids(outs) == _ids(baseline[0])
    drafted = spec.totals.num_draft_tokens - t0[0]
    accepted = spec.totals.num_accepted_tokens - t0[1]
    assert drafted > 80 and accepted == drafted
    # per request too (RequestOutput.metrics)
    assert sum(o.metrics.num_draft_tokens for o in outs) == drafted
    assert all(0 < o.metrics.num_accepted_tokens == o.metrics.num_draft_tokens for o in outs)
    _pools_empty(self_draft_llm)


def test_random_draft_accepts_less_and_output_is_unchanged(stories_model_dir, random_draft, baseline):
    cfg = DraftTargetDecodingConfig(max_draft_len=3, speculative_model=str(random_draft))
    with LLM(str(stories_model_dir), speculative_config=cfg, **KW) as llm:
        sp = SamplingParams(temperature=0, max_tokens=24)
        assert _ids(llm.generate(PROMPTS[:2], sp)) == [ids[:24] for ids in _ids(baseline[0][:2])]
        t = llm._core.spec.totals
        assert t.num_draft_tokens > 40 and t.num_accepted_tokens < 0.5 * t.num_draft_tokens
        _pools_empty(llm)


def test_stops_inside_an_accepted_run(self_draft_llm, baseline):
    want = baseline[0][0].outputs[0]
    # max_tokens not a multiple of the 6 tokens a fully accepted step emits
    out = self_draft_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=9)).outputs[0]
    assert out.token_ids == want.token_ids[:9] and out.finish_reason == "length"
    # a stop token id in the middle of a run
    stop_id = want.token_ids[13]
    first = want.token_ids.index(stop_id)
    out = self_draft_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                             stop_token_ids=[stop_id])).outputs[0]
    assert out.token_ids == want.token_ids[:first + 1] and out.finish_reason == "stop"
    # a stop string: the text ends before it, as without speculation
    stop = want.text[20:25]
    out = self_draft_llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                             stop=[stop])).outputs[0]
    assert out.text == want.text[:want.text.index(stop)] and out.stop_reason == stop
    _pools_empty(self_draft_llm)


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_preemption_chunked_prefill_and_budget_cuts_keep_greedy_exact(stories_model_dir, baseline, method):
    # 7 blocks of 16 tokens for 4 sequences of up to ~60 tokens: preemptions; 12 tokens per step:
    # prompts are chunked beside verifying sequences, and the budget cuts drafts short. The draft
    # pool is as small (the target's size): sequences whose drafts do not fit it get none.
    kv = KvCacheConfig(tokens_per_block=16, max_tokens=16 * 7)
    cfg = (NGramDecodingConfig(max_draft_len=4) if method == "ngram"
           else DraftTargetDecodingConfig(max_draft_len=4, speculative_model=str(stories_model_dir)))
    with LLM(str(stories_model_dir), speculative_config=cfg, max_num_tokens=12, kv_cache_config=kv) as llm:
        assert _ids(llm.generate(PROMPTS, GREEDY)) == _ids(baseline[0])
        assert llm._core.scheduler.num_preemptions > 0 and llm._core.spec.totals.num_drafts > 0
        _pools_empty(llm)


def test_seeded_sampling_is_reproducible_and_batch_independent(self_draft_llm):
    sp = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, max_tokens=20, seed=1234)
    alone = self_draft_llm.generate(PROMPTS[1], sp).outputs[0].token_ids
    batch = self_draft_llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]],
                                    [SamplingParams(temperature=0.7, max_tokens=20, seed=5), sp, GREEDY])
    assert batch[1].outputs[0].token_ids == alone and len(alone) == 20
    other = self_draft_llm.generate(PROMPTS[1], SamplingParams(temperature=0.9, top_k=40, top_p=0.95,
                                                               max_tokens=20, seed=99)).outputs[0].token_ids
    assert other != alone


def test_max_concurrency_turns_speculation_off_in_large_batches(ngram_llm, baseline):
    spec = ngram_llm._core.spec
    spec.config.max_concurrency = 1
    try:
        before = spec.totals.num_drafts
        assert _ids(ngram_llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=12))) == [
            ids[:12] for ids in _ids(baseline[0][:3])]
        assert spec.totals.num_drafts == before  # 3 running > 1: no step speculated
        ngram_llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12))
        assert spec.totals.num_drafts > before
    finally:
        spec.config.max_concurrency = None


def test_stats_and_prometheus_count_drafts(ngram_llm):
    from prometheus_client import generate_latest

    from kvpilot.server.metrics import PrometheusStatLogger

    metrics = PrometheusStatLogger("m", 512)
    ngram_llm.add_stat_logger(metrics)
    ngram_llm.generate(PROMPTS[1], GREEDY)
    stats = [s for s in ngram_llm.get_stats() if "specDecodingStats" in s]
    assert stats
    spec = stats[-1]["specDecodingStats"]
    assert spec["numRequestsWithDraftTokens"] == 1 and spec["acceptanceLength"] >= 1.0
    text = generate_latest(metrics.registry).decode()
    for name in ("kvpilot:spec_decode_num_drafts_total", "kvpilot:spec_decode_num_draft_tokens_total",
                 "kvpilot:spec_decode_num_accepted_tokens_total",
                 'kvpilot:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"}'):
        assert name in text


def test_verification_replays_prefill_graphs(stories_model_dir, baseline):
    """Verification steps replay the prefill CUDA graphs (CPU doubles here): logits at every draft
    position come from the graph's static hidden states, and greedy output is unchanged."""
    import torch
    from support.graphs import cpu_graph_class

    from kvpilot.runner.cuda_graphs import PrefillGraphs

    with LLM(str(stories_model_dir), speculative_config=NGramDecodingConfig(max_draft_len=4), **KW) as llm:
        runner = llm._executor
        g = cpu_graph_class(PrefillGraphs)(runner)
        with torch.inference_mode():
            g.capture()
        replays = []
        run = g.run

        def counting_run(seqs, fix_inputs=None):
            replays.append(sum(s.verify for s in seqs))
            return run(seqs, fix_inputs)

        g.run = counting_run
        runner.prefill_graphs = g
        assert _ids(llm.generate(PROMPTS, GREEDY)) == _ids(baseline[0])
        assert sum(replays) > 10  # verification entries went through the graphs
        _pools_empty(llm)


def test_streaming_parallel_sampling_and_abort_mid_speculation(self_draft_llm, baseline):
    import asyncio

    want = baseline[0][0].outputs[0]

    async def stream():
        chunks = []
        async for c in self_draft_llm.generate_async(PROMPTS[0], GREEDY, streaming=True):
            chunks.append((c.outputs[0].text_diff, list(c.outputs[0].token_ids_diff)))
        return chunks

    chunks = asyncio.run(stream())
    assert "".join(text for text, _ in chunks) == want.text
    assert [t for _, ids in chunks for t in ids] == want.token_ids
    assert len(chunks) < len(want.token_ids) / 3  # one chunk per step, every draft accepted
    # n = 3 sampled choices, each a speculating sequence of its own
    out = self_draft_llm.generate(PROMPTS[2], SamplingParams(n=3, temperature=1.0, max_tokens=16, seed=7))
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 16 for c in out.outputs)
    # an abort while its request speculates frees both pools
    import time

    spec = self_draft_llm._core.spec
    before = spec.totals.num_drafts
    fut = self_draft_llm.generate_async(PROMPTS[1], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True))
    deadline = time.monotonic() + 60
    while spec.totals.num_drafts == before and time.monotonic() < deadline:
        time.sleep(0.005)
    assert spec.totals.num_drafts > before and not fut.finished
    self_draft_llm.abort(fut.request_id)
    with pytest.raises(Exception):
        fut.result(timeout=60)
    self_draft_llm.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=4))  # a step after the abort
    _pools_empty(self_draft_llm)
