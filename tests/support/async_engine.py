"""Helpers of the asynchronous output / scheduling tests: comparable forms of choices and streams,
the mixed workloads both engines run, and draining an engine."""

from __future__ import annotations

from kvpilot import SamplingParams
from kvpilot.sampling.sampler import Sampler


def _choice(out) -> tuple:
    """Everything a choice returns, in comparable form."""
    return [(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.cumulative_logprob,
             [{t: (lp.logprob, lp.rank, lp.decoded_token) for t, lp in e.items()} for e in o.logprobs])
            for o in out.outputs]


def _close(a, b, tol=1e-4) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= tol
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_close(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_close(a[k], b[k], tol) for k in a)
    return a == b


def _drain(core) -> None:
    while core.has_work:
        core.step()
        core.flush_outputs()


def _assert_same(mix, sync, asyn, copies: int = 1) -> None:
    for (p, sp, _s), a, b in zip(mix * copies, sync, asyn):
        assert [c[:4] for c in a[0]] == [c[:4] for c in b[0]], (p, sp)  # tokens, text, reasons exactly
        assert _close(a[0], b[0]) and _close(a[2], b[2]), (p, sp)  # log-probabilities, generation logits
        assert _streams(a[1]) == _streams(b[1]), (p, sp)


# Requests that end at different steps: max_tokens, EOS, stop token ids, stop strings; greedy and
# seeded draws (plain, top-k, top-p, min-p), n > 1, best_of, logprobs, generation logits, beams.
_MIX = [
    ("Once upon a time", SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=12), True),
    ("Once upon a time", SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=14, top_k=20), False),
    ("The little dog", SamplingParams(temperature=0.7, seed=11, max_tokens=16, logprobs=3, top_p=0.9), True),
    ("The little dog", SamplingParams(temperature=0, max_tokens=8, logprobs=0, prompt_logprobs=2), False),
    ("Tom and Sue", SamplingParams(n=1, best_of=2, temperature=0.9, seed=5, max_tokens=10, min_p=0.05), False),
    ("She was sad", SamplingParams(temperature=0, max_tokens=3), True),
    ("She was sad", SamplingParams(temperature=0.5, seed=2, max_tokens=30, stop_token_ids=[13, 263]), False),
    ("", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, return_generation_logits=True), True),
    ("One day", SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0, max_tokens=6), False),
    ("", SamplingParams(temperature=0, max_tokens=30, stop=["Lily"]), True),
    ("", SamplingParams(temperature=0, max_tokens=40, stop=["park", "ball"], include_stop_str_in_output=True), False),
    ("Once upon a time", SamplingParams(temperature=0.8, seed=7, max_tokens=25, stop=[" the"]), True),
    ("Tom and Sue", SamplingParams(temperature=0, max_tokens=30, min_tokens=6, stop=["."]), True),
    ("She was sad", SamplingParams(temperature=0, max_tokens=30, end_id=426), True),  # EOS: the first "."
]


# Sampling that reads the token history (penalties, bad words) next to plain requests.
_PENALTIES = [
    ("Once upon a time", SamplingParams(temperature=0, max_tokens=20, repetition_penalty=2.0), True),
    ("Once upon a time", SamplingParams(temperature=0.9, seed=4, max_tokens=20, frequency_penalty=0.8,
                                        presence_penalty=0.4, logprobs=2), False),
    ("The little dog", SamplingParams(temperature=0, max_tokens=20, bad_words=["the", "ran"]), True),
    ("The little dog", SamplingParams(temperature=0.7, seed=8, max_tokens=20, top_p=0.8), False),
    ("Tom", SamplingParams(temperature=0, max_tokens=25, logit_bias={13: -5.0}, min_tokens=5), True),
]


def _minus_ones(monkeypatch) -> None:
    """The PyTorch sampler's fast path leaves every other filtered row to the exact draw (-1)."""
    orig = Sampler._filtered

    def filtered(x, fprm, iprm, keys, sel, ks, exact):
        out = orig(x, fprm, iprm, keys, sel, ks, exact)
        if not exact:
            out = out.clone()
            out[::2] = -1
        return out

    monkeypatch.setattr(Sampler, "_filtered", staticmethod(filtered))


_FILTERED = [
    ("Once upon a time", SamplingParams(n=2, temperature=0.9, seed=21, max_tokens=20, top_p=0.9, logprobs=2), True),
    ("The little dog", SamplingParams(temperature=1.0, seed=5, max_tokens=24, top_k=12), False),
    ("Tom", SamplingParams(temperature=0.8, seed=9, max_tokens=18, min_p=0.1, stop=["."]), True),
    ("She was sad", SamplingParams(temperature=0, max_tokens=15), False),
]


def _streams(chunks: list) -> list:
    """What each choice's stream delivered in all (token ids, text), whatever the chunking."""
    return [([t for ch in chunks for t in ch[i][0]], "".join(ch[i][1] for ch in chunks))
            for i in range(len(chunks[0]))] if chunks else []
