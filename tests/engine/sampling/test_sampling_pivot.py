"""The pivot path of the Triton sampler (rows with top-p and/or min-p but no top-k) chooses exactly
the token of the exact reference (`_draw_exact`: stable full sort, fixed-point masses, Gumbel-max
among the kept prefix) for the same noise.

The kernels run on CPU under TRITON_INTERPRET=1 with a small vocabulary, and with shrunken
chunks, blocks and generation caps so that multi-chunk reductions, later generations (C passes,
level choice, accepting a candidate without a mass pass) and the hand-off to the exact path all
happen. GPU tests at the serving shape are in tests/engine/sampling/test_sampling_fast.py.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvpilot.sampling.sampler import Sampler, SamplingRow, _Draw
from support.sampling import _kernel_draw as _draw

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs the Triton kernels in the interpreter")

MULTI_CHUNK = {"chunk": 256, "block": 256, "pivot_block": 128, "pivot_cblock": 64}


@pytest.fixture(autouse=True)
def _pivot_on(monkeypatch):
    """These tests hold the generation cap at 4 (the default, with which it was measured on the
    GPU), whatever the default becomes."""
    from kvpilot.kernels import sampling as ks

    monkeypatch.setitem(ks.CONFIG, "pivot_rounds", 4)


def _exact(logits, rows):
    return Sampler("exact").choose(logits, rows)


def _rows(settings, seed0=0, step=3):
    """SamplingRow per (temperature, top_p, min_p[, top_k])."""
    return [SamplingRow(temperature=s[0], top_p=s[1], min_p=s[2], top_k=s[3] if len(s) > 3 else 0,
                        seed=seed0 + i, step=step) for i, s in enumerate(settings)]


def _logits(seed, S, V, scales=(0.05, 0.5, 1.0, 2.0, 4.0, 8.0)):
    """Rows from nearly uniform to very peaked (std = scales[i % len(scales)])."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(S, V, generator=g) * torch.tensor(scales).repeat(S)[:S, None]


# Every top_p the brief names, alone and with min-p, at several temperatures.
SETTINGS = [(t, p, mp) for mp in (0.0, 0.05) for p in (0.01, 0.5, 0.9, 0.999, 1.0) for t in (1.0, 0.7, 1.6)
            if not (p == 1.0 and mp == 0.0)]


@pytest.mark.parametrize("config", [{}, MULTI_CHUNK, {"pivot_fuse": 1}], ids=["default", "multi-chunk", "fused"])
def test_pivot_rows_equal_exact(config):
    """Flat to peaked rows, top_p 0.01 ... 1.0, with and without min-p, T != 1: every row settles
    on the reference's token (none handed to the exact path)."""
    rows = _rows(SETTINGS if config is not MULTI_CHUNK else SETTINGS[::2], seed0=17)
    logits = _logits(1, len(rows), 1000 if config is not MULTI_CHUNK else 700)
    got = _draw(logits, rows, **config)
    assert got == _exact(logits, rows)


def test_pivot_tied_values():
    """Logits on a coarse grid (few distinct values, each shared by hundreds of tokens): the kept
    prefix ends inside a group of equal values, so membership depends on the token-id tie rule
    (a token is ordered after equal values with lower ids), in pass 1's lane filter, the masses
    before a candidate and the level prefixes alike."""
    g = torch.Generator().manual_seed(4)
    V = 900
    logits = (torch.randn(16, V, generator=g) * torch.tensor([0.5, 1.5, 3.0, 6.0]).repeat(4)[:, None]).round()
    logits[:4] = torch.randint(0, 3, (4, V), generator=g).float()  # three values only
    for i in range(4, 16):  # ties at the max as well: three more tokens share it
        logits[i, torch.randperm(V, generator=g)[:3]] = logits[i].max()
    settings = [(1.0, p, mp) for mp in (0.0, 0.2) for p in (0.01, 0.3, 0.6, 0.9)] * 2
    rows = _rows(settings, seed0=40)
    want = _exact(logits, rows)
    assert _draw(logits, rows) == want
    assert _draw(logits[::3], rows[::3], **MULTI_CHUNK) == want[::3]


@pytest.mark.parametrize("seed", range(3))
def test_pivot_seeds_and_steps(seed):
    """Random seeds (any 64-bit value) and output positions: the noise of the kernels is the
    reference's, bit for bit, so the token is the same for every (seed, step)."""
    g = torch.Generator().manual_seed(100 + seed)
    S, V = 12, 700
    logits = torch.randn(S, V, generator=g) * (0.3 + 4 * torch.rand(S, 1, generator=g))
    logits[::2] = logits[::2].bfloat16().float()  # ties from bfloat16 rounding
    rows = [SamplingRow(temperature=float(0.5 + torch.rand(1, generator=g)), top_p=[0.05, 0.4, 0.8, 0.95][i % 4],
                        min_p=[0.0, 0.0, 0.1][i % 3], step=int(torch.randint(0, 2 ** 40, (1,), generator=g)),
                        seed=int(torch.randint(-2 ** 63, 2 ** 63 - 1, (1,), generator=g)))
            for i in range(S)]
    assert _draw(logits, rows) == _exact(logits, rows)


def test_pivot_generations_cap_hands_rows_to_exact_path():
    """Small top_p on flat rows needs several candidate generations. With a cap of one (and of
    two without levels) some rows come back -1; every settled row has the reference's token, and
    the sampler draws the -1 rows exactly. With the default cap every row settles."""
    rows = _rows([(1.0, p, 0.0) for p in (0.01, 0.02, 0.05, 0.1)] * 2, seed0=5)
    logits = _logits(8, len(rows), 1000, scales=(0.5, 1.0, 1.5))
    want = _exact(logits, rows)
    handed = {}
    for name, cap in (("one", {"pivot_rounds": 1}), ("two", {"pivot_rounds": 2, "pivot_levels": 1})):
        got = _draw(logits, rows, **cap)
        handed[name] = sum(t < 0 for t in got)
        assert handed[name] > 0, cap
        assert [t for t in got if t >= 0] == [w for t, w in zip(got, want) if t >= 0]
    assert _draw(logits, rows) == want

    from kvpilot.kernels import sampling as ks

    saved = dict(ks.CONFIG)
    ks.CONFIG.update(pivot_rounds=1)
    try:
        sampler = Sampler("triton")
        assert sampler.choose(logits, rows) == want
    finally:
        ks.CONFIG.clear()
        ks.CONFIG.update(saved)
    assert sampler.exact_rows == handed["one"]


def test_pivot_levels_settle_rows_in_fewer_generations():
    """The nested level prefixes narrow the candidate set much faster than the plain chain (one
    prefix per generation): with two generations, levels settle more rows, all exactly."""
    rows = _rows([(1.0, p, 0.0) for p in (0.01, 0.03, 0.1)] * 4, seed0=70)
    logits = _logits(9, len(rows), 1500, scales=(0.7, 1.0, 1.3))
    want = _exact(logits, rows)
    settled = {}
    for levels in (1, 8):
        got = _draw(logits, rows, pivot_rounds=2, pivot_levels=levels)
        assert [t for t in got if t >= 0] == [w for t, w in zip(got, want) if t >= 0]
        settled[levels] = sum(t >= 0 for t in got)
    assert settled[8] > settled[1]


def test_mixed_batch_through_the_sampler():
    """Greedy, plain, top-k, top-k + top-p, top-p, min-p and top-p + min-p rows in one call: each
    kind takes its own path (plain, window, pivot) and every token equals the reference's."""
    g = torch.Generator().manual_seed(12)
    V = 800
    kinds = [(0.0, 1.0, 0.0, 0), (0.9, 1.0, 0.0, 0), (0.8, 1.0, 0.0, 40), (1.0, 0.9, 0.0, 30), (0.8, 0.9, 0.0),
             (1.2, 1.0, 0.1), (0.7, 0.5, 0.05), (1.0, 0.95, 0.0), (0.6, 0.2, 0.0), (1.0, 1.0, 0.3)]
    rows = _rows(kinds * 2, seed0=300)
    logits = torch.randn(len(rows), V, generator=g) * 2.5
    d = _Draw(rows, V)
    assert d.n_pivot == 12 and len(d.filt) == 16 and len(d.greedy) == 2
    sampler = Sampler("triton")
    assert sampler.choose(logits, rows) == _exact(logits, rows)
    assert sampler.exact_rows == 0


def test_pivot_row_split_found_by_draw_equals_the_engines():
    """Without ``n_pivot`` draw() finds the pivot rows itself (filtered rows in any order); with
    the pivot path off (``pivot_rounds`` 0) every filtered row takes the window path. Same tokens.
    A row with top-k passed among the pivot rows is not drawn wrong: it comes back -1."""
    from kvpilot.kernels import sampling as ks

    rows = _rows([(1.0, 0.9, 0.0, 20), (0.8, 0.7, 0.0), (1.0, 1.0, 0.0, 5), (1.0, 1.0, 0.1), (0.9, 0.3, 0.02, 0),
                  (1.0, 0.9, 0.05, 50)], seed0=9)
    logits = _logits(3, len(rows), 600)
    want = _exact(logits, rows)
    assert _draw(logits, rows) == want
    assert _draw(logits, rows, n_pivot=None) == want
    assert _draw(logits, rows, pivot_rounds=0) == want

    d = _Draw(rows, logits.shape[1])
    fprm, iprm, _ = d.tensors(logits.device)
    filt = torch.tensor(d.filt)  # ascending: top-k rows 0 and 5 are not at the front
    assert ks.draw(logits, fprm, iprm, filt[:0], filt, n_pivot=None).tolist() == want
    got = ks.draw(logits, fprm, iprm, filt[:0], filt, n_pivot=len(filt))  # every row claimed as pivot
    assert got.tolist() == [-1 if rows[i].top_k else want[i] for i in range(len(rows))]
    with pytest.raises(ValueError, match="n_pivot"):
        ks.draw(logits, fprm, iprm, filt[:0], filt, n_pivot=len(filt) + 1)


def test_pivot_rows_with_masked_logits():
    """Forbidden tokens (-inf logits, e.g. bad words or allowed_token_ids) have mass 0 and no
    chance: a row with most of its vocabulary masked, and one with a single allowed token."""
    g = torch.Generator().manual_seed(6)
    V = 500
    logits = torch.randn(4, V, generator=g) * 2
    logits[0, 10:] = float("-inf")
    logits[1, :] = float("-inf")
    logits[1, 333] = 0.5
    logits[2, ::2] = float("-inf")
    rows = _rows([(1.0, 0.5, 0.0), (0.8, 0.9, 0.1), (1.3, 0.2, 0.0), (1.0, 1.0, 0.5)], seed0=21)
    want = _exact(logits, rows)
    assert want[1] == 333 and want[0] < 10
    assert _draw(logits, rows) == want


def test_check_mode_reports_an_index_outside_the_buffers(monkeypatch):
    """``draw(check=True)`` (`Tuning.sampling_check`: the debug mode the pivot kernels were instrumented with to hunt an
    illegal memory access): a row id past the logits is clamped instead of read, and draw raises
    with the record (code 1 or 2: a pass's row id; value 9; bound S = 3; one record per program, the
    last pass's)."""
    from kvpilot.kernels import sampling as ks

    rows = _rows([(1.0, 0.5, 0.0)] * 3)
    logits = _logits(2, 3, 300)
    d = _Draw(rows, 300)
    fprm, iprm, order = d.tensors(logits.device)
    assert ks.draw(logits, fprm, iprm, order[:0], order, n_pivot=3, check=True).tolist() == _exact(logits, rows)
    bad = order.clone()
    bad[1] = 9
    with pytest.raises(RuntimeError, match=r"pivot path read outside its buffers: \d+ records .*\[[12], 9, 3, "):
        ks.draw(logits, fprm, iprm, order[:0], bad, n_pivot=3, check=True)


def test_min_p_only_rows_settled_by_their_second_candidate():
    """min-p without top-p on flat rows: the first candidate (a draw of the whole distribution)
    often fails min-p, and the C pass then searches level 0 only (every token that passes min-p is
    kept). With one generation such rows come back -1; with two every row has the reference's token."""
    rows = _rows([(1.0, 1.0, mp) for mp in (0.05, 0.2, 0.5, 0.9)] * 4, seed0=60)
    logits = _logits(9, len(rows), 800, scales=(0.5, 1.0, 1.5, 3.0))
    want = _exact(logits, rows)
    one = _draw(logits, rows, pivot_rounds=1)
    assert sum(t < 0 for t in one) >= 4
    assert all(t == w for t, w in zip(one, want) if t >= 0)
    assert _draw(logits, rows, pivot_rounds=2) == want
    assert _draw(logits, rows, **MULTI_CHUNK, pivot_rounds=2) == want
