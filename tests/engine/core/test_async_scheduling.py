"""Async scheduling (engine_core's module docstring): step N+1 is planned and launched before step
N's sampled tokens are read, its in-flight input ids gathered on the device.

Every test forces it on (``KVPILOT_TUNING='{"async_scheduling": true}'``; it is off by default on CPU) and compares
with the synchronous engine (the same engine object with ``async_scheduling`` off), driving
`EngineCore.step` by hand on the test thread (the loop thread is stopped) so that both modes see the
same submissions. Each test also checks that the async branch really ran (``num_overlapped_steps``).
Token ids, text, finish and stop reasons must be identical; log-probabilities agree to float32
rounding (the asynchronous engine computes a dropped row for sequences that end, so batches differ).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from support.engine import GOLDEN, make_tiny_llama
from support.async_engine import _choice, _close
from kvpilot import LLM, KvCacheConfig, RequestAborted, SamplingParams
from kvpilot.core.engine_core import EngineCore
from kvpilot.tuning import Tuning
from kvpilot.core.kv_cache_manager import KVCacheManager
from kvpilot.sampling.sampler import Sampler, SamplingRow
from kvpilot.core.scheduler import Scheduler
from kvpilot.core.sequence import Request, Sequence, SequenceStatus
from support.async_engine import _drain, _assert_same, _MIX, _PENALTIES, _minus_ones, _FILTERED


@pytest.fixture(autouse=True)
def _forced_on(monkeypatch):
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": true}')


def _hand_llm(model_dir, kv_tokens=None, **kw) -> LLM:
    llm = LLM(str(model_dir), max_batch_size=6, max_num_tokens=64,
              kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=kv_tokens), **kw)
    llm._loop.stop()
    assert llm._core.async_scheduling  # forced on by the environment
    return llm


class _Recorder:
    """Wraps the executor: every step's plan as (seq id, start position, in-flight row)."""

    def __init__(self, executor) -> None:
        self.executor = executor
        self.plans: list[list[tuple[int, int, int]]] = []

    def __getattr__(self, name):
        return getattr(self.executor, name)

    def execute(self, plan):
        self.plans.append([(p.seq_id, p.start_pos, p.inflight_row) for p in plan])
        return self.executor.execute(plan)


def _run(llm, mix, async_sched: bool, copies: int = 1):
    """Submit ``mix`` (prompt, params, streaming) ``copies`` times at once and step until done.
    Returns (per request: choices, streamed chunks, generation logits), the plans, preemptions and
    overlapped steps of the run."""
    core = llm._core
    core.async_scheduling = async_sched
    rec = _Recorder(core.executor)
    core.executor = rec
    pre, over = core.scheduler.num_preemptions, core.num_overlapped_steps
    try:
        reqs = [llm._make_request(p, sp, s) for p, sp, s in mix * copies]
        for r in reqs:
            core.add_request(r)
        _drain(core)
    finally:
        core.executor = rec.executor
    assert core.kv.num_used_blocks == 0 and not core.requests and core._inflight is None
    res = []
    for r in reqs:
        o = r.output
        chunks = []
        if o.streaming:
            for chunk in o:
                chunks.append([(c.token_ids_diff, c.text_diff) for c in chunk.outputs])
        else:
            o.result(timeout=0)
        gl = [None if c.generation_logits is None else c.generation_logits.tolist() for c in o.outputs]
        res.append((_choice(o), chunks, gl))
    return res, rec.plans, core.scheduler.num_preemptions - pre, core.num_overlapped_steps - over


def _both(llm, mix, copies: int = 1):
    return _run(llm, mix, False, copies), _run(llm, mix, True, copies)


def test_tuning_switch(stories_model_dir, monkeypatch):
    """``Tuning.async_scheduling`` None: on with a CUDA executor, off on CPU; True/False force it."""
    def core(device, value):
        ex = SimpleNamespace(num_blocks=8, block_size=4, device=device)
        return EngineCore(ex, None, [0], 16, 2, 32, True, tuning=Tuning(async_scheduling=value)).async_scheduling

    assert core("cuda", None) and not core("cpu", None)
    assert not core("cuda", False) and core("cpu", True)
    monkeypatch.delenv("KVPILOT_TUNING")
    with LLM(str(stories_model_dir), max_batch_size=2) as llm:  # CPU: off by default
        assert not llm._core.async_scheduling
        assert llm._executor.supports_async_scheduling


@pytest.mark.parametrize("kv_tokens", [None, 96], ids=["roomy", "preempting"])
def test_mixed_batch_matches_the_synchronous_engine(stories_model_dir, kv_tokens):
    llm = _hand_llm(stories_model_dir, kv_tokens)
    sched = llm._core.scheduler
    schedule, refused = sched.schedule, []

    def counting(preempt=True):
        out = schedule(preempt)
        refused.append(out is None)
        return out

    sched.schedule = counting
    try:
        (sync, sync_plans, sync_pre, sync_over), (asyn, asyn_plans, asyn_pre, asyn_over) = _both(llm, _MIX)
    finally:
        llm.shutdown()
    assert sync_over == 0 and asyn_over > len(asyn_plans) // 2  # most steps overlapped the last one
    if kv_tokens is not None:
        # Preemption happened in both modes; in the asynchronous one only after reading the
        # in-flight tokens (the schedule that would have preempted before that was refused).
        assert sync_pre > 0 and asyn_pre > 0 and any(refused)
    else:
        assert not any(refused)
    _assert_same(_MIX, sync, asyn)
    reasons = {(c[2], c[3]) for r in sync for c in r[0]}
    assert {("stop", "Lily"), ("stop", "park"), ("stop", " the"), ("stop", "."), ("length", None)} <= reasons
    assert ("stop", None) in reasons  # EOS
    assert {13, 263} & {c[3] for r in sync for c in r[0]}  # a stop token id
    # In-flight rows were planned with their input on the device, and sequences that ended were
    # computed one more (dropped) step.
    assert any(r >= 0 for plan in asyn_plans for _s, _p, r in plan)
    assert all(r == -1 for plan in sync_plans for _s, _p, r in plan)
    assert sum(map(len, asyn_plans)) > sum(map(len, sync_plans))


def test_penalties_and_bad_words_next_to_plain_requests(stories_model_dir):
    """The sampler of step N+1 is launched after step N's tokens are read: sampling that reads the
    token history needs no fallback, and matches the synchronous engine."""
    llm = _hand_llm(stories_model_dir)
    try:
        (sync, _, _, _), (asyn, _, _, over) = _both(llm, _PENALTIES)
        plain = _run(llm, [("Once upon a time", SamplingParams(temperature=0, max_tokens=20), False)], False)[0]
    finally:
        llm.shutdown()
    assert over > 0
    _assert_same(_PENALTIES, sync, asyn)
    assert plain[0][0][0][0] != sync[0][0][0][0]  # the penalty changed the text: it was applied


def test_streamed_chunks_are_the_same(stories_model_dir):
    mix = [(p, sp, True) for p, sp, _s in _MIX if not sp.use_beam_search and sp.num_candidates == sp.n]
    llm = _hand_llm(stories_model_dir)
    try:
        (sync, _, _, _), (asyn, _, _, over) = _both(llm, mix, copies=1)
    finally:
        llm.shutdown()
    assert over > 0
    for (p, sp, _s), a, b in zip(mix, sync, asyn):
        assert a[1] and a[1] == b[1], (p, sp)  # chunk by chunk: token ids and text of every delta


def test_abort_mid_generation(stories_model_dir):
    llm = _hand_llm(stories_model_dir)
    core = llm._core
    try:
        results = {}
        for mode in (False, True):
            core.async_scheduling = mode
            req = llm._make_request("", SamplingParams(temperature=0, max_tokens=60, stop=["park"]), True)
            other = llm._make_request("Once upon a time", SamplingParams(temperature=0, max_tokens=30), True)
            core.add_request(req)
            core.add_request(other)
            for _ in range(9):
                core.step()
                core.flush_outputs()
            if mode:  # the abort comes while the request's last token is on the device
                assert core._inflight is not None and req.seqs[0] in core._inflight.seqs
            core.abort_request(req.request_id)
            core.flush_outputs()
            streamed = [t for u in req.output._updates for d in u.deltas for t in d.new_token_ids]
            with pytest.raises(RequestAborted):
                req.output.result(timeout=0)
            _drain(core)
            results[mode] = (_choice(req.output), streamed, _choice(other.output.result(timeout=0)))
        assert core.num_overlapped_steps > 0 and core.kv.num_used_blocks == 0
    finally:
        llm.shutdown()
    assert results[True] == results[False]
    (token_ids, text, reason, *_), = results[True][0]
    assert reason == "abort" and len(token_ids) == 9 and results[True][1] == token_ids
    assert GOLDEN.startswith(text) and text


def test_fail_all_delivers_the_in_flight_tokens(stories_model_dir):
    llm = _hand_llm(stories_model_dir)
    core = llm._core
    try:
        req = llm._make_request("", SamplingParams(temperature=0, max_tokens=80, ignore_eos=True), True)
        core.add_request(req)
        for _ in range(5):
            core.step()
            core.flush_outputs()
        assert core._inflight is not None and len(req.seqs[0].output_token_ids) == 4
        core.fail_all(RuntimeError("boom"))
        core.flush_outputs()
        ups = list(req.output._updates)
        sent = [t for u in ups for d in u.deltas for t in d.new_token_ids]
        assert sent == req.seqs[0].output_token_ids and len(sent) == 5
        assert ups[-1].finished and ups[-1].error is not None
        assert core._inflight is None and not core.has_work and core.kv.num_used_blocks == 0
    finally:
        llm.shutdown()


def test_prefix_cache_after_async_runs(stories_model_dir):
    """Blocks cached during async steps hold exactly the sequence's tokens (no placeholder is ever
    hashed), and a later prompt that continues that text reuses them, output unchanged."""
    llm = LLM(str(stories_model_dir), max_batch_size=6, max_num_tokens=64,
              kv_cache_config=KvCacheConfig(tokens_per_block=4))
    llm._loop.stop()
    core = llm._core
    try:
        sp = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
        req = llm._make_request("Once upon a time", sp, False)
        core.add_request(req)
        seq = req.seqs[0]
        checked = 0
        while core.has_work:
            core.step()
            for i, bid in enumerate(seq.block_table[:seq.num_cached_blocks]):
                assert core.kv.blocks[bid].token_ids == tuple(seq.token_ids[4 * i:4 * i + 4])
                checked += 1
        core.flush_outputs()
        assert core.num_overlapped_steps > 0 and checked > 100
        full = req.prompt_token_ids + req.output.result(timeout=0).outputs[0].token_ids
        results = {}
        for mode in (False, True):
            core.async_scheduling = mode
            hits = core.kv.stats.hits
            again = llm._make_request(full[:-1], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), False)
            core.add_request(again)
            _drain(core)
            results[mode] = again.output.result(timeout=0).outputs[0].token_ids
            assert core.kv.stats.hits - hits >= len(full) - 5  # every full block came from the cache
    finally:
        llm.shutdown()
    assert results[True] == results[False] and results[True][0] == full[-1]


def _redrawn_positions(plans) -> int:
    """Positions computed twice for the same sequence (each rolled-back row is one)."""
    seen = [(s, p) for plan in plans for s, p, _r in plan]
    return len(seen) - len(set(seen))


def test_redrawn_rows_are_rolled_back(stories_model_dir, monkeypatch):
    llm = _hand_llm(stories_model_dir)
    try:
        (want, _, _, _) = _run(llm, _FILTERED, False)  # no -1 rows at all
        _minus_ones(monkeypatch)
        exact_rows = llm._core.sampler.exact_rows
        (sync, sync_plans, _, _), (asyn, asyn_plans, _, over) = _both(llm, _FILTERED)
        assert llm._core.sampler.exact_rows > exact_rows
    finally:
        llm.shutdown()
    assert over > 0
    assert _redrawn_positions(sync_plans) == 0 and _redrawn_positions(asyn_plans) > 0
    _assert_same(_FILTERED, want, sync)
    _assert_same(_FILTERED, want, asyn)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("async_tiny") / "m", seed=3)


def _tiny_with_cpu_graphs(path):
    """The tiny random Llama with the CUDA-graph sets' CPU doubles: decode steps replay into a
    static logits buffer that the next replay overwrites, as on a GPU."""
    from support.graphs import cpu_graph_class
    from kvpilot.runner.cuda_graphs import DecodeGraphs, PrefillGraphs, capture_all

    llm = LLM(str(path), skip_tokenizer_init=True, device="cpu", max_batch_size=6, max_num_tokens=64,
              max_seq_len=256, kv_cache_config=KvCacheConfig(tokens_per_block=8, max_tokens=2048))
    llm._loop.stop()
    runner = llm._executor
    runner.graphs, runner.prefill_graphs = capture_all(runner, decode_cls=cpu_graph_class(DecodeGraphs),
                                                       prefill_cls=cpu_graph_class(PrefillGraphs))
    assert runner.graphs is not None and runner.prefill_graphs is not None
    fixed = {"decode": 0, "prefill": 0}
    for name, g in (("decode", runner.graphs), ("prefill", runner.prefill_graphs)):
        def run(seqs, fix_inputs=None, _run=g.run, _name=name):
            fixed[_name] += fix_inputs is not None
            return _run(seqs, fix_inputs=fix_inputs)
        g.run = run
    return llm, fixed


_TINY = [
    ([1, 20, 30, 40, 50], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True), False),
    ([1, 7], SamplingParams(temperature=0.9, seed=3, max_tokens=26, top_p=0.8, logprobs=1), True),
    ([1] + list(range(100, 140)), SamplingParams(temperature=1.0, seed=4, max_tokens=20, top_k=5), False),
    ([1, 9, 9], SamplingParams(n=2, temperature=1.0, seed=6, max_tokens=40, stop_token_ids=[194, 101]), True),
    ([1, 300], SamplingParams(temperature=0.7, seed=1, max_tokens=35, min_p=0.05), False),
    ([1] + list(range(3, 93)), SamplingParams(temperature=0, max_tokens=10), True),  # chunked prefill
]


@pytest.mark.parametrize("redraw", [False, True], ids=["device-draws", "redrawn-rows"])
def test_tiny_llama_with_graph_steps_matches_the_synchronous_engine(tiny_dir, redraw, monkeypatch):
    llm, fixed = _tiny_with_cpu_graphs(tiny_dir)
    try:
        (want, _, _, _) = _run(llm, _TINY, False, 2)
        if redraw:
            _minus_ones(monkeypatch)
        (sync, sync_plans, _, _), (asyn, asyn_plans, _, over) = _both(llm, _TINY, 2)
    finally:
        llm.shutdown()
    assert over > 0 and fixed["decode"] > 0 and fixed["prefill"] > 0  # both graph kinds got in-flight ids
    assert (_redrawn_positions(asyn_plans) > 0) == redraw
    _assert_same(_TINY, want, sync, 2)
    _assert_same(_TINY, want, asyn, 2)
    assert {c[3] for r in want for c in r[0]} >= {194, 101}  # stop token ids ended both choices
    assert ("stop", None) in {(c[2], c[3]) for r in want for c in r[0]}  # and EOS another request


def test_detach_keeps_the_rows_finish_reads(monkeypatch):
    """`_Pending.detach`: the logits may be overwritten before `finish` (the next graph replay)."""
    _minus_ones(monkeypatch)
    torch.manual_seed(0)
    logits = torch.randn(5, 300) * 3
    rows = [SamplingRow(temperature=0.8, top_p=0.9, seed=1, logprobs=2),
            SamplingRow(temperature=0.0), SamplingRow(temperature=1.0, seed=2),
            SamplingRow(temperature=1.0, top_k=7, seed=3, logprobs=1, repetition_penalty=1.2, output_token_ids=[4]),
            SamplingRow(temperature=0.5, min_p=0.2, seed=4)]
    want = Sampler(backend="torch")(logits.clone(), rows)
    for r in rows:
        r._counts = None  # recount penalties from scratch in the second call
    got = {}
    for detach in (True, False):
        for r in rows:
            r._counts = None
        buf = logits.clone()
        h = Sampler(backend="torch").launch(buf, rows)
        if detach:
            h.detach()
        buf.normal_()  # what the next step's replay does to a static logits buffer
        got[detach] = h.finish()
        assert len(h.redrawn) == 2 and set(h.redrawn.tolist()) <= {0, 3, 4}  # the filtered rows
    assert got[True].token_ids == want.token_ids
    assert _close(got[True].logprobs, want.logprobs) and _close(got[True].top_logprobs, want.top_logprobs)
    assert not _close(got[False].logprobs, want.logprobs)  # without it, `finish` reads the new values


class _NoAsync:
    """An executor without ``supports_async_scheduling`` (like the tensor/pipeline-parallel one)."""

    def __init__(self, executor) -> None:
        self.executor = executor

    def __getattr__(self, name):
        if name == "supports_async_scheduling":
            raise AttributeError(name)
        return getattr(self.executor, name)


def test_executor_without_the_capability_stays_synchronous(stories_model_dir):
    llm = _hand_llm(stories_model_dir)
    core = llm._core
    try:
        core.executor = _NoAsync(core.executor)
        (out, plans, _, over) = _run(llm, _MIX[:4], True)
        assert over == 0 and all(r == -1 for plan in plans for _s, _p, r in plan)
    finally:
        core.executor = core.executor.executor
        llm.shutdown()


def test_a_row_the_sampler_rejects_fails_only_its_request(stories_model_dir):
    llm = _hand_llm(stories_model_dir)
    core = llm._core
    real = core.sampler

    class Picky:  # a split sampler that rejects one request's row at launch
        def __call__(self, logits, rows):
            return self.launch(logits, rows).finish()

        def launch(self, logits, rows):
            if any(r.seed == 777 for r in rows):
                raise OverflowError("a parameter the sampler cannot hold")
            return real.launch(logits, rows)

    try:
        sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        want = _run(llm, [("Once upon a time", sp, False)], False)[0][0][0]
        core.async_scheduling = True
        core.sampler = Picky()
        victim = llm._make_request("Once upon a time", sp, False)
        core.add_request(victim)
        for _ in range(5):
            core.step()
        bad = llm._make_request("Tom", SamplingParams(temperature=1.0, seed=777, max_tokens=4), False)
        core.add_request(bad)
        _drain(core)
        assert core.num_overlapped_steps > 0
        with pytest.raises(Exception, match="sampling failed"):
            bad.output.result(timeout=0)
        assert _choice(victim.output.result(timeout=0))[0][:4] == want[0][:4]
        assert core.kv.num_used_blocks == 0
    finally:
        core.sampler = real
        llm.shutdown()


def _seq(req_id: int, prompt: int, out: int, kv: KVCacheManager, max_tokens: int) -> Sequence:
    from kvpilot.outputs import RequestOutput

    params = SamplingParams(max_tokens=max_tokens)
    req = Request(req_id, list(range(prompt)), params, RequestOutput(req_id, None, list(range(prompt)), 1, False))
    seq = Sequence(request=req, index=0, token_ids=list(range(prompt + out)), seed=0)
    seq.length_limit = prompt + max_tokens
    req.seqs.append(seq)
    kv.allocate(seq, prompt + out)
    seq.num_computed_tokens = prompt + out
    seq.status = SequenceStatus.RUNNING
    return seq


def test_scheduler_counts_in_flight_tokens_and_never_preempts_for_them():
    kv = KVCacheManager(num_blocks=6, tokens_per_block=4, enable_block_reuse=False)
    sched = Scheduler(kv, max_num_tokens=64, max_batch_size=8)
    a = _seq(0, 4, 0, kv, max_tokens=9)  # one full block: its in-flight token needs a new one
    b = _seq(1, 5, 0, kv, max_tokens=1)  # its in-flight token is its last
    c = _seq(2, 6, 1, kv, max_tokens=9)  # 7 tokens, all computed: nothing to do without one in flight
    sched._running = [a, b, c]
    for s in (a, b, c):
        s.inflight_row = 0
    out = sched.schedule(preempt=False)
    assert [(s.seq_id, n) for s, n in out.scheduled] == [(a.seq_id, 1), (c.seq_id, 1)]
    assert len(a.block_table) == 2 and kv.num_free_blocks == 0
    # The next in-flight token of `a` and `c` needs one more block each: no preemption without leave.
    a.num_computed_tokens = c.num_computed_tokens = 8
    a.token_ids.extend([9, 9, 9, 9])
    c.token_ids.append(9)
    assert sched.schedule(preempt=False) is None and sched.num_preemptions == 0
    assert sched.schedule().preempted and sched.num_preemptions > 0


# ---- on the GPU (real CUDA graphs, the Triton sampler) ----------------------------------------------
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("redraw", [False, True], ids=["device-draws", "redrawn-rows"])
def test_gpu_async_scheduling_matches_the_synchronous_engine(tiny_dir, redraw, monkeypatch):
    """Greedy and seeded filtered sampling on CUDA with decode and prefill graphs: the async engine
    gives the synchronous engine's tokens; ``redraw`` makes the Triton sampler leave every other
    filtered row to the exact path (-1 on the device), so in-flight inputs are wrong and rolled back,
    and the redraw reads logits the next graph replay has overwritten (kept by ``detach``)."""
    from kvpilot.kernels import sampling as ksampling

    with LLM(str(tiny_dir), skip_tokenizer_init=True, device="cuda", dtype="float32", max_batch_size=6,
             max_num_tokens=64, max_seq_len=256,
             kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=4096)) as llm:
        llm._loop.stop()
        runner = llm._executor
        assert runner.graphs is not None and runner.prefill_graphs is not None
        want = _run(llm, _TINY, False, 2)[0]
        if redraw:
            orig = ksampling.draw

            def draw(logits, fprm, iprm, plain_rows, filt_rows, *a, **kw):
                out = orig(logits, fprm, iprm, plain_rows, filt_rows, *a, **kw)
                out[filt_rows[::2].long()] = -1
                return out

            monkeypatch.setattr(ksampling, "draw", draw)
        (sync, _, _, _), (asyn, asyn_plans, _, over) = _both(llm, _TINY, 2)
    assert over > 0 and (_redrawn_positions(asyn_plans) > 0) == redraw
    _assert_same(_TINY, want, sync, 2)
    _assert_same(_TINY, want, asyn, 2)


@pytest.mark.gpu
@needs_gpu
def test_gpu_detached_read_waits_only_for_its_own_work():
    """After ``detach`` the read does not wait for device work queued later (the next step's
    forward pass), and the logits may be overwritten meanwhile."""
    import time

    torch.manual_seed(0)
    logits = torch.randn(64, 32000, device="cuda") * 4
    rows = [SamplingRow(temperature=0.0 if i % 3 == 0 else 1.0, seed=i, logprobs=2 if i % 2 else None)
            for i in range(64)]
    sampler = Sampler()
    want = sampler(logits.clone(), rows)
    h = sampler.launch(logits, rows)
    h.detach()
    logits.normal_()
    torch.cuda._sleep(4_000_000_000)  # about two seconds of GPU time, queued after the call
    t0 = time.perf_counter()
    got = h.finish()
    waited = time.perf_counter() - t0
    torch.cuda.synchronize()
    assert got.token_ids == want.token_ids
    assert _close(got.logprobs, want.logprobs) and _close(got.top_logprobs, want.top_logprobs)
    assert waited < 0.5, waited
