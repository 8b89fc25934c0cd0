"""The sampler's host side: cached row records, the one-copy upload, launch/finish, and the
penalties' device-side token counts (incrementally updated counts equal a recount; slots are
reused; the Triton penalty kernel equals the PyTorch path bit for bit)."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

from kvpilot.sampling.logits_processors import TokenCounts, _penalties_torch, apply_penalties_and_masks, token_counts
from kvpilot.sampling.sampler import Sampler, SamplingRow, _Draw, _row_keys, _row_keys_host
from kvpilot.sampling.sampler_inputs import RECORD, Upload, records

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
interpret_only = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels in the interpreter")


def _penalized(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Bias and penalties by their definitions, token by token (HF repetition over prompt +
    output, each token once; OpenAI frequency/presence over the output)."""
    out = logits.clone()
    V = logits.shape[1]
    for i, r in enumerate(rows):
        for t, b in (r.logit_bias or {}).items():
            if 0 <= t < V:
                out[i, t] += b
        for t in set(r.prompt_token_ids or []) | set(r.output_token_ids):
            if 0 <= t < V:  # ids outside the vocabulary are ignored
                v = out[i, t]
                out[i, t] = v / r.repetition_penalty if v > 0 else v * r.repetition_penalty
        for t in set(r.output_token_ids):
            if 0 <= t < V:
                out[i, t] -= r.frequency_penalty * r.output_token_ids.count(t) + r.presence_penalty
    return out


def _recount(row: SamplingRow, V: int) -> torch.Tensor:
    c = torch.zeros(V, dtype=torch.int32)
    for t in row.output_token_ids:
        if 0 <= t < V:
            c[t] += 2
    for t in set(row.prompt_token_ids or []):
        if 0 <= t < V:
            c[t] |= 1
    return c


# ---- records and uploads -----------------------------------------------------------------------
def test_records_follow_assigned_parameters():
    r = SamplingRow(temperature=0.5, top_k=7, seed=-3, logprobs=2)
    rec = records([r])
    assert rec.dtype == RECORD
    assert (rec["temperature"][0], rec["top_k"][0], rec["seed"][0], rec["logprobs"][0]) == (0.5, 7, -3, 2)
    assert rec["flags"][0] == 0 and not r.needs_processing
    r.temperature, r.repetition_penalty = 0.0, 1.2  # assigned after the record was cached
    rec = records([r])
    assert rec["temperature"][0] == 0.0 and rec["repetition"][0] == np.float32(1.2) and rec["flags"][0] != 0
    assert r.needs_processing
    r.logit_bias = {3: 1.0}
    assert r.vocab_arrays(10)[0].tolist() == [3]
    r.logit_bias = {4: 2.0, 99: 1.0}  # a new dict: the cached arrays are rebuilt (99 >= V dropped)
    assert r.vocab_arrays(10)[0].tolist() == [4] and r.vocab_arrays(10)[1].tolist() == [2.0]
    with pytest.raises(OverflowError):
        SamplingRow(top_k=2 ** 63).record()


def test_upload_round_trips_arrays_in_one_buffer():
    arrays = [np.arange(5, dtype=np.int64), np.linspace(0, 1, 7, dtype=np.float32).reshape(7, 1),
              np.empty(0, np.int64), np.array([True, False]), np.arange(6, dtype=np.int32).reshape(2, 3)]
    up = Upload()
    handles = [up.add(a) for a in arrays]
    got = up.send(torch.device("cpu"))
    base = got[0].untyped_storage().data_ptr()
    for h, a in zip(handles, arrays):
        t = got[h]
        assert t.shape == a.shape and t.numpy().dtype == a.dtype and np.array_equal(t.numpy(), a)
        assert t.untyped_storage().data_ptr() == base  # one buffer
        assert (t.data_ptr() - base) % 64 == 0


def test_host_row_keys_equal_device_row_keys():
    g = torch.Generator().manual_seed(0)
    seeds = torch.cat([torch.randint(-2 ** 63, 2 ** 63 - 1, (500,), generator=g),
                       torch.tensor([0, -1, 2 ** 63 - 1, -2 ** 63, 2 ** 32])])
    steps = torch.cat([torch.randint(0, 2 ** 40, (500,), generator=g), torch.tensor([0, 1, 2 ** 32, 7, 2 ** 62])])
    assert torch.equal(torch.from_numpy(_row_keys_host(seeds.numpy(), steps.numpy())), _row_keys(seeds, steps))


def test_draw_parameters_split_rows_by_kind():
    rows = [SamplingRow(temperature=0.0), SamplingRow(temperature=0.8, seed=1, step=4),
            SamplingRow(temperature=0.7, top_k=5), SamplingRow(temperature=1.0, top_p=0.0),
            SamplingRow(temperature=1.0, top_k=1000), SamplingRow(temperature=1.0, min_p=0.1)]
    d = _Draw(rows, 100)
    assert (d.greedy.tolist(), d.plain.tolist(), d.filt.tolist()) == ([0], [1, 4], [2, 3, 5])
    fprm, iprm, order = d.tensors(torch.device("cpu"))
    assert order.tolist() == [1, 4, 0, 2, 3, 5]
    assert iprm[:, 0].tolist() == [0, 0, 5, 1, 0, 0]  # top_p 0 -> top_k 1; top_k >= V -> off
    assert iprm[1, 1:3].tolist() == [1, 4] and fprm[3, 1] == 1.0
    assert fprm[5, 2] == pytest.approx(float(np.log(0.1))) and fprm[0, 2] == float("-inf")


# ---- launch / finish ---------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["torch", "exact", "triton"])
def test_launch_then_finish_equals_call(backend):
    if backend == "triton" and not INTERPRET:
        pytest.skip("the Triton backend runs on CPU only in the interpreter")
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(7, 600, generator=g) * 3
    rows = [SamplingRow(temperature=t, top_k=k, top_p=p, seed=i, step=3, logprobs=lp, frequency_penalty=f,
                        output_token_ids=[1, 2, 2])
            for i, (t, k, p, lp, f) in enumerate([(0.0, 0, 1.0, 2, 0.0), (0.8, 0, 1.0, None, 0.5),
                                                   (1.0, 20, 0.9, 0, 0.0), (0.7, 0, 0.5, 3, 0.0),
                                                   (1.2, 3, 1.0, None, 1.0), (0.0, 0, 1.0, None, 0.0),
                                                   (1.0, 0, 0.95, 1, 0.0)])]
    raw = logits.clone()
    sampler = Sampler(backend)
    pending = sampler.launch(logits, rows)
    got = pending.finish()
    assert torch.equal(logits, raw)  # the transforms worked on a copy
    want = Sampler("exact")(logits, rows)
    assert got.token_ids == want.token_ids
    lsm = torch.log_softmax(logits, dim=-1)
    for i, r in enumerate(rows):
        if r.logprobs is None:
            assert got.logprobs[i] is None and got.top_logprobs[i] is None
            continue
        ids, vals, rank = got.top_logprobs[i]
        assert ids == lsm[i].topk(r.logprobs).indices.tolist()
        torch.testing.assert_close(torch.tensor(vals), lsm[i].topk(r.logprobs).values)
        assert rank == int((logits[i] > logits[i, got.token_ids[i]]).sum()) + 1
        assert got.logprobs[i] == pytest.approx(float(lsm[i, got.token_ids[i]]), abs=1e-5)


def test_candidate_path_hands_flat_rows_to_the_exact_draw_with_their_logprobs():
    """Nearly uniform rows defeat the top-1024 candidates (top-p needs most of the vocabulary):
    they come back as -1 from the launch and `finish` draws them (and their log-probabilities)."""
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(4, 3000, generator=g) * 0.01
    rows = [SamplingRow(temperature=1.0, top_p=0.9, seed=i, logprobs=2) for i in range(4)]
    sampler = Sampler("torch")
    got = sampler(logits, rows)
    assert sampler.exact_rows == 4
    assert got.token_ids == Sampler("exact").choose(logits, rows)
    lsm = torch.log_softmax(logits, dim=-1)
    for i, tok in enumerate(got.token_ids):
        assert got.logprobs[i] == pytest.approx(float(lsm[i, tok]), abs=1e-6)
        assert got.top_logprobs[i][2] == int((logits[i] > logits[i, tok]).sum()) + 1


@interpret_only
def test_triton_hand_off_redoes_logprobs_of_rows_drawn_again():
    from kvpilot.kernels import sampling as ks

    g = torch.Generator().manual_seed(6)
    logits = torch.randn(6, 1500, generator=g) * 0.3
    rows = [SamplingRow(temperature=1.0, top_p=0.9, seed=i, step=1, logprobs=3) for i in range(6)]
    saved = dict(ks.CONFIG)
    ks.CONFIG.update(chunk=512, block=256, wcap=16, pivot_rounds=0)
    try:
        sampler = Sampler("triton")
        got = sampler(logits, rows)
    finally:
        ks.CONFIG.update(saved)
    assert sampler.exact_rows > 0
    assert got.token_ids == Sampler("exact").choose(logits, rows)
    lsm = torch.log_softmax(logits, dim=-1)
    for i, tok in enumerate(got.token_ids):
        assert got.logprobs[i] == pytest.approx(float(lsm[i, tok]), abs=1e-5)
        assert got.top_logprobs[i][2] == int((logits[i] > logits[i, tok]).sum()) + 1


def test_the_engine_uses_the_split_interface():
    """EngineCore overlaps its output work with the sampler when the sampler has ``launch``."""
    assert callable(getattr(Sampler(), "launch", None))


# ---- penalties: token counts on the device --------------------------------------------------------
def test_incremental_counts_equal_a_recount_over_many_steps():
    V = 60
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, V, generator=g) * 2
    rows = [SamplingRow(repetition_penalty=1.4, frequency_penalty=0.3, presence_penalty=0.2,
                        prompt_token_ids=[1, 5, 5, 9, 70, -2], output_token_ids=[]),
            SamplingRow(temperature=0.0),
            SamplingRow(frequency_penalty=-0.5, presence_penalty=0.7, output_token_ids=[3])]
    outs = [[], [], [3]]
    for step in range(25):
        for j in (0, 2):
            outs[j] = outs[j] + [int(torch.randint(0, V, (1,), generator=g))]
            if step % 3 == 0:
                rows[j].output_token_ids.append(outs[j][-1])  # the same list, grown in place
            else:
                rows[j].output_token_ids = list(outs[j])  # a new list each step (as the engine does)
        if step == 12:  # a shorter history (another hypothesis): counted again from scratch
            outs[0] = outs[0][:4]
            rows[0].output_token_ids = list(outs[0])
        got = apply_penalties_and_masks(logits.clone(), rows)
        torch.testing.assert_close(got, _penalized(logits, rows), rtol=0, atol=1e-5)
        pool = token_counts(logits.device, V)
        for j in (0, 2):
            assert torch.equal(pool.counts[rows[j]._counts[1]], _recount(rows[j], V))
        fresh = [SamplingRow(repetition_penalty=r.repetition_penalty, frequency_penalty=r.frequency_penalty,
                             presence_penalty=r.presence_penalty, prompt_token_ids=r.prompt_token_ids,
                             output_token_ids=list(r.output_token_ids)) for r in rows]
        assert torch.equal(got, apply_penalties_and_masks(logits.clone(), fresh))


def test_count_slots_are_reused_and_cleared_and_the_pool_grows():
    V = 16
    pool = TokenCounts(torch.device("cpu"), V)
    rows = [SamplingRow(frequency_penalty=1.0, output_token_ids=[i % V] * 3) for i in range(10)]
    slots, clear, marks, adds = pool.plan(rows, range(10))
    pool.update(*(torch.from_numpy(a) for a in (clear, marks, adds)), torch.full((adds.size,), 2, dtype=torch.int32))
    assert sorted(slots.tolist()) == list(range(10)) and pool.counts.shape[0] >= 10  # grown from 8
    for r, s in zip(rows, slots.tolist()):
        assert torch.equal(pool.counts[s], _recount(r, V))
    dead = slots[:4].tolist()
    del r
    del rows[:4]
    gc.collect()
    new = [SamplingRow(presence_penalty=1.0, output_token_ids=[15]) for _ in range(4)]
    cap = pool.counts.shape[0]
    while len(pool._free) > 0:  # use up the never-used slots first
        pool._alloc(SamplingRow())
    s2, clear, marks, adds = pool.plan(new, range(4))
    pool.update(*(torch.from_numpy(a) for a in (clear, marks, adds)), torch.full((adds.size,), 2, dtype=torch.int32))
    assert sorted(s2.tolist()) == sorted(dead) and pool.counts.shape[0] == cap  # reused, not grown
    for r, s in zip(new, s2.tolist()):
        assert torch.equal(pool.counts[s], _recount(r, V))  # the dead rows' counts were cleared
    for r, s in zip(rows, slots[4:].tolist()):
        assert torch.equal(pool.counts[s], _recount(r, V))  # the live rows' counts survived


def test_a_failed_call_leaves_the_counts_usable(monkeypatch):
    """A call that fails between planning the counts and applying them gives the pool's lock back
    and makes its rows count from scratch, so the next call is right."""
    from kvpilot.sampling import sampler_inputs

    V = 30
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(5))
    rows = [SamplingRow(frequency_penalty=0.5, output_token_ids=[1, 2, 2]),
            SamplingRow(repetition_penalty=1.5, prompt_token_ids=[4], output_token_ids=[7])]
    apply_penalties_and_masks(logits.clone(), rows)
    real = sampler_inputs.Upload.send

    def broken(self, dev):
        raise RuntimeError("upload failed")

    monkeypatch.setattr(sampler_inputs.Upload, "send", broken)
    rows[0].output_token_ids.append(9)
    with pytest.raises(RuntimeError, match="upload failed"):
        Sampler("torch")(logits, rows)
    monkeypatch.setattr(sampler_inputs.Upload, "send", real)
    assert not token_counts(logits.device, V).lock.locked()
    rows[1].output_token_ids.append(7)
    got = Sampler("torch")(logits, [SamplingRow(temperature=0.0, **{k: getattr(r, k) for k in (
        "frequency_penalty", "repetition_penalty", "prompt_token_ids", "output_token_ids")}) for r in rows])
    assert got.token_ids == _penalized(logits, rows).argmax(dim=-1).tolist()
    torch.testing.assert_close(apply_penalties_and_masks(logits.clone(), rows), _penalized(logits, rows),
                               rtol=0, atol=1e-6)


def test_penalties_ignore_out_of_range_ids_and_keep_other_rows():
    V = 40
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(3))
    rows = [SamplingRow(repetition_penalty=2.0, prompt_token_ids=[-1, 39, 40, 2 ** 40], output_token_ids=[0, 41]),
            SamplingRow(banned_token_ids=[2 ** 63, 5, -4], logit_bias={2: 1.5, 40: 3.0}),
            SamplingRow()]
    got = apply_penalties_and_masks(logits.clone(), rows)
    want = logits.clone()
    for t in (39, 0):
        want[0, t] = want[0, t] / 2 if want[0, t] > 0 else want[0, t] * 2
    want[1, 5] = float("-inf")
    want[1, 2] += 1.5
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _penalty_case():
    g = torch.Generator().manual_seed(7)
    S, V = 5, 3000
    logits = torch.randn(S, V, generator=g) * 3
    logits[0, :10] = 0.0
    logits[1, 5] = float("-inf")
    counts = torch.randint(0, 4, (8, V), generator=g, dtype=torch.int32)
    counts[counts == 3] = 0
    rows = torch.tensor([0, 1, 3, 4])
    slots = torch.tensor([6, 0, 2, 2])
    pen = torch.tensor([[1.3, 0.4, 0.2], [0.7, -0.5, 1.0], [1.0, 0.0, 0.0], [2.5, 0.33, -0.1]])
    return logits, rows, slots, counts, pen


@pytest.mark.parametrize("rep,freq", [(True, True), (True, False), (False, True)])
def test_dense_and_sparse_torch_penalties_are_identical(rep, freq):
    logits, rows, slots, counts, pen = _penalty_case()
    a, b = logits.clone(), logits.clone()
    _penalties_torch(a, rows, slots, counts, pen, rep, freq, dense=True)
    _penalties_torch(b, rows, slots, counts, pen, rep, freq, dense=False)
    assert torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())
    assert torch.equal(a[2], logits[2])  # not a penalty row
    c = counts[slots[0]]
    assert torch.equal(a[0][c == 0], logits[0][c == 0])  # tokens without a count are untouched
    if rep:
        seen = (c > 0).nonzero().squeeze(1)
        v = logits[0, seen]
        want = torch.where(v > 0, v / 1.3, v * 1.3)
        if freq:
            n = (c[seen] >> 1).float()
            want = torch.where(n > 0, want - (0.4 * n + 0.2), want)
        torch.testing.assert_close(a[0, seen], want)


@interpret_only
@pytest.mark.parametrize("rep,freq", [(True, True), (True, False), (False, True)])
def test_triton_penalty_kernel_equals_torch_bit_for_bit(rep, freq):
    from kvpilot.kernels import sampling as ks

    logits, rows, slots, counts, pen = _penalty_case()
    a, b = logits.clone(), logits.clone()
    _penalties_torch(a, rows, slots, counts, pen, rep, freq)
    ks.apply_penalties(b, rows, slots, counts, pen, rep, freq)
    assert torch.equal(a, b) and torch.equal(a.signbit(), b.signbit())


# ---- GPU ---------------------------------------------------------------------------------------
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("backend", [
    # H200, 2026-11-30: the Triton path's whole call synchronised twice in this test (launch itself
    # did not wait); the second source is not found yet. Strict, so a fix must remove the mark.
    pytest.param("triton", marks=pytest.mark.xfail(strict=True, reason="2 syncs per call measured on an H200")),
    "torch",
])
def test_gpu_launch_reads_nothing_and_waits_for_nothing(backend):
    """launch never synchronises (no read, no pageable upload): it returns while the GPU is still
    busy with earlier work; the whole call synchronises once."""
    import warnings

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    # peaked rows: the candidate path settles them all (a flat row would take a second read)
    logits = torch.randn(256, 128256, device=dev, generator=g) * 4
    rows = [SamplingRow(temperature=[0.0, 0.8, 1.0, 0.7][i % 4], top_p=[1.0, 0.9, 1.0, 0.95][i % 4],
                        top_k=[0, 0, 40, 0][i % 4], seed=i, step=5, logprobs=[None, 2][i % 2],
                        repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5,
                        prompt_token_ids=list(range(i, i + 300)), output_token_ids=list(range(i, i + 100)),
                        logit_bias={7: 1.0}, banned_token_ids=[i]) for i in range(256)]
    sampler = Sampler(backend)
    want = sampler(logits, rows)  # warm-up (compiles, allocates the pools)
    assert sampler.exact_rows == 0
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)
    busy = torch.cuda.Event()
    busy.record()
    pending = sampler.launch(logits, rows)
    assert not busy.query(), "launch waited for the GPU"
    assert pending.finish().token_ids == want.token_ids
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode(1)
        try:
            sampler(logits, rows)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) <= 1, syncs


@gpu
@pytest.mark.gpu
def test_gpu_penalties_triton_equals_torch_and_formula_at_serving_shape():
    dev = torch.device("cuda")
    V = 128256
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(256, V, generator=torch.Generator(device=dev).manual_seed(1), device=dev) * 3
    rows = [SamplingRow(repetition_penalty=[1.1, 1.0, 0.8][i % 3], frequency_penalty=[0.5, 0.0, -0.3][i % 3],
                        presence_penalty=[0.5, 0.2, 0.0][i % 3],
                        prompt_token_ids=torch.randint(0, V, (1024,), generator=g).tolist(),
                        output_token_ids=torch.randint(0, V, (512,), generator=g).tolist(),
                        logit_bias={int(t): 1.0 for t in torch.randint(0, V, (10,), generator=g)})
            for i in range(256)]
    for step in range(3):
        for r in rows:
            r.output_token_ids.append(int(torch.randint(0, V, (1,), generator=g)))
        a = apply_penalties_and_masks(logits.clone(), rows)
        b = apply_penalties_and_masks(logits.clone(), rows, use_triton=True)
        assert torch.equal(a, b)
    want = _penalized(logits[:8].cpu(), rows[:8])
    torch.testing.assert_close(a[:8].cpu(), want, rtol=1e-6, atol=1e-5)
