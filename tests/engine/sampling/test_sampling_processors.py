"""The sampler's logits transforms against Hugging Face's logits processors and direct formulas,
its seeded draw against a known distribution (chi-square), and its batch independence."""

from __future__ import annotations

import os

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from kvpilot.sampling.sampler import (
    Sampler,
    SamplingRow,
    apply_penalties_and_masks,
    gumbel_noise,
    top_k_top_p_min_p,
)

S, V = 6, 500


@pytest.fixture
def logits() -> torch.Tensor:
    g = torch.Generator().manual_seed(1234)
    return torch.randn(S, V, generator=g) * 3.0


def _ours(logits, top_k=0, top_p=1.0, min_p=0.0):
    n = logits.shape[0]
    return top_k_top_p_min_p(logits.clone(), torch.full((n,), top_k), torch.full((n,), float(top_p)),
                             torch.full((n,), float(min_p)))


def _same_mask(a: torch.Tensor, b: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(a), torch.isinf(b))
    fin = ~torch.isinf(a)
    torch.testing.assert_close(a[fin], b[fin])


@pytest.mark.parametrize("top_k", [1, 7, 50, V, V + 10])
def test_top_k_matches_transformers(logits, top_k):
    ref = TopKLogitsWarper(top_k=top_k, filter_value=float("-inf"))(None, logits.clone())
    _same_mask(_ours(logits, top_k=top_k), ref)


@pytest.mark.parametrize("top_p", [0.05, 0.3, 0.9, 0.999])
def test_top_p_matches_transformers(logits, top_p):
    ref = TopPLogitsWarper(top_p=top_p, filter_value=float("-inf"))(None, logits.clone())
    out = _ours(logits, top_p=top_p)
    _same_mask(out, ref)
    assert int((~torch.isinf(out)).sum(dim=-1).min()) >= 1


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 1.0])
def test_min_p_matches_transformers(logits, min_p):
    ref = MinPLogitsWarper(min_p=min_p, filter_value=float("-inf"))(None, logits.clone())
    _same_mask(_ours(logits, min_p=min_p), ref)


def test_combined_order_matches_transformers(logits):
    """temperature -> top-k -> top-p -> min-p, as HF's generate chains them."""
    x = logits.clone()
    for proc in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(40, filter_value=float("-inf")),
                 TopPLogitsWarper(0.8, filter_value=float("-inf")), MinPLogitsWarper(0.05, filter_value=float("-inf"))):
        x = proc(None, x)
    _same_mask(_ours(logits / 0.7, top_k=40, top_p=0.8, min_p=0.05), x)


def test_per_row_parameters(logits):
    """Each row uses its own settings; row i equals the single-row result."""
    ks = torch.tensor([0, 3, 0, 10, 1, 0])
    ps = torch.tensor([1.0, 1.0, 0.5, 0.9, 1.0, 0.2])
    ms = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.3])
    both = top_k_top_p_min_p(logits.clone(), ks, ps, ms)
    for i in range(S):
        one = top_k_top_p_min_p(logits[i:i + 1].clone(), ks[i:i + 1], ps[i:i + 1], ms[i:i + 1])
        _same_mask(both[i:i + 1], one)


@pytest.mark.parametrize("penalty", [0.7, 1.3])
def test_repetition_penalty_matches_transformers(logits, penalty):
    prompts = [[1, 2, 3], [], [499, 499], [7], [10, 20], [0]]
    outputs = [[4, 1], [5], [], [7, 7, 8], [], [0, 1, 2, 3]]
    rows = [SamplingRow(repetition_penalty=penalty, prompt_token_ids=p, output_token_ids=o)
            for p, o in zip(prompts, outputs)]
    ours = apply_penalties_and_masks(logits.clone(), rows)
    proc = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (p, o) in enumerate(zip(prompts, outputs)):
        ids = torch.tensor([p + o], dtype=torch.long) if p + o else torch.zeros(1, 0, dtype=torch.long)
        ref = proc(ids, logits[i:i + 1].clone()) if p + o else logits[i:i + 1]
        torch.testing.assert_close(ours[i:i + 1], ref)


def test_frequency_presence_penalty_formula(logits):
    """OpenAI: logit -= frequency * count + presence * (count > 0), over output tokens only."""
    outputs = [[4, 4, 4, 9], [], [1], [2, 3, 2], [499], [0, 0]]
    fp = [(0.5, 0.0), (1.0, 1.0), (0.0, 1.5), (-0.5, 0.25), (2.0, -2.0), (0.3, 0.3)]
    rows = [SamplingRow(frequency_penalty=f, presence_penalty=p, output_token_ids=o,
                        prompt_token_ids=[4, 5, 6]) for o, (f, p) in zip(outputs, fp)]
    ours = apply_penalties_and_masks(logits.clone(), rows)
    expect = logits.clone()
    for i, (o, (f, p)) in enumerate(zip(outputs, fp)):
        for tok in set(o):
            expect[i, tok] -= f * o.count(tok) + p
    torch.testing.assert_close(ours, expect)


def test_logit_bias_masks_and_bad_words(logits):
    rows = [
        SamplingRow(logit_bias={3: 5.0, 10: -100.0, V + 5: 1.0}),
        SamplingRow(allowed_token_ids=[2, 8, 9]),
        SamplingRow(banned_token_ids=[0, 1]),
        SamplingRow(bad_word_seqs=[[5], [6, 7]], output_token_ids=[1, 6]),
        SamplingRow(bad_word_seqs=[[6, 7]], output_token_ids=[6, 1]),
        SamplingRow(),
    ]
    ours = apply_penalties_and_masks(logits.clone(), rows)
    expect = logits.clone()
    expect[0, 3] += 5.0
    expect[0, 10] -= 100.0
    keep = torch.full((V,), float("-inf"))
    keep[[2, 8, 9]] = 0.0
    expect[1] += keep
    expect[2, [0, 1]] = float("-inf")
    expect[3, [5, 7]] = float("-inf")  # [6, 7] is banned only right after a 6
    torch.testing.assert_close(ours, expect)


def test_greedy_and_logprobs_from_raw_distribution(logits):
    rows = [SamplingRow(temperature=0.0, logprobs=3, top_p=0.1, top_k=2) for _ in range(S)]
    out = Sampler()(logits.clone(), rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    raw = torch.log_softmax(logits, -1)
    for i in range(S):
        ids, vals, rank = out.top_logprobs[i]
        assert len(ids) == 3 and rank == 1
        assert ids == raw[i].topk(3).indices.tolist()
        torch.testing.assert_close(torch.tensor(vals), raw[i].topk(3).values)
        assert out.logprobs[i] == pytest.approx(float(raw[i, out.token_ids[i]]))


def test_top_logprobs_keep_n_entries_under_top_p(logits):
    """top-p/top-k shrink what can be drawn, never the logprobs lists (raw distribution)."""
    rows = [SamplingRow(temperature=1.0, top_p=0.01, top_k=1, logprobs=5, seed=i) for i in range(S)]
    out = Sampler()(logits.clone(), rows)
    raw = torch.log_softmax(logits, -1)
    for i in range(S):
        ids, vals, rank = out.top_logprobs[i]
        assert len(ids) == 5 and ids == raw[i].topk(5).indices.tolist()
        assert out.token_ids[i] == int(logits[i].argmax())  # top-k 1 leaves only the best
        assert rank == 1


def test_chi_square_against_known_distribution():
    """20,000 seeded draws (distinct seeds, one batch of rows) follow softmax(logits / T).

    Pearson's chi-square statistic over 8 categories (7 degrees of freedom); the test fails when
    the p-value is below 0.001 (regularised upper incomplete gamma, Q(df/2, x/2)).
    """
    probs = torch.tensor([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.04, 0.01])
    T = 0.8
    base = torch.cat([torch.log(probs) * T, torch.full((56,), -1e4)])  # softmax(base / T) == probs
    N = 20000
    rows = [SamplingRow(temperature=T, seed=1000 + i, step=i % 7) for i in range(N)]
    out = Sampler()(base.expand(N, -1).clone(), rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=base.numel()).float()
    assert counts[8:].sum() == 0
    expected = probs * N
    chi2 = float(((counts[:8] - expected) ** 2 / expected).sum())
    p_value = float(torch.special.gammaincc(torch.tensor(7 / 2), torch.tensor(chi2 / 2)))
    assert p_value > 1e-3, (chi2, counts[:8].tolist())


def test_chi_square_after_top_k_top_p_through_candidates():
    """The candidate path (topk, then masks) draws from the renormalised kept set."""
    probs = torch.tensor([0.4, 0.3, 0.2, 0.1])
    logits = torch.cat([torch.log(probs), torch.full((100,), -5.0)])
    N = 20000
    # top_k=3 keeps {0,1,2}; top_p=0.95 over them keeps all three (mass above id 2 is 0.78).
    rows = [SamplingRow(temperature=1.0, top_k=3, top_p=0.95, seed=i) for i in range(N)]
    out = Sampler()(logits.expand(N, -1).clone(), rows)
    counts = torch.bincount(torch.tensor(out.token_ids), minlength=logits.numel()).float()
    assert counts[3:].sum() == 0
    expected = probs[:3] / probs[:3].sum() * N
    chi2 = float(((counts[:3] - expected) ** 2 / expected).sum())
    assert float(torch.special.gammaincc(torch.tensor(1.0), torch.tensor(chi2 / 2))) > 1e-3


def test_seed_is_batch_independent(logits):
    """The same (seed, step) draws the same token whatever other rows share the batch."""
    target = SamplingRow(temperature=1.3, top_p=0.95, seed=42, step=5)
    alone = Sampler()(logits[:1].clone(), [target]).token_ids[0]
    others = [SamplingRow(temperature=t, top_k=k, seed=s) for t, k, s in
              [(0.0, 0, 1), (0.5, 3, 2), (1.0, 0, 3), (2.0, 2000, 4), (0.9, 1, 5)]]
    mixed = Sampler()(torch.cat([logits[1:], logits[:1]]).clone(), others + [target]).token_ids[-1]
    assert mixed == alone
    # Different steps of the same seed give different noise.
    a = gumbel_noise(torch.tensor([42]), torch.tensor([5]), V)
    b = gumbel_noise(torch.tensor([42]), torch.tensor([6]), V)
    assert not torch.equal(a, b)


def test_gumbel_noise_columns_match_token_subset():
    seeds, steps = torch.tensor([3, -7, 2 ** 62]), torch.tensor([0, 9, 123456])
    full = gumbel_noise(seeds, steps, 1000)
    ids = torch.tensor([[5, 999, 0], [17, 17, 400], [1, 2, 3]])
    torch.testing.assert_close(gumbel_noise(seeds, steps, 1000, token_ids=ids), full.gather(1, ids))
    # Golden values pin the hash, so a change of the noise (and of every seeded text) is noticed.
    assert full[0, :3].tolist() == pytest.approx(GOLDEN_NOISE, abs=1e-6)


GOLDEN_NOISE = [-0.3048877418041229, -0.16597121953964233, 0.4656490087509155]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.gpu
def test_triton_noise_equals_torch_noise():
    seeds = torch.randint(-2 ** 62, 2 ** 62, (64,), device="cuda")
    steps = torch.randint(0, 5000, (64,), device="cuda")
    full = gumbel_noise(seeds, steps, 50000)
    ids = torch.arange(50000, device="cuda").expand(64, -1)
    ref = gumbel_noise(seeds, steps, 50000, token_ids=ids)
    torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5)


def test_candidate_paths_equal_full_vocabulary_draw():
    """Top-1024 candidates, the topk(k) path, plain rows and the full-sort fallback all draw the
    token that Gumbel-max over the whole masked vocabulary draws."""
    g = torch.Generator().manual_seed(5)
    Vb = 5000
    logits = torch.randn(12, Vb, generator=g) * 3.0
    logits[10] = 0.01 * torch.randn(Vb, generator=g)  # flat: the top 1024 hold ~20% of the mass
    logits[11] = 0.01 * torch.randn(Vb, generator=g)
    settings = [(0.8, 0, 0.9, 0.0), (1.0, 0, 0.5, 0.0), (1.2, 0, 1.0, 0.05), (0.7, 40, 0.9, 0.0),
                (1.0, 2000, 1.0, 0.0), (0.9, 0, 1.0, 0.0), (1.0, 0, 0.99, 0.0), (1.5, 7, 1.0, 0.0),
                (1.0, 0, 0.3, 0.2), (0.6, 0, 1.0, 0.0), (1.0, 0, 0.9, 0.0), (1.0, 1500, 0.95, 0.0)]
    for trial in range(3):
        rows = [SamplingRow(temperature=t, top_k=k, top_p=p, min_p=m, seed=100 * trial + i, step=trial)
                for i, (t, k, p, m) in enumerate(settings)]
        got = Sampler()(logits.clone(), rows).token_ids
        temps = torch.tensor([r.temperature for r in rows])[:, None]
        masked = top_k_top_p_min_p(logits / temps, torch.tensor([r.top_k for r in rows]),
                                   torch.tensor([r.top_p for r in rows]), torch.tensor([r.min_p for r in rows]))
        noise = gumbel_noise(torch.tensor([r.seed for r in rows]), torch.full((12,), trial), Vb)
        assert got == (masked + noise).argmax(-1).tolist()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton kernel in the interpreter")
def test_triton_noise_kernel_in_interpreter():
    from kvpilot.sampling.sampler import _row_keys, _triton_gumbel

    seeds, steps = torch.tensor([3, -7, 2 ** 62]), torch.tensor([0, 9, 123456])
    ref = gumbel_noise(seeds, steps, 2100)
    torch.testing.assert_close(_triton_gumbel()(_row_keys(seeds, steps), 2100), ref, rtol=1e-5, atol=1e-5)
