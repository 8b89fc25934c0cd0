"""Tensor-parallel-invariant mode (``Tuning(tp_invariant=T)``, engine/model/tp_invariant.py), on CPU.

Every layout computes a TP-``T`` group's decomposition, so in bf16:

- TP 1 with ``T = 2`` gives bit for bit the logits, greedy tokens, logprobs and prompt logprobs of
  TP 2 with default settings (and of TP 2 with ``T = 2`` set, the same model), through `LLM` and at
  the runner (prefill and decode logits of every step, fused and unfused decoder paths), while TP 1
  without the mode does not (the test has teeth);
- TP 2 with ``T = 4`` (two shards per rank, the all-gather sum) gives TP 1 with ``T = 4``'s logits,
  and so does TP 4 (one shard per rank, more than two ranks; marked slow); stories260K (tied
  embeddings) with ``T = 2`` and ``T = 4`` through `LLM` likewise;
- each shard holds exactly what a TP-``T`` rank loads (own contiguous tensors, padded LM head rows);
- bad values of ``T`` fail when the model is built; with the mode off the model is the default one;
- the attention kernels' launch hint (``launch_kv_heads``) makes one call over several shards' heads
  compute each head as the per-shard call does (Triton interpreter).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from support.parallel_exact import DECODE_STEPS, spawn_ranks
from support.tp_invariant import set_tuning, tuning_now, invariant_rank, make_gqa_llama
from kvpilot.config import KvCacheConfig
from kvpilot.model.config import ModelConfig
from kvpilot.runner.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory) -> Path:
    # GQA 8 / 4 heads, intermediate 96, vocab 385, random biases: splits into 1, 2 or 4 shards.
    return make_gqa_llama(tmp_path_factory.mktemp("tp_invariant") / "gqa")


def _set_invariant(monkeypatch, value) -> None:
    """``KVPILOT_TUNING``'s ``tp_invariant`` set to ``value`` (None: removed), other fields kept."""
    set_tuning(monkeypatch, tp_invariant=None if value is None else int(value))


def _meta_model(cfg: ModelConfig, tp_rank: int = 0, tp_size: int = 1):
    from kvpilot.model.llama import LlamaForCausalLM, ParallelContext

    with torch.device("meta"):
        return LlamaForCausalLM(cfg, ParallelContext(tp_rank, tp_size, None), tuning=tuning_now())


def _cpu_runner(model_dir: Path, dtype: str = "bfloat16", tp_rank: int = 0, tp_size: int = 1) -> ModelRunner:
    from kvpilot.model.llama import ParallelContext

    pc = None if tp_size == 1 else ParallelContext(tp_rank, tp_size, None)  # building needs no process group
    return ModelRunner(model_dir, ModelConfig.from_dir(model_dir), KvCacheConfig(tokens_per_block=8, max_tokens=256),
                       max_num_tokens=64, max_batch_size=4, max_seq_len=64, device="cpu", dtype=dtype, pc=pc,
                       tuning=tuning_now())


# ---- the switch and its validation ------------------------------------------------------------------


@pytest.mark.parametrize("value,want", [(None, 0), ("0", 0), ("1", 1), ("2", 2), (" 4 ", 4)])
def test_switch_values(monkeypatch, value, want):
    _set_invariant(monkeypatch, value)
    assert tuning_now().tp_invariant == want


@pytest.mark.parametrize("value", ['"two"', "1.5", "-2", "true"])
def test_switch_must_be_an_integer(monkeypatch, value):
    monkeypatch.setenv("KVPILOT_TUNING", '{"tp_invariant": %s}' % value)
    with pytest.raises(ValueError, match=r"KVPILOT_TUNING: .*tp_invariant"):
        tuning_now()


@pytest.mark.parametrize("value,tp,match", [
    ("3", 2, "must be a multiple of tensor_parallel_size 2"),  # not a multiple of t
    ("2", 4, "must be a multiple of tensor_parallel_size 4"),  # smaller than t
    ("8", 1, "must divide num_key_value_heads 4"),  # 8 | 8 attention heads, not | 4 KV heads
    ("8", 2, "must divide num_key_value_heads 4"),
    ("3", 1, "must divide num_attention_heads 8"),
])
def test_bad_invariant_size_fails_at_build(monkeypatch, gqa_model, value, tp, match):
    _set_invariant(monkeypatch, value)
    with pytest.raises(ValueError, match=match):
        _meta_model(ModelConfig.from_dir(gqa_model), 0, tp)


def test_invariant_size_must_divide_intermediate_size(monkeypatch, gqa_model):
    cfg = ModelConfig.from_dir(gqa_model)
    cfg.intermediate_size = 98  # 2 | 98, 4 does not
    _set_invariant(monkeypatch, "4")
    with pytest.raises(ValueError, match="must divide intermediate_size 98"):
        _meta_model(cfg)
    _set_invariant(monkeypatch, "2")
    assert _meta_model(cfg).invariant_shards == 2


def test_bad_invariant_size_fails_when_an_llm_starts(monkeypatch, gqa_model):
    from kvpilot import LLM

    _set_invariant(monkeypatch, "3")
    with pytest.raises(ValueError, match="tp_invariant=3 must divide num_attention_heads"):
        LLM(str(gqa_model), skip_tokenizer_init=True, device="cpu")


def test_switch_is_read_once_and_overrides_the_fp32_reduction(monkeypatch, gqa_model):
    from kvpilot.model.llama import LlamaDecoderLayer
    from kvpilot.model.tp_invariant import InvariantDecoderLayer

    cfg = ModelConfig.from_dir(gqa_model)
    set_tuning(monkeypatch, tp_reduce_fp32=True)
    _set_invariant(monkeypatch, "4")
    model = _meta_model(cfg, 1, 2)
    _set_invariant(monkeypatch, None)  # read at construction: no effect now
    assert (model.tp_invariant, model.invariant_shards) == (4, 2)
    assert all(isinstance(layer, InvariantDecoderLayer) for layer in model.layers)
    assert model.tp_reduce_fp32 is False  # ignored in this mode
    attn = model.layers[0].self_attn
    # Rank 1 of 2 holds shards 2 and 3 of 4: 2 x (2 heads, 1 KV head); attention launches as for 1.
    assert (attn.first_shard, attn.num_heads, attn.num_kv_heads, attn.launch_kv_heads) == (2, 4, 2, 1)
    # TP 2 with T = 2: one shard per rank is the default model (its all-reduce is the invariant sum),
    # with the fp32 reduction off.
    _set_invariant(monkeypatch, "2")
    model = _meta_model(cfg, 0, 2)
    assert model.invariant_shards == 0 and model.tp_reduce_fp32 is False
    assert all(isinstance(layer, LlamaDecoderLayer) and not layer.mlp.reduce_fp32 for layer in model.layers)


# ---- mode off: the default model --------------------------------------------------------------------


def test_mode_off_is_the_default_model(monkeypatch, gqa_model):
    """Unset, 0 and 1 (one shard: the plain model) build the default modules with the default
    parameters and compute the same logits bit for bit; in float32 they are transformers' logits."""
    from transformers import LlamaForCausalLM as HFLlama

    from kvpilot.model.llama import LlamaDecoderLayer

    cfg = ModelConfig.from_dir(gqa_model)
    shapes = None
    for value in (None, "0", "1"):
        _set_invariant(monkeypatch, value)
        model = _meta_model(cfg)
        assert model.invariant_shards == 0 and model.lm_head_shards is None
        assert all(type(layer) is LlamaDecoderLayer for layer in model.layers)
        got = {n: tuple(p.shape) for n, p in model.named_parameters()}
        assert shapes is None or got == shapes
        shapes = got
    assert "layers.0.self_attn.qkv_proj.weight" in shapes and "lm_head" in shapes
    assert not any("shards" in n for n in shapes)

    ids = torch.tensor([1, 17, 40, 3, 99, 5, 60, 7, 8])
    from kvpilot.runner.model_runner import ScheduledSeq

    def prefill_logits(value, dtype):
        _set_invariant(monkeypatch, value)
        runner = _cpu_runner(gqa_model, dtype)
        seq = ScheduledSeq(0, ids.tolist(), 0, [0, 1], True, all_logits=True)
        with torch.inference_mode():
            return runner.execute([seq])[0].float()

    base = prefill_logits(None, "bfloat16")
    for value in ("0", "1"):
        assert torch.equal(prefill_logits(value, "bfloat16"), base)
    assert not torch.equal(prefill_logits("2", "bfloat16"), base)  # the mode changes bf16 rounding
    hf = HFLlama.from_pretrained(str(gqa_model), dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(None, "float32"), want, rtol=0, atol=1e-4)
    # float32 invariant: the same model up to fp32 summation order.
    torch.testing.assert_close(prefill_logits("4", "float32"), want, rtol=0, atol=1e-4)


# ---- shards are TP-T ranks' weights -----------------------------------------------------------------


def _assert_own_contiguous(tensors: list[torch.Tensor]) -> None:
    ptrs = [t.untyped_storage().data_ptr() for t in tensors]
    assert len(set(ptrs)) == len(ptrs) and all(t.is_contiguous() and t.storage_offset() == 0 for t in tensors)


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_shards_hold_what_tp_ranks_load(monkeypatch, tmp_path, tie):
    """TP 2 rank 1 with T = 4 holds shards 2 and 3: TP 4 ranks 2 and 3's tensors, each its own
    contiguous tensor; the whole row-parallel biases; LM head rows (zero-padded past vocab 385,
    the embedding's rows when tied, which the embedding then reads)."""
    path = make_gqa_llama(tmp_path / "m", tie=tie)
    _set_invariant(monkeypatch, "4")
    inv = _cpu_runner(path, "float32", 1, 2).model
    _set_invariant(monkeypatch, None)
    ranks = {r: _cpu_runner(path, "float32", r, 4).model for r in (2, 3)}
    for i, layer in enumerate(inv.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for j, r in enumerate((2, 3)):
            ref = ranks[r].layers[i]
            assert torch.equal(attn.qkv_shards[j].weight, ref.self_attn.qkv_proj.weight)
            assert torch.equal(attn.qkv_shards[j].bias, ref.self_attn.qkv_proj.bias)
            assert torch.equal(attn.o_shards[j].weight, ref.self_attn.o_proj.weight)
            assert torch.equal(mlp.gate_up_shards[j].weight, ref.mlp.gate_up_proj.weight)
            assert torch.equal(mlp.gate_up_shards[j].bias, ref.mlp.gate_up_proj.bias)
            assert torch.equal(mlp.down_shards[j].weight, ref.mlp.down_proj.weight)
            assert torch.equal(attn.o_bias, ref.self_attn.o_proj.bias)
            assert torch.equal(mlp.down_bias, ref.mlp.down_proj.bias)
            assert attn.o_shards[j].bias is None and mlp.down_shards[j].bias is None
        _assert_own_contiguous([m.weight for m in (*attn.qkv_shards, *attn.o_shards, *mlp.gate_up_shards,
                                                   *mlp.down_shards)])
    heads = [ranks[r].lm_head if not tie else ranks[r].embed_tokens.weight for r in (2, 3)]
    assert [tuple(w.shape) for w in inv.lm_head_shards] == [(97, 64), (97, 64)]  # ceil(385 / 4)
    assert all(torch.equal(a, b) for a, b in zip(inv.lm_head_shards, heads))
    assert inv.lm_head_shards[1][385 - 3 * 97:].abs().sum() == 0  # rank 3's padding rows
    _assert_own_contiguous(list(inv.lm_head_shards))
    if tie:  # the embedding reads the LM head shards: no second copy of the vocabulary matrix
        assert not any("embed" in n for n, _ in inv.named_parameters())
        assert all(a is b for a, b in zip(inv.embed_tokens.shards, inv.lm_head_shards))
    else:  # the embedding stays TP 2's vocabulary split (exact in any layout)
        assert tuple(inv.embed_tokens.weight.shape) == (193, 64)


def test_shard_sum_is_left_to_right_in_float32_rounded_once():
    from kvpilot.model.llama import ParallelContext
    from kvpilot.model.tp_invariant import shard_sum

    g = torch.Generator().manual_seed(0)
    parts = [(torch.randn(64, 32, generator=g) * 10 ** (i % 3)).bfloat16() for i in range(4)]
    pc = ParallelContext()
    two = shard_sum(pc, parts[:2], 2)
    assert torch.equal(two, (parts[0].float() + parts[1].float()).bfloat16())  # = the two-rank all-reduce
    four = shard_sum(pc, parts, 4)
    want = ((parts[0].float() + parts[1].float()) + parts[2].float()) + parts[3].float()
    assert four.dtype == torch.bfloat16 and torch.equal(four, want.bfloat16())
    assert not torch.equal(four, ((parts[0] + parts[1]) + parts[2]) + parts[3])  # bf16 partial sums differ
    assert shard_sum(pc, parts[:1], 1) is parts[0]


# ---- layouts agree bit for bit ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tp2_results(gqa_model):
    from kvpilot.server.launcher import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    return spawn_ranks(invariant_rank, lambda rank: (init, str(gqa_model), 2))


def _same(a, b) -> bool:
    return len(a[0]) == len(b[0]) and all(torch.equal(x, y) for x, y in zip(a[0], b[0])) and a[1] == b[1]


def test_tp1_invariant2_is_tp2_bit_for_bit(tp2_results):
    """Prefill and decode logits of every step (bf16): TP 1 with T = 2 == TP 2 default == TP 2 with
    T = 2, for the fused and the unfused decoder paths; TP 1 without the mode differs."""
    r0, r1 = tp2_results[0], tp2_results[1]
    single, tp = r0["single"], r0["tp"]
    assert len(tp[(None, "1")][0]) == DECODE_STEPS + 1
    assert all(_same(tp[c], r1["tp"][c]) for c in tp)  # both ranks gather the same logits
    assert tp[("2", "1")][2:] == ("LlamaDecoderLayer", 0) and single[("2", "1")][2:] == ("InvariantDecoderLayer", 2)
    assert _same(single[("2", "1")], tp[(None, "1")])
    assert _same(single[("2", "1")], tp[("2", "1")])
    assert _same(single[("2", "0")], tp[("2", "0")])  # unfused decoder layers
    assert _same(single[("2", "0")], single[("2", "1")])  # on CPU the fused dispatchers are the unfused ops
    # Without the mode one process rounds otherwise (the bf16 all-reduce of rounded partials).
    assert not any(torch.equal(x, y) for x, y in zip(single[(None, "1")][0], tp[(None, "1")][0]))


def test_tp2_with_two_shards_per_rank_is_tp1(tp2_results):
    r0 = tp2_results[0]
    single, tp = r0["single"], r0["tp"]
    assert tp[("4", "1")][2:] == ("InvariantDecoderLayer", 2) and single[("4", "1")][2:] == ("InvariantDecoderLayer", 4)
    assert _same(single[("4", "1")], tp[("4", "1")])
    assert _same(single[("4", "0")], tp[("4", "0")])
    assert not any(torch.equal(x, y) for x, y in zip(single[("4", "1")][0], single[("2", "1")][0]))  # T matters


@pytest.mark.slow  # four rank processes: ~10-20 s on the 2-core test machine
def test_tp4_with_one_shard_per_rank_is_tp1(gqa_model):
    """More than two ranks of one shard each: the all-gather sum instead of the all-reduce."""
    from kvpilot.server.launcher import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    res = spawn_ranks(invariant_rank, lambda rank: (init, str(gqa_model), 4), world=4)
    single, tp = res[0]["single"], res[0]["tp"]
    assert tp[("4", "1")][2:] == ("InvariantDecoderLayer", 1)
    for case in (("4", "1"), ("4", "0")):
        assert _same(single[case], tp[case])
        assert _same(tp[case], res[3]["tp"][case])


# ---- through LLM -------------------------------------------------------------------------------------

PROMPTS = [[1, 17, 99, 250, 3, 4, 5], [1, 5], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 42]]


def _llm_run(monkeypatch, model_dir, tp: int, value, tokenizer: bool = False):
    """Greedy tokens, their top-2 logprobs and the prompts' top-2 logprobs of `PROMPTS` (24 tokens)."""
    from kvpilot import LLM, SamplingParams

    _set_invariant(monkeypatch, value)
    with LLM(str(model_dir), tensor_parallel_size=tp, device="cpu", dtype="bfloat16", max_seq_len=128,
             skip_tokenizer_init=not tokenizer) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2,
                                                    prompt_logprobs=2), use_tqdm=False)
    _set_invariant(monkeypatch, None)

    def lps(steps):
        return [None if d is None else {t: lp.logprob for t, lp in d.items()} for d in steps]

    return [(o.outputs[0].token_ids, lps(o.outputs[0].logprobs), lps(o.prompt_logprobs)) for o in outs]


def test_llm_tp1_invariant2_equals_tp2(monkeypatch, gqa_model):
    want = _llm_run(monkeypatch, gqa_model, 1, "2")
    assert _llm_run(monkeypatch, gqa_model, 2, None) == want  # TP 2, default settings
    assert _llm_run(monkeypatch, gqa_model, 2, "2") == want  # the same model
    default = _llm_run(monkeypatch, gqa_model, 1, None)
    assert default != want and [d[2] for d in default] != [w[2] for w in want]  # prompt logprobs differ too


@pytest.mark.parametrize("value,tp2_value", [("2", None), ("4", "4")], ids=["T2-vs-tp2-default", "T4"])
def test_llm_stories_tp1_invariant_equals_tp2(monkeypatch, stories_model_dir, value, tp2_value):
    # stories260K: 8 heads / 4 KV heads, intermediate 172, tied embeddings (the embedding reads the LM head shards).
    want = _llm_run(monkeypatch, stories_model_dir, 1, value, tokenizer=True)
    assert _llm_run(monkeypatch, stories_model_dir, 2, tp2_value, tokenizer=True) == want
    assert len(want[0][0]) == 24 and all(len(w[1]) == 24 for w in want)


# ---- attention's launch hint (Triton interpreter) ---------------------------------------------------


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1 (CPU)")
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_launch_kv_heads_computes_each_shard_as_alone(monkeypatch, kind):
    """One call over two shards' heads with ``launch_kv_heads`` = one shard's count returns, bit for
    bit, the per-shard calls' heads; the split heuristics see one shard's count (with all heads the
    decode batch and the prefill step would take fewer context splits)."""
    from support.paged_attention import make_paged_batch

    from kvpilot.kernels import attention as A

    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401

    seen = {"decode": [], "prefill": []}
    num_splits, prefill_num_splits = attention_common._num_splits, prefill_attention.prefill_num_splits
    monkeypatch.setattr(attention_common, "_num_splits", lambda n, kv, *a: seen["decode"].append(kv) or num_splits(n, kv, *a))
    monkeypatch.setattr(prefill_attention, "prefill_num_splits",
                        lambda n, bq, kv, sms: seen["prefill"].append(kv) or prefill_num_splits(n, bq, kv, sms))
    if kind == "decode":  # one sequence, 300 keys: 4 KV heads -> 4 splits on the interpreter's 4 "SMs", 2 -> 5
        q_lens, ctx, heads, kv = [1], [299], 4, 4
    else:  # 8 new tokens on a 40-token prefix: 2 KV heads -> 1 split, 1 -> 16
        q_lens, ctx, heads, kv = [8], [40], 4, 2
    q, kc, vc, bt, sl, qsl, _, _ = make_paged_batch(q_lens, ctx, heads, kv, 16, 8, dtype=torch.float32, seed=1)
    args = (bt, sl, qsl, 16 ** -0.5, max(q_lens), int(sl.max()))
    shard_kv, shard_h = kv // 2, heads // 2
    got = A.paged_attention_triton(q, kc, vc, *args, launch_kv_heads=shard_kv)
    assert seen[kind] == [shard_kv]
    want = torch.cat([
        A.paged_attention_triton(q[:, j * shard_h:(j + 1) * shard_h].contiguous(),
                                 kc[:, :, j * shard_kv:(j + 1) * shard_kv].contiguous(),
                                 vc[:, :, j * shard_kv:(j + 1) * shard_kv].contiguous(), *args)
        for j in range(2)], dim=1)
    assert torch.equal(got, want)
    seen[kind].clear()
    plain = A.paged_attention_triton(q, kc, vc, *args)
    assert seen[kind] == [kv]
    if kind == "decode":
        assert num_splits(1, kv, int(sl.max()), q.device) != num_splits(1, shard_kv, int(sl.max()), q.device)
        assert not torch.equal(plain, want)  # measured: 4 instead of 5 splits move fp32 outputs by ~4e-8
    else:  # (the interpreter's prefill outputs happen to agree with 1 and 16 splits here)
        bq = prefill_attention.prefill_block_q(heads // kv)[0]
        assert prefill_num_splits(8, bq, kv, 4) != prefill_num_splits(8, bq, shard_kv, 4)
    with pytest.raises(ValueError, match="launch_kv_heads must be a positive divisor"):
        A.paged_attention_triton(q, kc, vc, *args, launch_kv_heads=3)
