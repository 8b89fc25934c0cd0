"""CPU tests of the GPU-path pieces: input preparation, the offline benchmarks, the fast random writer."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from support.engine import hf_greedy, make_tiny_llama
from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.tools.bench_offline import add_subcommands, auto_concurrency, random_prompts, run_latency, run_throughput
from kvpilot.runner.model_runner import ScheduledSeq

from kvpilot.tools.random_model import TINY, write_random_llama  # noqa: E402


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A `save_pretrained` random Llama with no tokenizer files."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "m", seed=3)


@pytest.fixture(scope="module")
def tiny_llm(tiny_dir):
    with LLM(str(tiny_dir), skip_tokenizer_init=True, device="cpu", max_batch_size=8, max_num_tokens=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024)) as llm:
        yield llm


def test_prepare_flattens_mixed_schedule(tiny_llm):
    runner = tiny_llm._executor
    seqs = [ScheduledSeq(1, [7, 8, 9], 0, [5], True),               # prefill, one block
            ScheduledSeq(2, [4], 6, [2, 9], True),                    # decode at position 6 -> block 9, offset 2
            ScheduledSeq(3, [1, 2], 3, [3, 6], False, all_logits=False),  # prefill chunk crossing a block
            ScheduledSeq(4, [3, 3], 0, [8], True, all_logits=True)]
    ids, pos, meta, sample_idx = runner.prepare(seqs)
    assert ids.tolist() == [7, 8, 9, 4, 1, 2, 3, 3]
    assert pos.tolist() == [0, 1, 2, 6, 3, 4, 0, 1]
    assert meta.slot_mapping.tolist() == [20, 21, 22, 38, 15, 24, 32, 33]
    assert meta.query_start_loc.tolist() == [0, 3, 4, 6, 8]
    assert meta.seq_lens.tolist() == [3, 7, 5, 2]
    assert meta.block_tables.tolist() == [[5, 0], [2, 9], [3, 6], [8, 0]]
    assert meta.block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert (meta.max_query_len, meta.max_seq_len) == (3, 7)
    assert sample_idx == [2, 3, 6, 7]


def test_random_prompts_deterministic_and_in_range():
    a = random_prompts(3, 5, 100, seed=1)
    assert a == random_prompts(3, 5, 100, seed=1) and a != random_prompts(3, 5, 100, seed=2)
    assert len(a) == 3 and all(len(p) == 5 and all(10 <= t < 100 for t in p) for p in a)
    with pytest.raises(ValueError):
        random_prompts(1, 5, 10)


def test_latency_and_throughput_counts(tiny_llm):
    lat = run_latency(tiny_llm, input_len=6, output_len=5, batch_size=2, num_iters=2, num_warmup=1)
    assert lat["batch_size"] == 2 and len(lat["itl_s_all"]) == 2
    assert 0 < lat["itl_s"] < lat["e2e_s"] and lat["ttft_s"] > 0
    prompts = random_prompts(5, 7, tiny_llm.model_config.vocab_size, seed=4)
    thr = run_throughput(tiny_llm, prompts, output_len=3, max_concurrency=2)
    assert thr["output_tokens"] == 15 and thr["max_concurrency"] == 2
    # Pool of 1024 tokens in blocks of 4; (7 + 3) tokens -> 3 blocks -> 85 sequences, capped at 8.
    assert auto_concurrency(tiny_llm, 7, 3) == 8
    assert auto_concurrency(tiny_llm, 500, 500) == 1


def test_bench_cli_without_tokenizer(tiny_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers(dest="bench"))
    out = tmp_path / "r.json"
    args = parser.parse_args(["throughput", "--model", str(tiny_dir), "--device", "cpu", "--num-prompts", "3",
                              "--input-len", "5", "--output-len", "4", "--output-json", str(out)])
    assert args._bench_run(args) == 0
    res = json.loads(out.read_text())
    assert res["output_tokens"] == 12 and res["num_prompts"] == 3 and res["device"] == "cpu"


def test_bench_cli_fp8_weights_and_kv_cache(tiny_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_subcommands(parser.add_subparsers(dest="bench"))
    out = tmp_path / "r.json"
    args = parser.parse_args(["throughput", "--model", str(tiny_dir), "--device", "cpu", "--num-prompts", "2",
                              "--input-len", "5", "--output-len", "3", "--quantization", "fp8",
                              "--kv-cache-dtype", "fp8", "--output-json", str(out)])
    assert args._bench_run(args) == 0
    assert json.loads(out.read_text())["output_tokens"] == 6


def test_fast_random_writer_loads_in_transformers_and_kvpilot(tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    path = write_random_llama(tmp_path / "r", dict(TINY, num_hidden_layers=3), dtype=torch.float32, seed=5,
                              std=0.08, layers_per_shard=2)
    assert len(list(path.glob("*.safetensors"))) == 3  # layers 0-1, layer 2, embeddings + head
    hf = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    stored = {}
    for f in path.glob("*.safetensors"):
        stored.update(load_file(str(f)))
    assert torch.equal(hf.model.layers[2].mlp.down_proj.weight, stored["model.layers.2.mlp.down_proj.weight"])
    assert torch.equal(hf.lm_head.weight, stored["lm_head.weight"])
    prompts = [[1, 17, 300, 42], [1, 5]]
    expected = hf_greedy(path, prompts, 10)
    with LLM(str(path), skip_tokenizer_init=True, device="cpu") as llm:
        got = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == expected
