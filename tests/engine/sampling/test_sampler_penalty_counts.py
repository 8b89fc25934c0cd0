"""The sampler's host inputs and penalty counts: a failed call recounts its rows in the slots they
hold, and min-p rows sample without a non-writable array warning."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvpilot.sampling.logits_processors import apply_penalties_and_masks, token_counts
from kvpilot.sampling.sampler import Sampler, SamplingRow


def _penalized(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition (HF: prompt + output, each token once) and frequency/presence (OpenAI: output)
    penalties by their definitions, token by token."""
    out = logits.clone()
    V = logits.shape[1]
    for i, r in enumerate(rows):
        for t in set(r.prompt_token_ids or []) | set(r.output_token_ids):
            if 0 <= t < V:
                v = out[i, t]
                out[i, t] = v / r.repetition_penalty if v > 0 else v * r.repetition_penalty
        for t in set(r.output_token_ids):
            if 0 <= t < V:
                out[i, t] -= r.frequency_penalty * r.output_token_ids.count(t) + r.presence_penalty
    return out


def _owned_slots(row: SamplingRow, V: int) -> list[int]:
    pool = token_counts(torch.device("cpu"), V)
    return [s for s, w in enumerate(pool._owner) if w is not None and w() is row]


def test_a_failed_call_recounts_its_rows_in_the_slots_they_hold(monkeypatch):
    """A call failing between planning and applying the counts made its rows count again from
    scratch by dropping their slot record, which left each old slot owned by the live row (4 * V
    bytes per row and failure, e.g. every penalised row of a batch `EngineCore._sample_rows_apart`
    retries). The rows must recount in their own slots, with the right values."""
    from kvpilot.sampling import sampler_inputs

    V = 37
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(11)) * 3
    rows = [SamplingRow(frequency_penalty=0.5, presence_penalty=0.25, output_token_ids=[1, 2, 2]),
            SamplingRow(repetition_penalty=1.5, prompt_token_ids=[4, 36, 4], output_token_ids=[7]),
            SamplingRow(temperature=0.0)]
    apply_penalties_and_masks(logits.clone(), rows)
    before = [_owned_slots(r, V) for r in rows[:2]]
    assert all(len(s) == 1 for s in before)

    def broken(self, dev):
        raise RuntimeError("upload failed")

    real = sampler_inputs.Upload.send
    monkeypatch.setattr(sampler_inputs.Upload, "send", broken)
    for r in rows[:2]:
        r.output_token_ids.append(5)
    for _ in range(3):  # a failure must not take one more slot per row
        with pytest.raises(RuntimeError, match="upload failed"):
            Sampler("torch")(logits, rows)
    monkeypatch.setattr(sampler_inputs.Upload, "send", real)
    rows[0].output_token_ids = rows[0].output_token_ids + [2]
    got = apply_penalties_and_masks(logits.clone(), rows)
    torch.testing.assert_close(got, _penalized(logits, rows), rtol=0, atol=1e-5)
    assert [_owned_slots(r, V) for r in rows[:2]] == before
    assert not token_counts(logits.device, V).lock.locked()


@pytest.mark.parametrize("S", [1, 3])
def test_min_p_rows_sample_without_a_non_writable_array_warning(S):
    """One row's record field is a read-only view of the record bytes: handing it to
    ``torch.from_numpy`` warned (UserWarning) at the first min_p call of a process."""
    V = 40
    logits = torch.randn(S, V, generator=torch.Generator().manual_seed(2))
    rows = [SamplingRow(temperature=0.8, min_p=0.05 * (i + 1), seed=7 + i, step=3) for i in range(S)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = Sampler("torch")(logits, rows)
    ref = Sampler("exact")(logits, [SamplingRow(temperature=r.temperature, min_p=r.min_p, seed=r.seed, step=r.step)
                                    for r in rows])
    assert got.token_ids == ref.token_ids
