"""``benchmarks/lab/gpu_tp_profile.py --sampled``: the sampled path is warmed up before it is timed (the
sampling kernels compile on their first call, which the greedy warm-up never makes), and exact-path
rows are counted over the timed runs only. A stand-in `LLM` records the calls."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from types import SimpleNamespace

from support.paths import REPO

ROOT = REPO


# ---- benchmarks/lab/gpu_tp_profile.py --sampled ----------------------------------------------------------

def _load_profile():
    spec = importlib.util.spec_from_file_location("gpu_tp_profile_under_test",
                                                  ROOT / "benchmarks" / "lab" / "gpu_tp_profile.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _StandInLLM:
    """Records `generate` and `step_timing` calls in order; its sampler counts one exact-path row per
    sampled request, starting from earlier requests' count."""

    def __init__(self, *args, flip_second_timed: bool = False, **kwargs) -> None:
        self.events: list = []
        self._core = SimpleNamespace(sampler=SimpleNamespace(exact_rows=5))
        self._executor = SimpleNamespace(step_timing=self._step_timing)
        self.flip = flip_second_timed
        self.sampled_calls = 0

    def _step_timing(self, reset: bool = False) -> dict:
        self.events.append(("timing", reset))
        return {"front_end": {}, "ranks": {}}

    def generate(self, prompts, params, use_tqdm: bool = True):
        sampled = params.temperature > 0
        self.events.append(("sampled" if sampled else "greedy", params.max_tokens))
        ids = list(range(10, 10 + params.max_tokens))
        if sampled:
            self._core.sampler.exact_rows += 1
            self.sampled_calls += 1
            if self.flip and self.sampled_calls == 4:  # the second timed 1+N run
                ids[-1] += 1
        lp = [{t: SimpleNamespace(logprob=-0.1), t + 1: SimpleNamespace(logprob=-2.0)} for t in ids]
        one = SimpleNamespace(outputs=[SimpleNamespace(token_ids=ids, logprobs=lp)])
        return [one for _ in prompts] if prompts and isinstance(prompts[0], list) else one

    def shutdown(self) -> None:
        pass


def _run_sampled(monkeypatch, **llm_kwargs):
    import kvpilot

    made = []

    def factory(*args, **kwargs):
        made.append(_StandInLLM(*args, **llm_kwargs, **kwargs))
        return made[-1]

    monkeypatch.setattr(kvpilot, "LLM", factory)
    prof = _load_profile()
    a = argparse.Namespace(max_seq_len=128, max_batch_size=2, device="cpu", greedy_len=3, itl_tokens=4,
                           sampled=True)
    res = prof.run_layout(Path("/nonexistent"), 2, 1, a, [[5, 6, 7], [8, 9]])
    return res, made[0]


def test_sampled_itl_is_timed_after_a_sampled_warm_up(monkeypatch):
    res, llm = _run_sampled(monkeypatch)
    last_reset = max(i for i, e in enumerate(llm.events) if e == ("timing", True))
    timed = [e for e in llm.events[last_reset:] if e[0] == "sampled"]
    assert timed == [("sampled", 5), ("sampled", 1)] * 3  # exactly the three timed pairs
    # the first sampled request (kernel compilation) was one of the timed ones.
    before = [e for e in llm.events[:last_reset] if e[0] == "sampled"]
    assert before == [("sampled", 5)], llm.events
    # Exact-path rows of the six timed requests, not the sampler's count since start-up (5 + 7).
    assert res["sampler_exact_rows"] == len(timed) == 6
    assert res["sampled_repeatable"] is True
    assert len(res["itl_sampled_ms_all"]) == 3


def test_sampled_runs_that_draw_different_tokens_are_reported(monkeypatch):
    res, _ = _run_sampled(monkeypatch, flip_second_timed=True)
    assert res["sampled_repeatable"] is False
