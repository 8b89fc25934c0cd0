"""The penalties' token history: cached on a reused sampler row it equals a fresh row's, and it follows
the logits' device."""

from __future__ import annotations




def test_penalty_history_cached_on_a_reused_row_matches_a_fresh_row():
    import torch

    from kvpilot.sampling.sampler import SamplingRow, apply_penalties_and_masks

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 50, generator=g)
    reused = SamplingRow(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                         prompt_token_ids=[3, 4, 4, 9], output_token_ids=[])
    other = SamplingRow(temperature=0.0)
    for step_tokens in ([7], [7, 7, 12], [7, 7, 12, 49, 3]):
        reused.output_token_ids = list(step_tokens)
        fresh = SamplingRow(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2,
                            prompt_token_ids=[3, 4, 4, 9], output_token_ids=list(step_tokens))
        a = apply_penalties_and_masks(logits.clone(), [other, reused])
        b = apply_penalties_and_masks(logits.clone(), [other, fresh])
        assert torch.equal(a, b)
        assert torch.equal(a[0], logits[0])  # rows without penalties are untouched
    # Direct formula for the last step: HF repetition over prompt+output, then OpenAI penalties.
    expect = logits[1].clone()
    seen = {3, 4, 9, 7, 12, 49}
    for t in seen:
        expect[t] = expect[t] / 1.3 if expect[t] > 0 else expect[t] * 1.3
    for t, c in {7: 2, 12: 1, 49: 1, 3: 1}.items():
        expect[t] -= 0.4 * c + 0.2
    assert torch.allclose(a[1], expect, atol=1e-6)


def test_penalty_history_follows_the_logits_device():
    import torch

    from kvpilot.sampling.sampler import SamplingRow

    r = SamplingRow(repetition_penalty=1.3, prompt_token_ids=[1, 2, 3], output_token_ids=[4])
    r._prompt_t = torch.tensor([1, 2, 3], device="meta")  # left by an earlier step on another device
    r._out_t = torch.tensor([4], device="meta")
    r.output_token_ids = [4, 5]
    prompt, out = r.history(torch.device("cpu"))
    assert prompt.tolist() == [1, 2, 3] and out.tolist() == [4, 5]
