"""Bad or extreme sampling requests on CPU (stories260K): a bad request is refused with ValueError
before it is queued, and never fails other requests; a tiny temperature is greedy; allowed token ids
hold even when min_tokens bans them; a row the sampler rejects fails only its own request, and a
batch error no single row reproduces fails the step."""

from __future__ import annotations

import asyncio

import pytest

from kvpilot import LLM, SamplingParams
from kvpilot.outputs import RequestError


@pytest.fixture(scope="module")
def llm(stories_model_dir):
    with LLM(str(stories_model_dir)) as engine:
        yield engine


def _submit_next_to_victim(llm, bad_params: SamplingParams):
    """Run a long greedy request, add ``bad_params`` while it runs; return (victim error, bad error)."""

    async def main():
        victim = llm.generate_async("Once upon a time", SamplingParams(temperature=0, max_tokens=120,
                                                                       ignore_eos=True))
        await asyncio.sleep(0.02)
        try:
            bad = llm.generate_async("Tom", bad_params)
        except ValueError:
            await victim
            return None, "refused"
        errors = []
        for out in (victim, bad):
            try:
                await out
                errors.append(None)
            except RequestError as e:
                errors.append(e)
        return errors[0], errors[1]

    return asyncio.run(main())


@pytest.mark.parametrize("params", [
    dict(top_k=2 ** 63, temperature=1.0, max_tokens=4),      # sampler: np.fromiter(..., np.int64) overflows
    dict(end_id=2 ** 63, min_tokens=2, max_tokens=4),        # sampler: _padded(torch.tensor) of the min_tokens bans
], ids=["top_k_2**63", "end_id_2**63"])
def test_out_of_int64_param_never_fails_other_requests(llm, params):
    """An integer field beyond int64 must be refused (or served); today the engine step raises and
    `fail_all` fails every request in flight with the OverflowError."""
    try:
        bad_params = SamplingParams(**params)
    except ValueError as e:  # refused where the parameters are made: nothing reaches the engine
        assert "must be in" in str(e)
        return
    victim_error, bad_error = _submit_next_to_victim(llm, bad_params)
    assert victim_error is None, f"an unrelated request failed: {victim_error!r}"
    assert bad_error in (None, "refused"), f"the bad request failed inside the engine: {bad_error!r}"


@pytest.mark.parametrize("temperature", [1e-39, 1e-45])
def test_tiny_temperature_is_greedy(llm, temperature):
    """logits / T overflows float32 to +-inf for T < ~1e-38: the plain path then takes the lowest id
    with a positive logit (and filtered rows get NaN masses). A tiny temperature must act as greedy."""
    prompt = "Once upon a time"
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    for extra in ({}, {"top_p": 0.9}):
        got = llm.generate(prompt, SamplingParams(temperature=temperature, seed=1, max_tokens=12, **extra),
                           use_tqdm=False)
        assert got.outputs[0].token_ids == greedy.outputs[0].token_ids, extra


def test_allowed_token_ids_never_violated_when_min_tokens_bans_them(llm):
    """allowed_token_ids=[EOS] with min_tokens > 0 leaves no token to draw: every logit is -inf and
    the arg-max returns id 0 (<unk>), a token outside allowed_token_ids. The request must be refused
    up front (ValueError) or only ever produce allowed tokens."""
    eos = llm.eos_token_ids[-1]
    try:
        out = llm.generate("Once", SamplingParams(allowed_token_ids=[eos], min_tokens=3, max_tokens=5, temperature=0),
                           use_tqdm=False)
    except ValueError:
        return
    assert set(out.outputs[0].token_ids) <= {eos}, out.outputs[0].token_ids


def test_a_row_the_sampler_rejects_fails_only_its_own_request(llm, monkeypatch):
    """Defence in depth for parameters validation missed: when the batched sampler raises, rows are
    sampled one by one and only the request whose row raises fails; the others keep their text."""
    core = llm._core
    real = core.sampler

    class Picky:
        def __call__(self, logits, rows):
            if any(r.seed == 777 for r in rows):
                raise OverflowError("a parameter the sampler cannot hold")
            return real(logits, rows)

    monkeypatch.setattr(core, "sampler", Picky())
    victim_params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    want = llm.generate("Once upon a time", victim_params, use_tqdm=False)

    async def main():
        victim = llm.generate_async("Once upon a time", victim_params)
        await asyncio.sleep(0.02)
        bad = llm.generate_async("Tom", SamplingParams(temperature=1.0, seed=777, max_tokens=4))
        with pytest.raises(RequestError, match="sampling failed"):
            await bad
        return await victim

    victim = asyncio.run(main())
    assert victim.outputs[0].token_ids == want.outputs[0].token_ids  # every step, the failing one too
    # The engine keeps serving, and holds no blocks once idle.
    again = llm.generate("Once upon a time", victim_params, use_tqdm=False)
    assert again.outputs[0].token_ids == want.outputs[0].token_ids
    monkeypatch.setattr(core, "sampler", real)
    llm.generate("Tom", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    stats = llm.get_stats(timeout=2.0)
    assert stats[-1]["kvCacheStats"]["usedNumBlocks"] == 0


def test_a_batch_error_no_single_row_reproduces_still_fails_the_step(llm, monkeypatch):
    """If every row samples fine alone, the error is not a request's: it is not hidden (the step fails,
    and the engine keeps serving afterwards)."""
    core = llm._core
    real = core.sampler
    calls = {"n": 0}

    class BatchOnly:
        def __call__(self, logits, rows):
            calls["n"] += 1
            if calls["n"] == 1:
                raise RuntimeError("device error")
            return real(logits, rows)

    monkeypatch.setattr(core, "sampler", BatchOnly())
    with pytest.raises(RequestError, match="device error"):
        llm.generate("Once", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    monkeypatch.setattr(core, "sampler", real)
    assert llm.generate("Once", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False).outputs[0].token_ids
