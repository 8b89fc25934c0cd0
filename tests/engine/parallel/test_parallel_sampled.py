"""Sampled requests at TP 2: the output rank draws their tokens itself, on CPU with gloo.

With asynchronous tensor-parallel steps, a step whose every live request is `_rank_samplable`
(temperature, top-k, top-p, min-p, seed; no logprobs, penalties, bans, beams) is drawn by the
output rank's own `Sampler` from the plan's `SamplingRow` records (`Worker.own_step`), and the next
step reads those ids there at once (``SYNC_SELF``): the front end samples nothing. The tokens must
be bit for bit the ones the front end's sampler draws, so here they equal one process's (TP 1) for
the same seeds, as do PP 2's (whose settled steps the front end samples); mixed batches (a request
with logprobs or penalties) go back to the front end's sampler (``SYNC_GO``) and stay exact; an
abort mid-generation loses and duplicates nothing; rows the output rank's sampler leaves to the
exact draw are rolled back; a sampling row the output rank cannot take stops the engine with its
traceback.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np
import pytest
import torch
from support.engine import GOLDEN

from kvpilot import LLM, EngineDeadError, KvCacheConfig, RequestAborted, SamplingParams
from kvpilot.runner.model_runner import ScheduledSeq
from kvpilot.parallel.worker import MSG_IDS, RowDecoder, RowEncoder, Worker
from kvpilot.sampling.sampler import Sampler
from kvpilot.sampling.sampler_inputs import RECORD, SamplingRow
from support.parallel import _FrontEndDraws

pytestmark = pytest.mark.timeout(300)

_KW = dict(device="cpu", max_batch_size=8, max_num_tokens=64, kv_cache_config=KvCacheConfig(tokens_per_block=16))

_LONG = "Once upon a time there was a little girl named Lily. " * 9  # ~120 tokens: prefill chunks at 64
# Seeded draws the output rank can make (every filter, alone and together; n > 1; a greedy row next
# to them; a prompt prefilled in chunks), ending at different steps (max_tokens, EOS, a stop
# string), so that rows drop out of steps planned ahead.
SAMPLED = [
    ("Once upon a time", SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=24)),
    ("The little dog", SamplingParams(temperature=1.0, top_k=20, seed=2, max_tokens=18, ignore_eos=True)),
    ("Tom and Sue", SamplingParams(temperature=0.9, min_p=0.1, seed=3, max_tokens=22, stop=["."])),
    ("She was sad", SamplingParams(n=2, temperature=0.7, top_k=30, top_p=0.8, min_p=0.05, seed=4,
                                   max_tokens=20, ignore_eos=True)),
    ("", SamplingParams(temperature=1.2, seed=5, max_tokens=16, ignore_eos=True)),
    ("One day", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
    (_LONG, SamplingParams(temperature=0.9, top_p=0.95, seed=8, max_tokens=10, ignore_eos=True)),
]
_LOGPROBS = ("Lily", SamplingParams(temperature=0.8, seed=6, max_tokens=40, ignore_eos=True, logprobs=1))
_PENALTY = ("A cat", SamplingParams(temperature=0.8, seed=7, max_tokens=5, ignore_eos=True, frequency_penalty=0.5))


def _drain(core) -> None:
    while core.has_work:
        core.step()
        core.flush_outputs()


def _choices(out) -> list:
    return [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]


def _drive(llm, items, events=None) -> dict:
    """Run ``items`` (prompt, params) on a hand-driven `LLM` (``events``: {step: [index to abort]});
    returns per index its choices, or ("aborted", tokens generated before the abort). Checks that
    the executor has nothing left in flight."""
    core = llm._core
    reqs = [llm._make_request(p, sp, False) for p, sp in items]
    for r in reqs:
        core.add_request(r)
    i = 0
    while core.has_work:
        for k in (events or {}).get(i, []):
            core.abort_request(reqs[k].request_id)
            core.flush_outputs()
        core.step()
        core.flush_outputs()
        i += 1
    ex = core.executor
    assert not ex._sent and ex._unpublished == 0 and not ex._go_pending and not ex._stash
    assert core._inflight is None and core.kv.num_used_blocks == 0 and not core.requests
    out = {}
    for k, r in enumerate(reqs):
        try:
            out[k] = _choices(r.output.result(timeout=0))
        except RequestAborted:
            out[k] = ("aborted", [c.token_ids for c in r.output.outputs])
    return out


@pytest.fixture(scope="module")
def reference(stories_model_dir):
    """One process's tokens (TP 1), for every workload of this module."""
    items = SAMPLED + [_LOGPROBS, _PENALTY]  # reference[-2], reference[-1]
    with LLM(str(stories_model_dir), **_KW) as one:
        outs = one.generate([p for p, _ in items], [sp for _, sp in items], use_tqdm=False)
    return [_choices(o) for o in outs]


@pytest.fixture(scope="module")
def tp_llm(stories_model_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPILOT_TUNING", '{"async_scheduling": true}')
    try:
        llm = LLM(str(stories_model_dir), tensor_parallel_size=2, **_KW)
    finally:
        mp.undo()
    llm._loop.stop()  # steps are driven by hand
    ex = llm._executor
    assert ex.defers_logits and ex.samples_on_output_rank and llm._core.async_scheduling
    counter = llm._core.sampler = _FrontEndDraws(llm._core.sampler)
    yield llm, counter
    t0 = time.monotonic()
    llm.shutdown()
    assert time.monotonic() - t0 < 10


def _counts(llm, counter) -> tuple[int, int, int]:
    ex = llm._executor
    return ex.num_rank_sampled_steps, ex.num_self_steps, counter.rows


def test_tp2_sampled_tokens_are_one_process_tokens(tp_llm, reference):
    llm, counter = tp_llm
    before = _counts(llm, counter)
    got = _drive(llm, SAMPLED)
    sampled, selfs, front_rows = (a - b for a, b in zip(_counts(llm, counter), before))
    assert [got[k] for k in range(len(SAMPLED))] == reference[:len(SAMPLED)]
    # The output rank drew every step, fed the next step itself, and the front end sampled nothing.
    assert sampled > 15 and selfs > 10 and front_rows == 0
    reasons = {c[2] for r in got.values() for c in r}
    assert reasons == {"length", "stop"}


@pytest.mark.parametrize("extra", ["logprobs", "penalty"])
def test_a_request_that_needs_the_front_end_switches_the_steps_back(tp_llm, reference, extra):
    """Logprobs for the whole run: the front end samples every step (``SYNC_GO``); a short penalised
    request: the front end samples while it lives, the output rank after it ended."""
    llm, counter = tp_llm
    item, ref = (_LOGPROBS, reference[-2]) if extra == "logprobs" else (_PENALTY, reference[-1])
    before = _counts(llm, counter)
    got = _drive(llm, SAMPLED + [item])
    sampled, _selfs, front_rows = (a - b for a, b in zip(_counts(llm, counter), before))
    assert [got[k] for k in range(len(SAMPLED))] == reference[:len(SAMPLED)]
    assert got[len(SAMPLED)] == ref
    assert front_rows > 0
    if extra == "logprobs":
        assert sampled == 0
    else:
        assert sampled > 5


def test_a_long_prompt_alone(tp_llm, reference):
    """Its first prefill chunk samples nothing: a step of no rows, still awaited (an arg-max step of
    none); the last chunk's row is the output rank's."""
    llm, counter = tp_llm
    before = _counts(llm, counter)
    got = _drive(llm, SAMPLED[-1:])
    sampled, _selfs, front_rows = (a - b for a, b in zip(_counts(llm, counter), before))
    assert got[0] == reference[len(SAMPLED) - 1]
    assert sampled == 10 and front_rows == 0


def test_abort_mid_generation(tp_llm, reference):
    """Aborts while the output rank's steps are in flight: the aborted requests keep exactly the
    tokens drawn before (a prefix of one process's), the others are untouched."""
    llm, counter = tp_llm
    before = _counts(llm, counter)
    got = _drive(llm, SAMPLED, events={4: [0], 9: [3, 5]})
    sampled, _selfs, front_rows = (a - b for a, b in zip(_counts(llm, counter), before))
    assert sampled > 10 and front_rows == 0
    for k in (0, 3, 5):
        tag, toks = got[k]
        assert tag == "aborted" and toks
        for t, ref in zip(toks, reference[k]):
            assert 0 < len(t) < len(ref[0]) and t == ref[0][:len(t)]
    for k in (1, 2, 4, 6):
        assert got[k] == reference[k]
    # The engine goes on serving the same requests exactly.
    again = _drive(llm, SAMPLED[:1])
    assert again[0] == reference[0]


def test_rows_redrawn_by_the_output_rank_are_rolled_back(tp_llm, reference, monkeypatch):
    """The output rank reports rows its sampler drew again on the host (-1 in its ids buffer, read
    by the next step): the engine drops what the next step computed for them and computes that
    position again. Forced here by reporting row 0 of every sampled step as redrawn."""
    llm, _ = tp_llm
    ex = llm._executor
    real, marked = ex.await_ids, [0]

    def await_ids():
        ids, redrawn = real()
        if len(ids) > 1 and not redrawn:
            marked[0] += 1
            return ids, [0]
        return ids, redrawn

    monkeypatch.setattr(ex, "await_ids", await_ids)
    plans: list = []
    real_execute = ex.execute

    def execute(plan):
        plans.append([(p.seq_id, p.start_pos) for p in plan])
        return real_execute(plan)

    monkeypatch.setattr(ex, "execute", execute)
    got = _drive(llm, SAMPLED[:3])
    assert marked[0] > 5
    seen = [s for plan in plans for s in plan]
    assert len(seen) - len(set(seen)) >= marked[0] // 2  # positions computed again
    assert [got[k] for k in range(3)] == reference[:3]


def test_greedy_golden_and_the_switch(tp_llm, stories_model_dir, reference, monkeypatch):
    llm, counter = tp_llm
    text = _drive(llm, [("", SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))])[0][0][1]
    assert len(text) > 50 and text == GOLDEN[:len(text)]
    # Tuning(tp_rank_sampling=False): the front end samples (arg-max steps stay on the output rank).
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": true, "tp_rank_sampling": false}')
    with LLM(str(stories_model_dir), tensor_parallel_size=2, **_KW) as off:
        off._loop.stop()
        assert off._executor.defers_logits and not off._executor.samples_on_output_rank
        front = off._core.sampler = _FrontEndDraws(off._core.sampler)
        got = _drive(off, SAMPLED)
        assert off._executor.num_rank_sampled_steps == 0 and front.rows > 50
    assert [got[k] for k in range(len(SAMPLED))] == reference[:len(SAMPLED)]


def test_pp2_sampled_tokens_are_one_process_tokens(stories_model_dir, reference):
    with LLM(str(stories_model_dir), pipeline_parallel_size=2, **_KW) as llm:
        assert not llm._executor.defers_logits  # settled steps: the front end samples
        outs = llm.generate([p for p, _ in SAMPLED], [sp for _, sp in SAMPLED], use_tqdm=False)
    assert [_choices(o) for o in outs] == reference[:len(SAMPLED)]


def test_a_sampling_row_the_output_rank_rejects_stops_the_engine(stories_model_dir, monkeypatch):
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": true}')
    llm = LLM(str(stories_model_dir), tensor_parallel_size=2, device="cpu", max_batch_size=2)
    try:
        llm._loop.stop()
        ex = llm._executor
        bad = SamplingRow(temperature=0.8, seed=1, frequency_penalty=0.5).record()  # needs a token history
        ex.own_ids_hint = ([(0, 0, bad)], False)
        ex.execute([ScheduledSeq(seq_id=0, token_ids=[1], start_pos=0, block_table=[0], sample=True)])
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=r"(?s)worker rank 0 failed:.*Traceback.*token lists"):
            ex.await_ids()
        assert time.monotonic() - t0 < 30
        assert all(not p.is_alive() for p in ex._procs)
    finally:
        llm.shutdown()


# ---- units ----------------------------------------------------------------------------------------

def _rows() -> list[SamplingRow]:
    return [SamplingRow(temperature=0.8, top_p=0.9, seed=11, step=3),
            SamplingRow(temperature=1.0, top_k=5, seed=12, step=0),
            SamplingRow(temperature=0.0, seed=13, step=7),
            SamplingRow(temperature=0.9, min_p=0.2, top_k=40, top_p=0.7, seed=2 ** 62 + 5, step=2),
            SamplingRow(temperature=1.3, seed=14, step=1)]


def test_rows_from_records_draw_what_the_rows_draw():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 97, generator=g) * 3
    rows = _rows()
    copies = [SamplingRow.from_record(r.record(), r.step) for r in rows]
    assert [c.record() for c in copies] == [r.record() for r in rows]
    for backend in ("torch", "exact"):
        assert Sampler(backend)(logits, copies).token_ids == Sampler(backend)(logits, rows).token_ids
    with pytest.raises(ValueError, match="token lists"):
        SamplingRow.from_record(SamplingRow(presence_penalty=0.1).record())
    with pytest.raises(ValueError, match="bytes"):
        SamplingRow.from_record(b"\0" * (RECORD.itemsize - 1))


def test_row_encoding_sends_each_record_once():
    enc, dec = RowEncoder(), RowDecoder()
    rows = _rows()
    recs = [r.record() for r in rows]
    first = enc.encode([(10 + i, r.step, rec) for i, (r, rec) in enumerate(zip(rows, recs))])
    assert [e[2] for e in first] == recs
    got = dec.decode(first)
    assert [g.record() for g in got] == recs and [g.step for g in got] == [r.step for r in rows]
    # Next step: sequences 10 and 12 go on (positions + 1), 14 leaves, 20 arrives.
    second = enc.encode([(10, 4, recs[0]), (20, 0, recs[4]), (12, 8, recs[2])])
    assert second == [(10, 4, None), (20, 0, recs[4]), (12, 8, None)]
    again = dec.decode(second)
    assert again[0] is got[0] and again[2] is got[2] and [r.step for r in again] == [4, 0, 8]
    with pytest.raises(KeyError):
        dec.decode([(14, 2, None)])  # 14 was not in the last step


class _Pipe:
    def __init__(self) -> None:
        self.sent: list = []

    def send(self, msg) -> None:
        self.sent.append(msg)


def test_own_step_sends_the_samplers_ids_and_the_rows_it_drew_again(monkeypatch):
    """The output rank's `Worker.own_step` + `flush_ids` (CPU): the ids buffer gets the sampler's
    device tokens (-1 where it leaves a row to the exact draw), the message the final ids and
    those rows."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 97, generator=g) * 3
    rows = _rows()
    want = Sampler()(logits, rows).token_ids
    orig = Sampler._filtered

    def filtered(x, fprm, iprm, keys, sel, ks, exact):  # the fast path settles no filtered row
        out = orig(x, fprm, iprm, keys, sel, ks, exact)
        return out if exact else torch.full_like(out, -1)

    monkeypatch.setattr(Sampler, "_filtered", staticmethod(filtered))
    w = Worker.__new__(Worker)
    w.tok_buf = torch.zeros(8, dtype=torch.int64)
    w.pending_ids, w.sampler, w._ids_host, w.num_sampled_steps = deque(), None, None, 0
    pipe = _Pipe()
    w.own_step(logits, 0, rows)
    w.flush_ids(pipe, keep=0)
    filt = [0, 1, 3]  # rows with top-k / top-p / min-p
    assert pipe.sent == [(MSG_IDS, want, filt)]
    dev = w.tok_buf[:5].tolist()
    assert [dev[i] for i in filt] == [-1] * 3 and [dev[i] for i in (2, 4)] == [want[2], want[4]]
    assert w.num_sampled_steps == 1
    # An arg-max step of the same logits: no row drawn again.
    w.own_step(logits, 1)
    w.flush_ids(pipe, keep=0)
    assert pipe.sent[1] == (MSG_IDS, logits.argmax(-1).tolist(), [])
    with pytest.raises(ValueError, match="sampling rows"):
        w.own_step(logits, 0, rows[:4])
    assert np.array_equal(w.tok_buf[:5].numpy(), logits.argmax(-1).numpy())
