"""The fast draws (Triton kernels, PyTorch candidate path) choose exactly the tokens of the exact
reference (`_draw_exact`: stable full sort) on many random rows: flat, peaked and tied (bfloat16)
logits, top_p near 0 and 1, top-k + top-p + min-p combinations, greedy and plain rows mixed in.

The Triton kernels run on CPU under TRITON_INTERPRET=1 with a small vocabulary, and with shrunken
chunk/window sizes so that the multi-chunk reductions, the stage-2 refinement and the hand-off to
the exact path all happen; the GPU tests use serving shapes. Rows with top-p/min-p but no top-k
take the pivot path by default (tests/engine/sampling/test_sampling_pivot.py) and the window path with
``pivot_rounds`` 0 (cases below).
"""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.sampling.sampler import Sampler, SamplingRow, top_k_top_p_min_p
from support.sampling import _kernel_draw

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

TEMPS = [0.0, 0.5, 1.0, 1.7]
TOP_K = [0, 0, 1, 5, 50, 700, 1999, 2500]
TOP_P = [1.0, 1.0, 0.0, 0.01, 0.3, 0.9, 0.99, 0.9999]
MIN_P = [0.0, 0.0, 0.0, 0.01, 0.2, 1.0]


def _batch(seed: int, S: int, V: int, step: int = 0):
    """Random logits (per-row scale from nearly uniform to very peaked; every third row rounded to
    bfloat16, which makes ties) and random per-row settings."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.02, 0.3, 1.0, 3.0, 6.0, 12.0])[torch.randint(0, 6, (S,), generator=g)]
    logits = torch.randn(S, V, generator=g) * scale[:, None]
    logits[::3] = logits[::3].bfloat16().float()

    def pick(options):
        return options[int(torch.randint(0, len(options), (1,), generator=g))]

    rows = [SamplingRow(temperature=pick(TEMPS), top_k=pick(TOP_K), top_p=pick(TOP_P), min_p=pick(MIN_P),
                        seed=int(torch.randint(0, 2 ** 62, (1,), generator=g)) - 2 ** 61, step=step)
            for _ in range(S)]
    return logits, rows


# A kernel storing `_topk_in_window`'s mask (helpers are callable only from kernels; the interpreter
# resolves the defining module's globals, not closures, hence module level).
try:
    import triton
    import triton.language as tl

    from kvpilot.kernels.sampling import _topk_in_window

    @triton.jit
    def _TOPK_MASK_KERNEL(z_ptr, id_ptr, n, kk, out_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        valid = offs < n
        z = tl.load(z_ptr + offs, mask=valid, other=float("-inf"))
        ids = tl.load(id_ptr + offs, mask=valid, other=2147483647)
        tl.store(out_ptr + offs, _topk_in_window(z, ids, valid, kk).to(tl.int32))
except ImportError:  # pragma: no cover - no Triton: the interpreter tests are skipped anyway
    _TOPK_MASK_KERNEL = None


# ---- semantics of the reference ------------------------------------------------------------------
def test_ties_are_cut_by_token_id():
    """Top-k and top-p cut inside a group of equal values keep the lowest token ids."""
    x = torch.tensor([[0.0, 1.0, 2.0, 1.0, 1.0, 1.0]])
    one = torch.ones(1)
    kept = ~torch.isinf(top_k_top_p_min_p(x, torch.tensor([3]), one, torch.zeros(1)))
    assert kept.tolist() == [[False, True, True, True, False, False]]
    # masses e^2, e^1 x 4, e^0: top-p keeps token 2, then the tied 1s in id order until the mass
    # strictly above a token reaches top_p of the whole row
    probs = torch.softmax(x[0].double(), -1)
    p = float(probs[2] + 2 * probs[1]) + 1e-4  # just above the mass of token 2 and two of the 1s
    kept = ~torch.isinf(top_k_top_p_min_p(x, torch.zeros(1, dtype=torch.int64), torch.tensor([p]), torch.zeros(1)))
    assert kept.tolist() == [[False, True, True, True, True, False]]


def test_greedy_and_plain_rows_equal_direct_formula():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 300, generator=g)
    logits[0, 7] = logits[0, 9] = logits[0].max() + 1  # a tie at the max: the lower id wins
    rows = [SamplingRow(temperature=t, seed=s, step=4) for t, s in
            [(0.0, 1), (0.7, 2), (1.0, 3), (0.0, 4), (2.0, 5), (1.3, 6)]]
    got = Sampler("torch").choose(logits, rows)
    assert got[0] == 7 and got[3] == int(logits[3].argmax())
    from kvpilot.sampling.sampler import gumbel_noise

    for i in (1, 2, 4, 5):
        z = logits[i:i + 1] / torch.tensor([[rows[i].temperature]])
        noise = gumbel_noise(torch.tensor([rows[i].seed]), torch.tensor([4]), 300)
        assert got[i] == int((z + noise).argmax())


# ---- PyTorch candidate path ----------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(4))
def test_torch_candidates_equal_exact(seed):
    logits, rows = _batch(seed, 48, 2000, step=seed)
    fast = Sampler("torch")
    assert fast.choose(logits, rows) == Sampler("exact").choose(logits, rows)


def test_torch_candidates_settle_peaked_rows_without_the_exact_path():
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(32, 5000, generator=g) * 4
    rows = [SamplingRow(temperature=0.8, top_p=[0.9, 0.5, 0.99][i % 3], top_k=[0, 40, 0, 0][i % 4],
                        min_p=[0.0, 0.05][i % 2], seed=i) for i in range(32)]
    fast = Sampler("torch")
    assert fast.choose(logits, rows) == Sampler("exact").choose(logits, rows)
    assert fast.exact_rows == 0


# ---- Triton kernels (interpreter) ----------------------------------------------------------------
interpret_only = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels in the interpreter")


@interpret_only
@pytest.mark.parametrize("seed,config", [
    (0, {}),                                  # one chunk, windows never over capacity
    (1, {"chunk": 1024, "block": 256}),       # several chunks per row (partial reductions)
    (2, {"chunk": 1024, "block": 256, "wcap": 128}),  # crowded windows: stage 2, hand-offs
    (3, {"chunk": 512, "block": 256, "collect_block": 128, "stats_block": 64}),  # many blocks per chunk
    (4, {"chunk": 512, "block": 256, "pivot_rounds": 0}),  # every filtered row through the window path
])
def test_triton_kernels_equal_exact(seed, config):
    logits, rows = _batch(seed, 12, 1500, step=seed)
    want = Sampler("exact").choose(logits, rows)
    got = _kernel_draw(logits, rows, **config)
    settled = [i for i, t in enumerate(got) if t >= 0]
    assert [got[i] for i in settled] == [want[i] for i in settled]
    if "wcap" not in config:
        assert len(settled) == len(rows)  # nothing handed to the exact path
    else:
        assert len(settled) >= len(rows) // 2


@interpret_only
def test_triton_filter_kinds_settle_every_row_exactly():
    """Each filter kind takes its own branches: in the window path (second config, pivot path
    off) top-p alone sums the whole row's mass, the others only blocks above the window (most
    blocks hold none at collect_block 64); top-k cut inside a group of tied values searches token
    ids, without ties it skips that search; min-p alone skips the stage-1 masses. With the
    pivot path on (first config), rows without top-k take it. Every row must settle (no hand-off) on
    the reference's token."""
    g = torch.Generator().manual_seed(13)
    V = 1500
    logits = torch.randn(16, V, generator=g) * 3
    logits[8:12] = (logits[8:12] * 2).round() / 2  # coarse grid: many ties at the k-th value
    settings = [(1.0, 50, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (1.3, 0, 0.5, 0.0),
                (0.8, 100, 0.9, 0.05), (1.0, 0, 1.0, 0.1), (0.6, 0, 1.0, 0.3), (1.0, 20, 0.95, 0.0),
                (1.0, 7, 1.0, 0.0), (1.0, 30, 1.0, 0.0), (0.9, 3, 0.99, 0.0), (1.0, 0, 0.8, 0.0),
                (1.0, 1, 1.0, 0.0), (2.0, 0, 0.3, 0.0), (0.5, 200, 1.0, 0.0), (1.0, 0, 0.999, 0.02)]
    rows = [SamplingRow(temperature=t, top_k=k, top_p=p, min_p=mp, seed=100 + i, step=3)
            for i, (t, k, p, mp) in enumerate(settings)]
    assert any(int((logits[i] >= logits[i].topk(k).values[-1]).sum()) > k
               for i, (_, k, _, _) in enumerate(settings) if 8 <= i < 12 and k)  # a cut inside ties
    want = Sampler("exact").choose(logits, rows)
    for config in ({"pivot_rounds": 4}, {"chunk": 256, "block": 256, "collect_block": 64, "stats_block": 64}):
        assert _kernel_draw(logits, rows, **config) == want


@interpret_only
@pytest.mark.parametrize("grid", [0.0, 0.5])
def test_topk_in_window_equals_a_stable_sort(grid):
    """The window's top-k mask (kk best by value desc, id asc) equals a stable sort's, with ties
    (values on a 0.5 grid: the cut falls inside a group of equal values) and without."""
    g = torch.Generator().manual_seed(21)
    n = 200
    z = torch.randn(n, generator=g) * 2
    if grid:
        z = (z / grid).round() * grid
    ids = torch.randperm(5000, generator=g)[:n].to(torch.int32)  # window order is arbitrary
    for kk in (1, 3, 17, 64, 199):
        out = torch.zeros(256, dtype=torch.int32)
        _TOPK_MASK_KERNEL[(1,)](z, ids, n, kk, out, N=256)
        order = sorted(range(n), key=lambda j: (-float(z[j]), int(ids[j])))
        want = torch.zeros(256, dtype=torch.int32)
        want[order[:kk]] = 1
        assert out.tolist() == want.tolist()


@interpret_only
def test_triton_stage2_refines_flat_rows():
    """Nearly uniform rows put hundreds of tokens in each stage-1 bracket; with a 64-token window
    only stage 2 can settle them, which it must do exactly (window path for every row)."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 1024, generator=g) * 0.3
    rows = [SamplingRow(temperature=1.0, top_p=p, top_k=k, seed=i, step=2)
            for i, (p, k) in enumerate([(0.9, 0), (0.5, 0), (0.99, 0), (0.95, 0), (1.0, 200), (0.7, 0)])]
    got = _kernel_draw(logits, rows, chunk=256, block=256, stats_block=64, wcap=64, pivot_rounds=0)
    assert got == Sampler("exact").choose(logits, rows)


@interpret_only
def test_triton_sampler_hands_unsettled_rows_to_exact_path():
    logits, rows = _batch(4, 12, 1500, step=1)
    from kvpilot.kernels import sampling as ks

    saved = dict(ks.CONFIG)
    ks.CONFIG.update(chunk=512, block=256, wcap=16)
    try:
        sampler = Sampler("triton")
        got = sampler.choose(logits, rows)
    finally:
        ks.CONFIG.update(saved)
    assert got == Sampler("exact").choose(logits, rows)
    assert sampler.exact_rows > 0


@interpret_only
def test_triton_logprobs_equal_torch_logprobs():
    """The Triton log-probabilities (per-chunk max/sum/count/top-n) equal log_softmax's."""
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(6, 3000, generator=g) * 3
    rows = [SamplingRow(temperature=[0.0, 1.0][i % 2], top_p=0.9, logprobs=n, seed=i)
            for i, n in enumerate([0, 3, 5, None, 20, 1])]
    got = Sampler("triton")(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    for i, tok in enumerate(got.token_ids):
        if rows[i].logprobs is None:
            assert got.logprobs[i] is None and got.top_logprobs[i] is None
            continue
        ids, vals, rank = got.top_logprobs[i]
        n = rows[i].logprobs
        assert ids == raw[i].topk(n).indices.tolist()
        torch.testing.assert_close(torch.tensor(vals), raw[i].topk(n).values)
        assert rank == int((raw[i] > raw[i, tok]).sum()) + 1
        assert got.logprobs[i] == pytest.approx(float(raw[i, tok]), abs=1e-5)


# ---- GPU ---------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_gpu_fast_path_equals_exact_at_serving_shape(scale):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(256, 128256, device="cuda", generator=g) * scale
    settings = [(0.8, 0, 0.9, 0.0), (0.8, 50, 1.0, 0.0), (0.8, 100, 0.9, 0.05), (1.0, 0, 0.95, 0.0),
                (0.7, 0, 0.01, 0.0), (1.0, 0, 0.999, 0.0), (0.0, 0, 1.0, 0.0), (0.9, 0, 1.0, 0.0),
                (1.2, 0, 1.0, 0.1), (1.0, 40, 0.95, 0.0), (0.6, 5000, 0.8, 0.0), (1.0, 1, 1.0, 0.0)]
    for step in range(3):
        rows = [SamplingRow(temperature=t, top_k=k, top_p=p, min_p=m, seed=i, step=step)
                for i, (t, k, p, m) in ((i, settings[i % len(settings)]) for i in range(256))]
        fast = Sampler("triton")
        got = fast.choose(logits, rows)
        assert got == Sampler("exact").choose(logits, rows)
        assert got == Sampler("torch").choose(logits, rows)
        assert fast.exact_rows == 0
    rows = [SamplingRow(temperature=0.8, top_p=0.9, logprobs=5, seed=i) for i in range(256)]
    got, want = Sampler("triton")(logits, rows), Sampler("torch")(logits, rows)
    assert got.token_ids == want.token_ids
    assert [t[0] for t in got.top_logprobs] == [t[0] for t in want.top_logprobs]
    assert [t[2] for t in got.top_logprobs] == [t[2] for t in want.top_logprobs]
    torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-4, rtol=0)


@gpu
@pytest.mark.gpu
def test_gpu_random_rows_equal_exact():
    for seed in range(3):
        logits, rows = _batch(seed, 64, 32000, step=seed)
        logits = logits.cuda()
        assert Sampler("triton").choose(logits, rows) == Sampler("exact").choose(logits, rows)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1.0, 1.3, 4.0])
def test_gpu_pivot_path_equals_exact_at_serving_shape(scale):
    """Rows with top-p and/or min-p but no top-k (the pivot path) at 256 x 128,256 on flat,
    Llama-like and peaked logits: every token the kernels settle equals the exact reference's with
    the pivot path on (4 generations, the default), the fused schedule, a cap of 2 generations,
    and off (window path); with 4 generations hardly any row is left to the exact path."""
    g = torch.Generator(device="cuda").manual_seed(1)
    logits = torch.randn(256, 128256, device="cuda", generator=g) * scale
    settings = [(0.8, 0.9, 0.0), (1.0, 0.95, 0.0), (0.7, 0.5, 0.0), (1.0, 0.1, 0.0), (0.6, 0.01, 0.0),
                (1.0, 0.999, 0.0), (1.2, 1.0, 0.1), (0.8, 0.9, 0.05), (1.0, 0.3, 0.02), (1.5, 0.8, 0.0),
                (0.8, 0.99, 0.0)]
    configs = {"pivot": {"pivot_rounds": 4}, "fused": {"pivot_rounds": 4, "pivot_fuse": 1},
               "cap 2": {"pivot_rounds": 2}, "window": {"pivot_rounds": 0}}
    handed = dict.fromkeys(configs, 0)
    for step in range(2):
        rows = [SamplingRow(temperature=t, top_p=p, min_p=m, seed=i, step=step)
                for i, (t, p, m) in ((i, settings[i % len(settings)]) for i in range(256))]
        want = Sampler("exact").choose(logits, rows)
        for name, config in configs.items():
            got = _kernel_draw(logits, rows, **config)
            assert [t for t in got if t >= 0] == [w for t, w in zip(got, want) if t >= 0], name
            handed[name] += sum(t < 0 for t in got)
    assert handed["pivot"] <= 3 and handed["fused"] <= 3, handed  # of 512 rows
