"""Compare a kvpilot model family with `transformers` on the same random weights (float32, CPU).

`random_checkpoint` builds a transformers model from a (tiny) config of the family's real config
class, draws random weights (biases included; norm weights around ``norm_center``: 1 for ``w``,
0 for Gemma's ``1 + w``) and saves it as safetensors. `compare_with_transformers` runs the
checkpoint through kvpilot's `ModelRunner` over the paged KV cache: the prompt in chunks
(chunked prefill, every chunk's logits), then ``steps`` greedy decode steps, and checks against the
transformers model (eager attention): teacher-forced log-probabilities of every prompt and
generated position within ``atol``, and the same greedy tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kvpilot import KvCacheConfig
from kvpilot.model.config import ModelConfig
from kvpilot.runner.model_runner import ModelRunner, ScheduledSeq

BLOCK = 8


def random_checkpoint(path: Path, model_cls, config, seed: int = 0, norm_center: float = 1.0,
                      std: float = 0.08) -> Path:
    """Save a random-weight ``model_cls(config)`` to ``path`` (safetensors) and return ``path``."""
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(norm_center + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def hf_model(path: Path, model_cls):
    return model_cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()


def kvpilot_runner(path: Path, max_seq_len: int = 96) -> ModelRunner:
    return ModelRunner(path, ModelConfig.from_dir(path), KvCacheConfig(tokens_per_block=BLOCK, max_tokens=512),
                       max_num_tokens=128, max_batch_size=4, max_seq_len=max_seq_len, device="cpu", dtype="float32")


def run_kvpilot(runner: ModelRunner, prompt: list[int], steps: int, chunk: int) -> tuple[torch.Tensor, list[int]]:
    """Teacher-forced logits of every prompt position (prefill in ``chunk``-token steps) and of each
    greedy decode step; returns (logits ``[len(prompt) + steps - 1, vocab]``, generated tokens)."""
    table = list(range(-(-(len(prompt) + steps) // BLOCK)))
    rows = []
    for start in range(0, len(prompt), chunk):
        part = prompt[start:start + chunk]
        last = start + chunk >= len(prompt)
        logits, _ = runner.execute([ScheduledSeq(0, part, start, table, last, all_logits=True)])
        rows.append(logits.clone())
    tokens = [int(rows[-1][-1].argmax())]
    for step in range(steps - 1):
        logits, _ = runner.execute([ScheduledSeq(0, [tokens[-1]], len(prompt) + step, table, True)])
        rows.append(logits.clone())
        tokens.append(int(logits[-1].argmax()))
    return torch.cat(rows), tokens


@torch.no_grad()
def compare_with_transformers(path: Path, model_cls, prompt: list[int], steps: int = 32, chunk: int = 7,
                              atol: float = 1e-4) -> dict:
    """Run both implementations; assert log-prob closeness and greedy equality. Returns the
    measured maximum log-prob difference and the tokens (for further assertions)."""
    runner = kvpilot_runner(path, max_seq_len=len(prompt) + steps + 8)
    got, tokens = run_kvpilot(runner, prompt, steps, chunk)
    hf = hf_model(path, model_cls)
    seq = list(prompt)
    want_tokens = []
    for _ in range(steps):  # greedy, full recompute each step (no cache in the reference)
        nxt = int(hf(torch.tensor([seq])).logits[0, -1].argmax())
        want_tokens.append(nxt)
        seq.append(nxt)
    ref = hf(torch.tensor([prompt + tokens[:-1]])).logits[0].float()
    diff = (torch.log_softmax(got, -1) - torch.log_softmax(ref, -1)).abs().max().item()
    assert got.shape == ref.shape, (got.shape, ref.shape)
    assert diff <= atol, f"max |log-prob difference| {diff:.3g} > {atol}"
    assert tokens == want_tokens
    return {"max_diff": diff, "tokens": tokens, "runner": runner}
