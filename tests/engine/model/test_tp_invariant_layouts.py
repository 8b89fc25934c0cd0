"""Tensor-parallel-invariant mode (``Tuning.tp_invariant``, engine/model/tp_invariant.py) across layouts.

- A tied model whose stage holds both ends keeps the vocabulary matrix once: the embedding reads its
  rows from the LM head shards (`tp_invariant.InvariantTiedEmbedding`); the parameters are the default
  model's plus padding rows, and the lookup is bit for bit the default embedding's, on one rank and
  summed over two.
- `tp_invariant.check_tp_invariant` is the check a front end runs before workers start; a bad ``T``
  with parallel workers fails fast with the worker's message.
- A vocabulary smaller than ``(T - 1) * ceil(V / T)`` (a last shard with no row at all) loads.
- Without micro-batches PP 2 with ``T = 2`` is TP 1 with ``T = 2`` bit for bit, several requests at
  once, prefix hits included (with micro-batches a PP 2 step runs other batches than one GPU's, whose
  bf16 rows may differ).
- Ranks that disagree on the invariant size refuse to start."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from support.tp_invariant import set_tuning, tuning_now, make_gqa_llama
from kvpilot.config import KvCacheConfig
from kvpilot.model.config import ModelConfig
from kvpilot.runner.model_runner import ModelRunner

pytestmark = pytest.mark.timeout(300)


def _set_invariant(monkeypatch, value) -> None:
    """``KVPILOT_TUNING``'s ``tp_invariant`` set to ``value`` (None: removed), other fields kept."""
    set_tuning(monkeypatch, tp_invariant=None if value is None else int(value))


def _runner(model_dir: Path, value, dtype: str = "bfloat16", tp_rank: int = 0, tp_size: int = 1,
            monkeypatch=None) -> ModelRunner:
    """A CPU runner built with ``Tuning(tp_invariant=value)`` (None: 0); building and loading a
    tensor-parallel rank needs no process group."""
    from kvpilot.model.llama import ParallelContext

    _set_invariant(monkeypatch, value)
    pc = None if tp_size == 1 else ParallelContext(tp_rank, tp_size, None)
    runner = ModelRunner(model_dir, ModelConfig.from_dir(model_dir), KvCacheConfig(tokens_per_block=8, max_tokens=256),
                         max_num_tokens=64, max_batch_size=4, max_seq_len=64, device="cpu", dtype=dtype, pc=pc,
                         tuning=tuning_now())
    _set_invariant(monkeypatch, None)
    return runner


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> Path:
    # Tied embeddings, vocab 383 (not a multiple of 2 or 4: padded LM head shards), no biases.
    return make_gqa_llama(tmp_path_factory.mktemp("tp_invariant") / "tied", vocab=383, bias=False, tie=True)


# ---- the tied vocabulary matrix is held once ---------------------------------------------------------


@pytest.mark.parametrize("value", ["2", "4"])
def test_tied_embedding_reads_the_lm_head_shards(monkeypatch, tied_model, value):
    from kvpilot.model.tp_invariant import InvariantTiedEmbedding

    base = _runner(tied_model, None, monkeypatch=monkeypatch).model
    inv = _runner(tied_model, value, monkeypatch=monkeypatch).model
    T, V, H = int(value), base.cfg.vocab_size, base.cfg.hidden_size
    assert isinstance(inv.embed_tokens, InvariantTiedEmbedding) and len(inv.lm_head_shards) == T
    names = [n for n, _ in inv.named_parameters()]
    assert not any("embed" in n for n in names) and sum("lm_head_shards" in n for n in names) == T
    # The default model's parameters plus the LM head shards' zero padding rows, nothing else.
    padding = T * -(-V // T) - V
    assert sum(p.numel() for p in inv.parameters()) == sum(p.numel() for p in base.parameters()) + padding * H
    ids = torch.cat([torch.arange(V), torch.tensor([0, V - 1, -(-V // T), -(-V // T) - 1, 5, 5])])
    with torch.inference_mode():
        assert torch.equal(inv.embed_tokens(ids), base.embed_tokens(ids))  # bf16, bit for bit


def test_tied_embedding_over_two_ranks_sums_to_the_rows(monkeypatch, tied_model):
    """TP 2 with T = 4 (two shards per rank): each rank's lookup holds its shards' rows and zeros
    elsewhere, as `VocabParallelEmbedding`'s does; their sum (the all-reduce) is every row exactly."""
    from kvpilot.model.llama import ParallelContext

    base = _runner(tied_model, None, monkeypatch=monkeypatch).model
    ranks = [_runner(tied_model, "4", tp_rank=r, tp_size=2, monkeypatch=monkeypatch).model for r in (0, 1)]
    monkeypatch.setattr(ParallelContext, "all_reduce", lambda self, x, site=None: x)  # each rank's part
    V = base.cfg.vocab_size
    ids = torch.arange(V)
    with torch.inference_mode():
        parts = [m.embed_tokens(ids) for m in ranks]
        want = base.embed_tokens(ids)
    held = [(p != 0).any(-1) for p in parts]
    assert torch.equal(held[0] ^ held[1], want.ne(0).any(-1))  # every (non-zero) row on exactly one rank
    assert held[0][:192].all() and not held[0][192:].any()  # rank 0: shards 0 and 1 (96 rows each)
    assert torch.equal(parts[0] + parts[1], want)
    assert ranks[0].embed_tokens.ar_site == 0  # the embedding's all-reduce site, before the layers'


# ---- bad values fail before (or as soon as) workers start --------------------------------------------


@pytest.mark.parametrize("value,tp,want", [(None, 2, 0), ("0", 4, 0), ("4", 2, 4), ("4", 4, 4), ("2", 1, 2)])
def test_check_tp_invariant_accepts(monkeypatch, tied_model, value, tp, want):
    from kvpilot.model.tp_invariant import check_tp_invariant

    assert check_tp_invariant(ModelConfig.from_dir(tied_model), tp, int(value or 0)) == want


@pytest.mark.parametrize("value,tp,match", [
    ('"x"', 2, "tp_invariant must be int"),
    ("-4", 2, "tp_invariant must be >= 0"),
    ("3", 2, "must be a multiple of tensor_parallel_size 2"),
    ("1", 2, "must be a multiple of tensor_parallel_size 2"),
    ("8", 2, "must divide num_key_value_heads 4"),
    ("6", 2, "must divide num_attention_heads 8"),
])
def test_check_tp_invariant_rejects(monkeypatch, tied_model, value, tp, match):
    from kvpilot.model.tp_invariant import check_tp_invariant

    monkeypatch.setenv("KVPILOT_TUNING", '{"tp_invariant": %s}' % value)
    with pytest.raises(ValueError, match=match):  # the hook's parse, or the check a front end runs
        check_tp_invariant(ModelConfig.from_dir(tied_model), tp, tuning_now().tp_invariant)


def test_bad_invariant_size_at_tp2_fails_fast_with_its_message(monkeypatch, tied_model):
    """`validate_layout` calls `check_tp_invariant`: a ValueError before any worker starts."""
    from kvpilot import LLM

    _set_invariant(monkeypatch, "3")
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="tp_invariant=3 must be a multiple of "
                                         "tensor_parallel_size 2"):
        LLM(str(tied_model), tensor_parallel_size=2, device="cpu", skip_tokenizer_init=True, max_seq_len=64)
    assert time.monotonic() - t0 < 30


# ---- tiny vocabularies --------------------------------------------------------------------------------


def test_vocab_with_an_empty_last_shard_loads(monkeypatch, tmp_path):
    """Vocab 5 with T = 4: shards of 2 rows, the last one past the vocabulary (all padding). It loads,
    its rows are zero, and the float32 logits are the default model's up to summation order; the
    default TP 4's last rank (an embedding with no row) loads too."""
    path = make_gqa_llama(tmp_path / "v5", vocab=5)
    inv = _runner(path, "4", "float32", monkeypatch=monkeypatch)
    assert [tuple(w.shape) for w in inv.model.lm_head_shards] == [(2, 64)] * 4
    assert inv.model.lm_head_shards[3].abs().sum() == 0 and inv.model.lm_head_shards[2][1:].abs().sum() == 0
    base = _runner(path, None, "float32", monkeypatch=monkeypatch)
    last = _runner(path, None, "float32", tp_rank=3, tp_size=4, monkeypatch=monkeypatch).model
    assert last.embed_tokens.weight.abs().sum() == 0 and last.lm_head.abs().sum() == 0
    from kvpilot.runner.model_runner import ScheduledSeq

    with torch.inference_mode():
        got = [r.execute([ScheduledSeq(0, [1, 3, 4, 0, 2], 0, [0], True, all_logits=True)])[0] for r in (inv, base)]
    assert got[0].shape == (5, 5)
    torch.testing.assert_close(got[0], got[1], rtol=0, atol=1e-5)


# ---- pipeline stages without micro-batches --------------------------------------------------------------


def _llm_run(monkeypatch, model_dir: Path, tp: int, pp: int, value, micro: bool = True):
    """Greedy tokens, top-2 logprobs and generation logits of two rounds: one request, then two
    that share its 40-token prefix (prefix-cache hits) and decode side by side at other lengths."""
    from kvpilot import LLM, SamplingParams

    g = torch.Generator().manual_seed(3)
    shared = [1] + torch.randint(3, 385, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(3, 385, (n,), generator=g).tolist() for n in (3, 11, 7)]
    _set_invariant(monkeypatch, value)
    set_tuning(monkeypatch, pp_microbatch=micro)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2, return_generation_logits=True)
    with LLM(str(model_dir), tensor_parallel_size=tp, pipeline_parallel_size=pp, device="cpu", dtype="bfloat16",
             max_seq_len=128, max_num_tokens=64, max_batch_size=8, skip_tokenizer_init=True,
             kv_cache_config=KvCacheConfig(tokens_per_block=8)) as llm:
        rounds = [llm.generate(prompts[:1], params, use_tqdm=False), llm.generate(prompts[1:], params, use_tqdm=False)]
    set_tuning(monkeypatch, tp_invariant=None, pp_microbatch=None)
    return [[(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs],
              o.outputs[0].generation_logits.float()) for o in outs] for outs in rounds]


def _same(a, b) -> bool:
    return all(x[0] == y[0] and x[1] == y[1] and torch.equal(x[2], y[2])
               for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory) -> Path:
    # Four layers (two per pipeline stage), random biases, vocab 385.
    return make_gqa_llama(tmp_path_factory.mktemp("tp_invariant") / "deep", layers=4)


def test_pp2_without_microbatches_is_tp1_bit_for_bit(monkeypatch, deep_model):
    want = _llm_run(monkeypatch, deep_model, 1, 1, "2")
    assert len(want[1]) == 2 and all(len(x[0]) == 20 for r in want for x in r)
    assert _same(_llm_run(monkeypatch, deep_model, 1, 2, "2", micro=False), want)
    # The mode matters (bf16 rounding of TP 2's decomposition), so the comparison has teeth.
    assert not _same(_llm_run(monkeypatch, deep_model, 1, 1, None), want)


# ---- every rank must build with the same T --------------------------------------------------------------


def _invariant_agreement_rank(rank: int, port: int, sizes: list, out) -> None:
    import types

    import torch.distributed as dist

    from kvpilot.parallel.worker import check_same_invariant_size

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = types.SimpleNamespace(tp_invariant=sizes[rank])
        worker = types.SimpleNamespace(device=torch.device("cpu"), runner=types.SimpleNamespace(model=model))
        try:
            check_same_invariant_size(worker)
            out.put((rank, "ok"))
        except ValueError as e:
            out.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("sizes", [[2, 2], [0, 2]])
def test_ranks_that_disagree_on_the_invariant_size_refuse_to_start(sizes):
    """Pods of a LeaderWorkerSet group read KVPILOT_TUNING from their own environment: ranks
    built with different values would pair an all-gather with an all-reduce, so every rank raises."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_invariant_agreement_rank, args=(r, port, sizes, out)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    if sizes[0] == sizes[1]:
        assert got == {0: "ok", 1: "ok"}
    else:
        assert all("ranks disagree on Tuning.tp_invariant: values from 0 to 2" in got[r] for r in (0, 1))
        assert "this rank: 0" in got[0] and "this rank: 2" in got[1]
