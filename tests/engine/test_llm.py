"""The LLM API end to end on the real stories260K model and on random tiny Llamas vs transformers."""

from __future__ import annotations

import asyncio
import random

import pytest

from support.engine import GOLDEN, hf_greedy, make_tiny_llama
from kvpilot import LLM, KvCacheConfig, RequestOutput, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=120)


@pytest.fixture(scope="module")
def llm(stories_model_dir):
    with LLM(str(stories_model_dir), max_num_tokens=256, kv_cache_config=KvCacheConfig(tokens_per_block=16)) as llm:
        yield llm


def test_golden_text_generate(llm):
    out = llm.generate("", GREEDY)
    assert isinstance(out, RequestOutput)
    assert out.prompt_token_ids == [1]
    assert out.outputs[0].text.startswith(GOLDEN)
    assert out.outputs[0].finish_reason == "length"
    assert len(out.outputs[0].token_ids) == 120
    assert out.finished


def test_golden_text_streaming(llm):
    async def run():
        diffs, token_diffs, last = [], [], None
        async for chunk in llm.generate_async("", GREEDY, streaming=True):
            diffs.append(chunk.outputs[0].text_diff)
            token_diffs.extend(chunk.outputs[0].token_ids_diff)
            last = chunk
        return diffs, token_diffs, last

    diffs, token_diffs, last = asyncio.run(run())
    assert last.finished
    assert "".join(diffs) == last.outputs[0].text
    assert token_diffs == last.outputs[0].token_ids
    assert last.outputs[0].text.startswith(GOLDEN)
    assert len(diffs) > 50  # really streamed, step by step


def test_generate_async_await_styles(llm):
    async def run():
        done = await llm.generate_async("", SamplingParams(temperature=0, max_tokens=40))
        stream = await llm.generate_async("", SamplingParams(temperature=0, max_tokens=40), streaming=True)
        chunks = [c.outputs[0].text_diff async for c in stream]
        res = await llm.generate_async("", SamplingParams(temperature=0, max_tokens=40)).aresult()
        return done, "".join(chunks), res

    done, streamed, res = asyncio.run(run())
    assert done.finished and done.outputs[0].text == streamed == res.outputs[0].text
    assert GOLDEN.startswith(done.outputs[0].text[:40])
    sync = llm.generate_async("", SamplingParams(temperature=0, max_tokens=40)).result(timeout=60)
    assert sync.outputs[0].text == done.outputs[0].text


def test_batching_does_not_change_greedy_output(llm):
    prompts = ["", "Once upon a time", "The little dog", "Tom and Sue went to the", "She was sad because"]
    sp = SamplingParams(temperature=0, max_tokens=60)
    alone = [llm.generate(p, sp).outputs[0].text for p in prompts]
    assert alone[0].startswith(GOLDEN[:100])
    batch = [p for p in prompts for _ in range(40)]
    random.Random(0).shuffle(batch)

    async def run():
        return await asyncio.gather(*(llm.generate_async(p, sp) for p in batch))

    outs = asyncio.run(run())
    for p, o in zip(batch, outs):
        assert o.outputs[0].text == alone[prompts.index(p)], p
    stats = llm.get_stats(timeout=1)
    assert max(s["numActiveRequests"] for s in stats) > 100  # they really shared batches
    assert stats[-1]["kvCacheStats"]["usedNumBlocks"] == 0


def test_generate_list_in_input_order_and_token_ids(llm):
    prompts = ["The cat", [1, 403, 261], ""]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.prompt for o in outs] == ["The cat", None, ""]
    assert outs[1].prompt_token_ids == [1, 403, 261]
    assert outs[2].outputs[0].text == llm.generate("", SamplingParams(temperature=0, max_tokens=8)).outputs[0].text
    assert GOLDEN.startswith(outs[2].outputs[0].text)


def test_seeded_sampling_is_reproducible_and_batch_independent(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234, max_tokens=40)
    a = llm.generate("Once upon a time", sp).outputs[0].text
    mixed = llm.generate(["Once upon a time", "The dog", "Once upon a time"],
                         [sp, SamplingParams(temperature=1.0, max_tokens=40), sp], use_tqdm=False)
    assert mixed[0].outputs[0].text == a == mixed[2].outputs[0].text
    other = llm.generate("Once upon a time", SamplingParams(temperature=0.9, top_p=0.95, top_k=40,
                                                             seed=99, max_tokens=40)).outputs[0].text
    assert other != a


def test_stop_strings_and_tokens(llm):
    full = llm.generate("", GREEDY).outputs[0].text
    out = llm.generate("", SamplingParams(temperature=0, max_tokens=120, stop=["red ball"])).outputs[0]
    assert out.text == full[:full.index("red ball")]
    assert out.finish_reason == "stop" and out.stop_reason == "red ball"
    out = llm.generate("", SamplingParams(temperature=0, max_tokens=120, stop="red ball",
                                          include_stop_str_in_output=True)).outputs[0]
    assert out.text == full[:full.index("red ball") + len("red ball")]
    ids = llm.generate("", GREEDY).outputs[0].token_ids
    out = llm.generate("", SamplingParams(temperature=0, max_tokens=120, stop_token_ids=[ids[5]])).outputs[0]
    assert out.token_ids == ids[:6] and out.stop_reason == ids[5] and out.finish_reason == "stop"


def test_eos_ends_story(llm):
    out = llm.generate("", SamplingParams(temperature=0, max_tokens=500)).outputs[0]
    # stories260K ends a story with BOS (id 1); generation_config lists it as an end id.
    assert out.finish_reason == "stop" and out.token_ids[-1] in (1, 2)
    assert len(out.token_ids) < 500


def test_utf8_never_broken(llm):
    # Byte-fallback tokens: "é" is two byte tokens; text must only ever hold whole characters.
    ids = llm.tokenizer.encode("café 日本", add_special_tokens=False)
    out = llm.generate([1] + ids, SamplingParams(temperature=1.0, seed=3, max_tokens=30))
    assert "\ufffd" not in out.outputs[0].text


@pytest.mark.parametrize("kwargs, field", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"n": 0}, "n"), ({"min_p": 2.0}, "min_p"), ({"top_k": -5}, "top_k"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_unknown_sampling_field():
    with pytest.raises(TypeError, match="no_such_field"):
        SamplingParams(no_such_field=1)


def test_bad_prompts_rejected_before_queueing(llm):
    with pytest.raises(ValueError, match="max_seq_len"):
        llm.generate("hello " * 600, SamplingParams(max_tokens=4))
    long = llm.generate("hello", SamplingParams(max_tokens=600, ignore_eos=True))
    # Clipped at max_seq_len (512 for stories260K).
    assert long.outputs[0].finish_reason == "length"
    assert len(long.prompt_token_ids) + len(long.outputs[0].token_ids) == 512
    with pytest.raises(ValueError, match="token ids"):
        llm.generate([1, 99999], SamplingParams(max_tokens=4))
    with pytest.raises(TypeError):
        llm.generate_async(3.5)
    # The engine keeps serving.
    text = llm.generate("", SamplingParams(temperature=0, max_tokens=10)).outputs[0].text
    assert len(text) > 20 and GOLDEN.startswith(text)


def test_abort_frees_blocks(llm):
    async def run():
        out = llm.generate_async("", SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), streaming=True)
        async for chunk in out:
            if len(chunk.outputs[0].token_ids) >= 5:
                out.abort()
                break
        await asyncio.sleep(0.2)

    asyncio.run(run())
    stats = llm.get_stats(timeout=1)
    assert stats[-1]["kvCacheStats"]["usedNumBlocks"] == 0
    assert stats[-1]["numActiveRequests"] == 0


def test_get_stats_fields(llm):
    llm.generate("", SamplingParams(temperature=0, max_tokens=5))
    stats = llm.get_stats(timeout=2)
    assert stats, "stats expected after a request"
    s = stats[-1]
    for key in ("iter", "iterLatencyMS", "gpuMemUsage", "numActiveRequests", "kvCacheStats"):
        assert key in s
    kv = s["kvCacheStats"]
    assert kv["tokensPerBlock"] == 16
    assert kv["maxNumBlocks"] == kv["freeNumBlocks"] + kv["usedNumBlocks"]


@pytest.mark.parametrize("shards, rope_scaling", [
    (False, None),
    (True, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32}),
])
def test_random_llama_matches_transformers(tmp_path, shards, rope_scaling):
    path = make_tiny_llama(tmp_path / "tiny", rope_scaling=rope_scaling, shards=shards)
    if shards:
        assert (path / "model.safetensors.index.json").exists()
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 384) for _ in range(n)] for n in (1, 5, 17, 40, 77)]
    steps = 32
    expected = hf_greedy(path, prompts, steps)
    # Small blocks and a small token budget: chunked prefill mixed with decodes across block boundaries.
    with LLM(str(path), skip_tokenizer_init=True, max_num_tokens=24, max_seq_len=256,
             kv_cache_config=KvCacheConfig(tokens_per_block=8)) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True),
                            use_tqdm=False)
    for p, o, e in zip(prompts, outs, expected):
        assert o.outputs[0].token_ids == e, f"prompt of {len(p)} tokens"
        assert o.outputs[0].text == ""


def test_tied_embeddings_and_context_manager(tmp_path):
    path = make_tiny_llama(tmp_path / "tied", tie=True, layers=2, seed=1)
    prompts = [[5, 6, 7, 8], [100]]
    expected = hf_greedy(path, prompts, 12)
    with LLM(str(path), skip_tokenizer_init=True) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    with pytest.raises(Exception):
        llm.generate([5], SamplingParams(max_tokens=2))


def test_bad_constructor_arguments(stories_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="max_batch_size"):
        LLM(str(stories_model_dir), max_batch_size=0)
    with pytest.raises(TypeError):
        LLM(str(stories_model_dir), no_such_arg=1)
    with pytest.raises(ValueError, match="tokens_per_block"):
        KvCacheConfig(tokens_per_block=0)
