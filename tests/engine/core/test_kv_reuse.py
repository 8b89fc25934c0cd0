"""Block reuse, preemption and cancellation (KV-cache lifecycle) on the stories260K model."""

from __future__ import annotations

import asyncio
import random

import pytest

from support.engine import GOLDEN
from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.core.kv_cache_manager import KVCacheManager
from kvpilot.sampling_params import SamplingParams as SP
from kvpilot.core.sequence import Request, Sequence

PROMPTS = ["", "Once upon a time", "The little dog ran", "Tom and Sue went to the park. They", "She was sad"]


def _run_all(llm, prompts, sp):
    async def run():
        return await asyncio.gather(*(llm.generate_async(p, sp) for p in prompts))
    return [o.outputs[0].text for o in asyncio.run(run())]


@pytest.fixture(scope="module")
def reference(stories_model_dir):
    sp = SamplingParams(temperature=0, max_tokens=80)
    with LLM(str(stories_model_dir), kv_cache_config=KvCacheConfig(enable_block_reuse=False)) as llm:
        return {p: llm.generate(p, sp).outputs[0].text for p in PROMPTS}


def test_reuse_on_gives_same_outputs(stories_model_dir, reference):
    sp = SamplingParams(temperature=0, max_tokens=80)
    prompts = [p for p in PROMPTS for _ in range(6)]
    with LLM(str(stories_model_dir), kv_cache_config=KvCacheConfig(enable_block_reuse=True, tokens_per_block=4)) as llm:
        first = _run_all(llm, prompts, sp)
        second = _run_all(llm, prompts, sp)  # now the prompts' full blocks are cached
        stats = llm.get_stats(timeout=1)
    assert first == second == [reference[p] for p in prompts]
    assert stats[-1]["kvCacheStats"]["reusedBlocks"] > 0
    assert stats[-1]["kvCacheStats"]["usedNumBlocks"] == 0


def test_preemption_keeps_greedy_outputs(stories_model_dir, reference):
    sp = SamplingParams(temperature=0, max_tokens=80)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    # 32 requests of up to ~90 tokens in a pool of 320 tokens: most steps preempt someone.
    kv = KvCacheConfig(tokens_per_block=8, max_tokens=320)
    with LLM(str(stories_model_dir), kv_cache_config=kv) as llm:
        texts = _run_all(llm, prompts, sp)
        stats = llm.get_stats(timeout=1)
        preemptions = llm._core.scheduler.num_preemptions
        used = llm._core.kv.num_used_blocks
    assert texts == [reference[p] for p in prompts]
    assert preemptions > 32, preemptions
    assert used == 0 and stats[-1]["kvCacheStats"]["usedNumBlocks"] == 0


def test_request_that_can_never_fit_is_rejected(stories_model_dir):
    with LLM(str(stories_model_dir), kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=64)) as llm:
        with pytest.raises(ValueError, match="KV cache pool"):
            llm.generate("", SamplingParams(max_tokens=100))
        assert GOLDEN.startswith(llm.generate("", SamplingParams(temperature=0, max_tokens=20)).outputs[0].text)


def test_shared_system_prompt_hit_rate(stories_model_dir):
    with LLM(str(stories_model_dir), kv_cache_config=KvCacheConfig(tokens_per_block=16)) as llm:
        system = [1] + llm.tokenizer.encode(GOLDEN * 5, add_special_tokens=False)[:255]
        assert len(system) == 256
        questions = [llm.tokenizer.encode(f" Question {i}: who is Lily?", add_special_tokens=False) for i in range(16)]
        sp = SamplingParams(temperature=0, max_tokens=4)
        llm.generate(system + questions[0], sp)  # warms the cache with the system prompt
        llm.get_stats(timeout=1)
        outs = llm.generate([system + q for q in questions[1:]], sp, use_tqdm=False)
        stats = llm.get_stats(timeout=1)
    prompt_tokens = sum(len(system) + len(q) for q in questions[1:])
    prefilled = sum(s["inflightBatchingStats"]["numCtxTokens"] for s in stats)
    hit_rate = llm._core.kv.stats.hits / llm._core.kv.stats.queries
    assert len(outs) == 15
    assert hit_rate > 0.9 or stats[-1]["kvCacheStats"]["cacheHitRate"] > 0.8
    # Only the questions (and the partial block of the system prompt) are prefilled.
    assert prefilled < 0.15 * prompt_tokens, (prefilled, prompt_tokens)


def test_random_aborts_leave_no_blocks(stories_model_dir):
    rng = random.Random(0)
    with LLM(str(stories_model_dir), kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=2048)) as llm:
        async def one(i):
            out = llm.generate_async(PROMPTS[i % 5], SamplingParams(temperature=0.8, seed=i, max_tokens=200,
                                                                   ignore_eos=True), streaming=True)
            stop_after = rng.randrange(0, 30)
            n = 0
            async for _ in out:
                n += 1
                if n > stop_after:
                    break
            out.abort()

        async def cancelled(i):
            task = asyncio.ensure_future(llm.generate_async(PROMPTS[i % 5], SamplingParams(max_tokens=200, ignore_eos=True)))
            await asyncio.sleep(rng.random() * 0.05)
            task.cancel()

        async def main():
            await asyncio.gather(*(one(i) for i in range(70)), *(cancelled(i) for i in range(30)),
                                 return_exceptions=True)
            await asyncio.sleep(0.5)

        asyncio.run(main())
        assert llm._core.kv.num_used_blocks == 0
        assert not llm._core.scheduler.running and not llm._core.scheduler.waiting
        # Still serving correctly afterwards.
        assert GOLDEN.startswith(llm.generate("", SamplingParams(temperature=0, max_tokens=30)).outputs[0].text)


def test_hash_collision_never_returns_wrong_blocks(monkeypatch):
    import kvpilot.core.kv_cache_manager as kvm

    monkeypatch.setattr(kvm, "hash_block", lambda parent, tokens, extra=b"": b"same-hash-for-all")
    kv = KVCacheManager(num_blocks=8, tokens_per_block=2)

    def seq(tokens):
        req = Request(0, tokens, SP(max_tokens=1), output=None)
        s = Sequence(request=req, index=0, token_ids=list(tokens), seed=0)
        req.seqs.append(s)
        return s

    a = seq([1, 2, 3, 4, 5])
    kv.admit(a, kv.match_prefix(a))
    kv.allocate(a, 5)
    a.num_computed_tokens = 5
    kv.cache_full_blocks(a)
    kv.free(a)
    b = seq([9, 9, 9, 9, 5])  # same (fake) hash, different tokens: must miss
    assert kv.match_prefix(b) == []
    c = seq([1, 2, 7, 7, 7])
    assert len(kv.match_prefix(c)) == 1  # the first block really matches
