"""Two GPUs (NCCL), bf16, four layers of Llama-3.1-8B's shape (random weights): one GPU with
``Tuning(tp_invariant=2)`` gives TP 2's greedy tokens and logprobs exactly (engine/model/tp_invariant.py),
one request at a time (prefill graphs and padded eager prefill, a 300-token prompt past the graphs, decode
graphs) and five requests at once (decode graphs at batch 5, mixed steps); one GPU without the mode
does not. With ``T = 4`` TP 2 (two shards per rank, the all-gather sum) gives one GPU's tokens.
Skipped without two CUDA GPUs. The whole model's figures: ``benchmarks/gpu_tp_greedy.py
--invariant 2``."""

from __future__ import annotations


import pytest
import torch

from kvpilot import LLM, KvCacheConfig, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

LENGTHS = (5, 33, 120, 250, 300)  # prefill buckets 16, 64, 128, 256; 300 tokens: eager everywhere
TOKENS = 24


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from kvpilot.tools.random_model import LLAMA31_8B, write_random_llama

    shape = dict(LLAMA31_8B, num_hidden_layers=4)
    return write_random_llama(tmp_path_factory.mktemp("tp_invariant_gpu") / "m", shape, device="cuda")


def _run(model_dir, tp: int, invariant, monkeypatch):
    """(one at a time, all at once): each a list of (token ids, chosen-token logprobs) per prompt."""
    monkeypatch.setenv("KVPILOT_TUNING", '{"tp_invariant": %d}' % int(invariant or 0))
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 128256, (n,), generator=g).tolist() for n in LENGTHS]
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=0)
    with LLM(str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=tp, device="cuda", dtype="bfloat16",
             max_batch_size=8, max_seq_len=1024, kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.3)) as llm:
        alone = [llm.generate(p, params) for p in prompts]
        together = llm.generate(prompts, params, use_tqdm=False)
    def pick(outs):
        return [(o.outputs[0].token_ids, [next(iter(d.values())).logprob for d in o.outputs[0].logprobs])
                for o in outs]

    return pick(alone), pick(together)


def test_one_gpu_invariant2_is_tp2_exactly(model_dir, monkeypatch):
    inv_alone, inv_together = _run(model_dir, 1, "2", monkeypatch)
    tp_alone, tp_together = _run(model_dir, 2, None, monkeypatch)
    assert inv_alone == tp_alone
    assert inv_together == tp_together
    plain_alone, _ = _run(model_dir, 1, None, monkeypatch)
    assert plain_alone != tp_alone  # without the mode one GPU rounds otherwise (the test has teeth)


def test_tp2_with_two_shards_per_rank_is_one_gpu_exactly(model_dir, monkeypatch):
    """``T = 4``: each of two GPUs holds two shards and the ranks all-gather their partials (NCCL, in
    decode graphs too); one GPU holds all four. Same tokens and logprobs, alone and together."""
    assert _run(model_dir, 2, "4", monkeypatch) == _run(model_dir, 1, "4", monkeypatch)
