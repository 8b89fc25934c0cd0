"""The tensor-parallel output rank draws sampled tokens itself (``SYNC_SELF`` with `Worker.own_step`'s
sampler, `RowEncoder` / `RowDecoder`, ``Tuning.tp_rank_sampling``).

Everything runs on CPU (gloo, TP 2) with ``Tuning(async_scheduling=True)``; tokens are compared with one
process's (TP 1), which the same seeds must reproduce bit for bit.

- docs/parallelism.md's ``SYNC_SELF`` item and docs/tuning.md describe the sampled own steps and
  ``Tuning.tp_rank_sampling``.
- ``SYNC_GO`` steps (a plan waiting for the front end's ids: requests with ``logprobs=0``) keep their
  coverage next to the same cases for the output rank's own draws: the step-timing race, a deferred
  step left with nothing to sample, a killed worker.
- The output rank's candidate path really hands rows to the exact draw (-1 in the ids buffer, which
  ``SYNC_SELF`` steps read): a 4096-token vocabulary with flat distributions.
- Bit-identity with TP 1 under arrivals and aborts mid-flight, n > 1, stop strings, stop ids, EOS,
  ``max_tokens=1``, chunked prefill, prefix hits, preemption by recompute, logprobs / penalty /
  best_of requests switching steps to the front end and back; the record cache across sequence ids,
  record changes and steps the output rank did not sample; a sampler that fails in the output rank's
  read (a clear error with its traceback, no hang, no worker left); a rank killed while the output
  rank samples."""

from __future__ import annotations

import functools
import os
import re
import time

import pytest
from support.engine import make_tiny_llama
from support.parallel import _FrontEndDraws
from support.tp_async import _build, _script, _shutdown

from kvpilot import LLM, EngineDeadError, KvCacheConfig, SamplingParams
from kvpilot.outputs import RequestError
from kvpilot.parallel.worker import RowDecoder, RowEncoder
from kvpilot.sampling.sampler_inputs import SamplingRow
from support.paths import REPO

pytestmark = pytest.mark.timeout(300)

ROOT = REPO
_LONG = "Once upon a time there was a little girl named Lily. " * 9  # ~120 tokens: prefill in chunks


def _sp(m: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=m, seed=seed, **{"temperature": 0.8, **kw})


# ---- steps the front end samples, rows drawn again -----------------------------------------------

def test_docs_describe_sampled_own_steps_and_the_switch():
    """docs/parallelism.md's ``SYNC_SELF`` item covers the sampled steps and the switch, and every
    name it cites exists; the README lists the switch with the others."""
    from kvpilot.core import engine_core
    from kvpilot.parallel.worker import Worker

    doc = (ROOT / "docs" / "parallelism.md").read_text()
    item = doc[doc.index("- `SYNC_SELF`"):doc.index("- `SYNC_GO`")]
    for words in ("tp_rank_sampling", "top-p", "seed", "Sampler", "-1"):
        assert words in item, words
    cited = re.findall(r"`(Worker|engine_core)\.(\w+)`", item)
    assert ("Worker", "own_step") in cited and ("engine_core", "_rank_samplable") in cited
    for owner, name in cited:
        assert hasattr(Worker if owner == "Worker" else engine_core, name), (owner, name)
    assert "argmax_step" not in doc
    tuning_doc = (ROOT / "docs" / "tuning.md").read_text()
    assert "| `tp_rank_sampling` | True | the front end draws sampled steps instead of the output rank |" in tuning_doc


@pytest.fixture(scope="module")
def go_llm(stories_model_dir):
    llm = _build(stories_model_dir)
    llm._loop.stop()
    yield llm
    _shutdown(llm)


@pytest.mark.parametrize("who", ["front_end", "output_rank"])
def test_a_deferred_step_left_with_nothing_to_sample(go_llm, who):
    """test_tp_async_steps.py's ``sampled_stop_id`` case, on both paths: a seeded request
    whose stop id ends it while the next step is already planned (that step keeps no row and must
    still be awaited, as `await_logits` or `await_ids`), then more requests on the same engine."""
    llm = go_llm
    ex = llm._executor
    extra = {"logprobs": 0} if who == "front_end" else {}
    events = {0: [("add", "a", "She was sad", _sp(40, 2, temperature=0.5, stop_token_ids=[13, 263, 426], **extra))],
              40: [("add", "b", "Once upon a time", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))],
              60: [("add", "c", "The little dog", _sp(10, 4, ignore_eos=True, **extra))]}
    sync, _ = _script(llm, events, False)
    assert sync["a"][0][2] == "stop"
    drawn = ex.num_rank_sampled_steps
    asyn, over = _script(llm, events, True)
    assert asyn == sync and over > 10
    assert (ex.num_rank_sampled_steps > drawn + 10) == (who == "output_rank")


def test_sync_go_steps_with_step_timing_from_another_thread(stories_model_dir, go_llm, monkeypatch):
    """test_tp_async_steps.py's step-timing test (`generate` on the engine thread while another thread
    asks for step timing) with its seeded requests on ``SYNC_GO`` steps: with ``logprobs=0`` the front
    end samples every step."""
    import test_tp_async_steps as s9

    built, real_build = [], s9._build

    def build(*args, **kw):
        built.append(real_build(*args, **kw))
        return built[-1]

    monkeypatch.setattr(s9, "_s", functools.partial(s9._s, logprobs=0))
    monkeypatch.setattr(s9, "_build", build)
    s9.test_generate_through_the_loop_with_step_timing_from_another_thread(stories_model_dir, go_llm, "sampled")
    ex = built[0]._executor
    assert ex.num_rank_sampled_steps == 0 and ex.num_self_steps == 0


@pytest.fixture(scope="module")
def flat_model(tmp_path_factory):
    """A random Llama with a 4096-token vocabulary: at high temperatures its distributions are flat
    enough that the best 1024 candidates often miss top-p's mass (the exact draw takes the row)."""
    return make_tiny_llama(tmp_path_factory.mktemp("flat4096"), seed=5, vocab=4096, layers=2)


def _flat_items() -> list:
    import random

    r = random.Random(0)
    items = []
    for i in range(10):
        prompt = [1] + [r.randrange(3, 4096) for _ in range(r.randrange(1, 40))]
        sp = [SamplingParams(temperature=3.0, top_p=0.995, seed=100 + i, max_tokens=16, ignore_eos=True),
              SamplingParams(temperature=2.0, min_p=0.001, top_p=0.999, seed=100 + i, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=1500, seed=100 + i, max_tokens=12, ignore_eos=True, n=2),
              SamplingParams(temperature=0.7, seed=100 + i, max_tokens=14, ignore_eos=True)][i % 4]
        items.append((prompt, sp))
    return items


def test_rows_the_output_rank_draws_again_for_real(flat_model, monkeypatch):
    """The output rank's candidate path leaves rows to the exact draw (-1 in its ids buffer), some
    read at once by ``SYNC_SELF`` steps; those sequences compute that position again and every
    token is one process's."""
    items = _flat_items()
    kw = dict(skip_tokenizer_init=True, device="cpu", max_batch_size=8, max_num_tokens=48,
              kv_cache_config=KvCacheConfig(tokens_per_block=8))
    with LLM(str(flat_model), **kw) as one:
        want = [[c.token_ids for c in o.outputs]
                for o in one.generate([p for p, _ in items], [sp for _, sp in items], use_tqdm=False)]
    monkeypatch.setenv("KVPILOT_TUNING", '{"async_scheduling": true}')
    llm = LLM(str(flat_model), tensor_parallel_size=2, **kw)
    try:
        llm._loop.stop()
        ex, core = llm._executor, llm._core
        front = core.sampler = _FrontEndDraws(core.sampler)
        steps: list = []  # per execute: (a SYNC_SELF step, its in-flight (seq, position)s, its others)
        real_execute = ex.execute

        def execute(plan):
            selfs = ex.num_self_steps
            out = real_execute(plan)
            steps.append((ex.num_self_steps > selfs, {(p.seq_id, p.start_pos) for p in plan if p.inflight_row >= 0},
                          {(p.seq_id, p.start_pos) for p in plan if p.inflight_row < 0}))
            return out

        monkeypatch.setattr(ex, "execute", execute)
        got, _ = _script(llm, {2 * k: [("add", k, p, sp)] for k, (p, sp) in enumerate(items)}, True)
        assert [[c[0] for c in got[k]] for k in range(len(items))] == want
        assert front.rows == 0 and ex.num_rank_sampled_steps > 40 and ex.num_rank_redrawn_rows > 20
        # A position a SYNC_SELF step computed from the output rank's -1 is computed again later.
        again = [pos for i, (is_self, inflight, _) in enumerate(steps) if is_self
                 for pos in inflight if any(pos in later for _, _, later in steps[i + 1:])]
        assert again
    finally:
        _shutdown(llm)


# ---- bit-identity with one process ---------------------------------------------------------------

# Before step i: ("add", key, prompt, params) / ("abort", key). A small pool (12 blocks of 16) makes
# the two long prompts and the others preempt each other; "lp", "pen" and "bo" need the front end's
# sampler while they live (SYNC_GO steps), the rest the output rank's.
_MIX = {
    0: [("add", "a", "Once upon a time", _sp(30, 1, top_p=0.9, ignore_eos=True)),
        ("add", "b", "The little dog", _sp(20, 2, temperature=1.0, top_k=20, n=2, ignore_eos=True)),
        ("add", "c", "Tom and Sue", _sp(25, 3, min_p=0.1, stop=["."]))],
    2: [("add", "d", "One day", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)),
        ("add", "e", "", _sp(1, 5, temperature=1.2))],
    4: [("add", "f", _LONG, _sp(10, 8, temperature=0.9, top_p=0.95, ignore_eos=True)),
        ("add", "g", "She was sad", _sp(40, 2, temperature=0.5, stop_token_ids=[13, 263, 426])),
        ("add", "eos", "The dog", _sp(30, 13, end_id=426))],
    6: [("abort", "a")],
    8: [("add", "lp", "Lily", _sp(10, 6, ignore_eos=True, logprobs=1))],
    10: [("add", "i", _LONG + "She", _sp(8, 10, temperature=1.0, ignore_eos=True))],
    14: [("add", "pen", "A cat", _sp(5, 7, ignore_eos=True, frequency_penalty=0.5))],
    16: [("abort", "b")],
    20: [("add", "bo", "Bob", _sp(8, 11, n=2, best_of=3, ignore_eos=True))],
    24: [("add", "l", "Sam", _sp(30, 12, temperature=1.5, ignore_eos=True)),
         ("add", "m", "She was sad", _sp(16, 4, temperature=0.7, top_k=30, top_p=0.8, n=3, ignore_eos=True))],
    36: [("abort", "m")],
}


def test_a_mixed_run_with_arrivals_aborts_and_preemption_is_one_process(stories_model_dir):
    adds = [ev for evs in _MIX.values() for ev in evs if ev[0] == "add"]
    with LLM(str(stories_model_dir), device="cpu", max_batch_size=6, max_num_tokens=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=16)) as one:
        outs = one.generate([ev[2] for ev in adds], [ev[3] for ev in adds], use_tqdm=False)
    want = {ev[1]: [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for ev, o in zip(adds, outs)}
    llm = _build(stories_model_dir, kv_tokens=192)
    try:
        llm._loop.stop()
        core, ex = llm._core, llm._executor
        front = core.sampler = _FrontEndDraws(core.sampler)
        got, over = _script(llm, _MIX, True)
        aborted = {ev[1] for evs in _MIX.values() for ev in evs if ev[0] == "abort"}
        for key, choices in got.items():
            if key in aborted:
                tag, partial = choices
                assert tag == "RequestAborted" and any(t for t, _ in partial)
                for (toks, _), ref in zip(partial, want[key]):
                    assert toks == ref[0][:len(toks)] and len(toks) < len(ref[0])
            else:
                assert choices == want[key], key
        # Ends by length, a stop string, a stop id and the end id (EOS).
        reasons = {(c[2], type(c[3])) for key in got if key not in aborted for c in got[key]}
        assert reasons == {("length", type(None)), ("stop", str), ("stop", int), ("stop", type(None))}
        assert core.scheduler.num_preemptions > 0 and core.kv.stats.reused_blocks > 0 and over > 30
        assert ex.num_rank_sampled_steps > 20 and ex.num_self_steps > 10 and front.rows > 20
    finally:
        _shutdown(llm)


def test_the_record_cache_never_sends_a_stale_record():
    """`RowEncoder` / `RowDecoder`: a sequence whose record changed (or a new sequence under an old
    id) gets the new record; sequences absent from the last sampled step are sent again; steps the
    output rank did not sample leave both ends as they were."""
    a = SamplingRow(temperature=0.8, top_p=0.9, seed=1)
    b = SamplingRow(temperature=1.3, top_k=7, seed=1)
    enc, dec = RowEncoder(), RowDecoder()
    rows = dec.decode(enc.encode([(5, 0, a.record()), (6, 0, a.record())]))
    assert [r.record() for r in rows] == [a.record(), a.record()]
    step = enc.encode([(5, 1, b.record()), (6, 1, SamplingRow(temperature=0.8, top_p=0.9, seed=1).record())])
    assert step == [(5, 1, b.record()), (6, 1, None)]  # an equal record is not sent again
    rows = dec.decode(step)
    assert rows[0].record() == b.record() and rows[1].record() == a.record() and [r.step for r in rows] == [1, 1]
    step = enc.encode([(6, 2, a.record())])  # 5 leaves
    dec.decode(step)
    assert enc.encode([(5, 9, b.record())]) == [(5, 9, b.record())]  # back after a gap: sent again


def test_a_sampler_failing_in_the_output_ranks_read_stops_the_engine(stories_model_dir, tmp_path, monkeypatch):
    """`_Pending.finish` raising on the output rank (in `Worker.flush_ids`, after the step was
    answered): `generate` fails within seconds with the worker's traceback, later calls fail at once
    and no worker is left. Injected through a ``sitecustomize`` the spawned workers import."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('R11B_FAIL_READ'):\n"
        "    import kvpilot.sampling.sampler as s\n"
        "    real, calls = s._Pending.finish, [0]\n"
        "    def finish(self):\n"
        "        calls[0] += 1\n"
        "        if calls[0] >= int(os.environ['R11B_FAIL_READ']):\n"
        "            raise RuntimeError('injected sampler read failure')\n"
        "        return real(self)\n"
        "    s._Pending.finish = finish\n")
    # No empty entry: that would put the current directory (the repository's operator/) on the path.
    paths = [str(tmp_path)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
    llm = _build(stories_model_dir, env={"R11B_FAIL_READ": "6"})
    try:
        t0 = time.monotonic()
        with pytest.raises((EngineDeadError, RequestError), match=r"(?s)rank 0 failed:.*Traceback.*injected"):
            llm.generate(["Once upon a time", "The dog"], _sp(40, 1, top_p=0.9, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - t0 < 30 and llm._executor.num_rank_sampled_steps >= 6
        with pytest.raises(EngineDeadError):
            llm.generate("Once", SamplingParams(max_tokens=2), use_tqdm=False)
        assert not any(p.is_alive() for p in llm._executor._procs)
    finally:
        _shutdown(llm)


@pytest.mark.slow  # about 10 s each on 2 cores
@pytest.mark.parametrize("rank,go", [(0, False), (1, True)], ids=["rank0-own", "rank1-go"])
def test_a_worker_killed_while_tokens_are_drawn(stories_model_dir, monkeypatch, rank, go):
    """test_tp_async_steps.py's killed-worker test on both paths: the output rank killed while it draws
    the tokens (``SYNC_SELF``), rank 1 killed while plans wait for the front end's (``SYNC_GO``,
    ``logprobs=0``): `generate` fails within seconds and no worker is left."""
    import test_tp_async_steps as s9

    built, real_build = [], s9._build

    def build(*args, **kw):
        built.append(real_build(*args, **kw))
        return built[-1]

    # test_tp_async_steps asks for logprobs=0 (the front end draws: SYNC_GO); the output rank draws
    # itself (SYNC_SELF) only without logprobs.
    real_s = s9._s
    monkeypatch.setattr(s9, "_s", lambda m, seed=1, **kw: real_s(m, seed, **dict(kw, logprobs=0 if go else None)))
    monkeypatch.setattr(s9, "_build", build)
    s9.test_a_worker_killed_mid_generation(stories_model_dir, rank, False)
    assert (built[0]._executor.num_rank_sampled_steps > 0) != go
