"""Models and rank processes of `test_tp_invariant.py` (gloo, CPU); a spawned rank imports this module.

`invariant_rank` follows `parallel_exact_helpers`' protocol (``("ok", rank, results)`` or ``("error",
rank, traceback)`` as a plain pickle on ``conn``; `parallel_exact_helpers.spawn_ranks` collects them).
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import torch


def make_gqa_llama(path: Path, seed: int = 5, vocab: int = 385, bias: bool = True, tie: bool = False,
                   layers: int = 2) -> Path:
    """A random Llama of ``layers`` layers (default 2) that splits into 4 tensor-parallel shards: GQA 8
    heads / 4 KV heads of 8, hidden 64, intermediate 96 (24 per shard); vocab 385 (not a multiple of 2
    or 4: padded LM head shards); random attention and MLP biases (std 0.08, like the matrices)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=8, max_position_embeddings=256,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=tie, bos_token_id=1,
                      eos_token_id=2, attention_bias=bias, mlp_bias=bias)  # fmt: skip
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


# (`Tuning.tp_invariant` or None for 0, `Tuning.fused_gemv` "1"/"0") of each TP 2 model `invariant_rank` builds.
TP2_CASES = [(None, "1"), ("2", "1"), ("2", "0"), ("4", "1"), ("4", "0")]
# Each single-process model rank 0 builds too.
SINGLE_CASES = [(None, "1"), ("2", "1"), ("2", "0"), ("4", "1"), ("4", "0")]


def _build(model_dir: str, dtype: str, pc, invariant, fused: str):
    from support.parallel_exact import _runner

    from kvpilot.tuning import Tuning

    return _runner(model_dir, dtype, pc, tuning=Tuning(tp_invariant=int(invariant or 0), fused_gemv=fused == "1"))


def invariant_rank(rank: int, init_method: str, model_dir: str, world: int, conn) -> None:
    """Rank of a TP ``world`` group (gloo): `parallel_exact_helpers.greedy_steps` in bf16 for each
    `TP2_CASES` entry (with ``world == 4``: only ``T = 4``); rank 0 also runs `SINGLE_CASES` in one
    process. Results: {"tp": {case: (logits, tokens, layer class, invariant_shards)}, "single": {case: ...}}."""
    import torch.distributed as dist

    from support.parallel_exact import _send, greedy_steps
    from kvpilot.model.llama import ParallelContext

    try:
        torch.set_num_threads(1)  # the single-process model and the ranks use the same CPU kernels
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
        pc = ParallelContext(rank, world, None)
        res = {"tp": {}, "single": {}}
        cases = TP2_CASES if world == 2 else [("4", "1"), ("4", "0")]
        with torch.inference_mode():
            for case in cases:
                runner = _build(model_dir, "bfloat16", pc, *case)
                logits, toks = greedy_steps(runner)
                res["tp"][case] = (logits, toks, type(runner.model.layers[0]).__name__,
                                   runner.model.invariant_shards)
            if rank == 0:
                for case in SINGLE_CASES:
                    runner = _build(model_dir, "bfloat16", None, *case)
                    logits, toks = greedy_steps(runner)
                    res["single"][case] = (logits, toks, type(runner.model.layers[0]).__name__,
                                           runner.model.invariant_shards)
        dist.destroy_process_group()
        _send(conn, ("ok", rank, res))
    except BaseException as e:  # noqa: BLE001 - report anything to the test
        _send(conn, ("error", rank, "".join(traceback.format_exception(type(e), e, e.__traceback__))))


def set_tuning(monkeypatch, **fields) -> None:
    """Merge ``fields`` into ``KVPILOT_TUNING`` (None: remove that field), as a benchmark's engine
    would get them; `tuning_now` reads the result for models built without `LLM`."""
    import json

    current = json.loads(os.environ.get("KVPILOT_TUNING") or "{}")
    for k, v in fields.items():
        if v is None:
            current.pop(k, None)
        else:
            current[k] = v
    if current:
        monkeypatch.setenv("KVPILOT_TUNING", json.dumps(current))
    else:
        monkeypatch.delenv("KVPILOT_TUNING", raising=False)


def tuning_now():
    """`Tuning.from_env` (the record an `LLM` would build now)."""
    from kvpilot.tuning import Tuning

    return Tuning.from_env()
