"""Runs the model on one device: loads weights, owns the KV pool, turns a schedule into tensors.

The runner takes plain data (`ScheduledSeq` records: which tokens of which sequence to compute, where
their K/V go) and returns the logits of the sequences that sample this step. It flattens all
scheduled tokens into one ragged batch (token ids, positions, slot mapping, block tables, sequence
lengths), so prefill chunks and decode tokens share one forward pass.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from . import kernels as K
from .config import KvCacheConfig, ModelConfig, cpu_kv_cache_bytes
from .llama import AttentionMetadata, LlamaForCausalLM, ParallelContext
from .weights import load_weights

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


@dataclass
class ScheduledSeq:
    """One sequence's share of a step (plain data, picklable for worker processes)."""

    seq_id: int
    token_ids: list[int]  # the tokens to compute now (a prefill chunk, or the last sampled token)
    start_pos: int  # position of token_ids[0] (= tokens already in the cache)
    block_table: list[int]
    sample: bool  # this chunk reaches the end of the sequence: produce logits for its last token
    all_logits: bool = False  # return logits for every token of the chunk (prompt logprobs)


def resolve_device(device: str) -> torch.device:
    """"auto" -> cuda when available, else cpu."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """Weights' dtype: "auto" = float32 on CPU, the checkpoint's 16-bit dtype (else bfloat16) on GPU."""
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be auto, bfloat16, float16 or float32, got {dtype!r}")
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    ckpt = _DTYPES.get(cfg.torch_dtype.replace("torch.", ""), torch.bfloat16)
    return ckpt if ckpt in (torch.bfloat16, torch.float16) else torch.bfloat16


class ModelRunner:
    """Owns the model's weights and KV cache on one device.

    Args:
        model_dir: Hugging Face checkpoint directory.
        cfg: its `ModelConfig`.
        kv_config: pool sizing and block size.
        max_num_tokens: tokens per step (the profiling pass runs this many).
        max_batch_size: sequences per step.
        max_seq_len: longest sequence (prompt + output), tokens.
        device, dtype: "auto" or explicit.
        pc, layer_range: tensor-parallel rank and pipeline stage (defaults: the whole model).
    """

    def __init__(self, model_dir: Path, cfg: ModelConfig, kv_config: KvCacheConfig, max_num_tokens: int,
                 max_batch_size: int, max_seq_len: int, device: str = "auto", dtype: str = "auto",
                 pc: Optional[ParallelContext] = None, layer_range: Optional[tuple[int, int]] = None) -> None:
        self.cfg = cfg
        self.kv_config = kv_config
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.device = resolve_device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(dtype, cfg, self.device)
        self.block_size = kv_config.tokens_per_block
        cfg.raw["_model_dir"] = str(model_dir)
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = LlamaForCausalLM(cfg, pc, layer_range)
        model = model.to_empty(device=self.device).to(self.dtype)
        load_weights(model, Path(model_dir))
        model.eval()
        rope_len = max(max_seq_len, cfg.max_position_embeddings)
        model.set_rope_cache(K.build_rope_cache(cfg.head_dim, rope_len, cfg.rope_theta, cfg.rope_scaling,
                                                device=self.device))
        self.model = model
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        logger.info("loaded %s (%.1f MB, %s, %s) in %.1f s", model_dir, self.weight_bytes / 1e6, self.dtype,
                    self.device, time.perf_counter() - t0)
        kv_dtype = self.dtype if kv_config.dtype == "auto" else _DTYPES[kv_config.dtype]
        self.kv_dtype = kv_dtype
        self.num_kv_heads = model.layers[0].self_attn.num_kv_heads if len(model.layers) else 1
        self.num_blocks = self._num_kv_blocks()
        shape = (2, self.num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in model.layers]
        logger.info("KV pool: %d blocks x %d tokens (%.1f MB)", self.num_blocks, self.block_size,
                    self.num_blocks * self.bytes_per_block / 1e6)

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across this runner's layers, in bytes."""
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * len(self.model.layers) * self.block_size * self.num_kv_heads * self.cfg.head_dim * elem

    def _num_kv_blocks(self) -> int:
        """Blocks for the pool: the free-memory fraction of what is left after weights and a profiling pass."""
        kv = self.kv_config
        per_block = max(self.bytes_per_block, 1)
        if self.device.type == "cuda":
            budget = self._profile_free_gpu_bytes() * kv.free_gpu_memory_fraction
        else:
            budget = cpu_kv_cache_bytes() * kv.free_gpu_memory_fraction
            # No need for more than every sequence at full length.
            budget = min(budget, self.max_batch_size * (self.max_seq_len + self.block_size) * per_block / self.block_size)
        blocks = int(budget // per_block)
        if kv.max_tokens is not None:
            blocks = min(blocks, kv.max_tokens // self.block_size)
        if blocks < 1:
            raise MemoryError(f"no memory left for the KV cache (budget {budget / 1e6:.1f} MB, "
                              f"{per_block} bytes per block)")
        return blocks

    @torch.inference_mode()
    def _profile_free_gpu_bytes(self) -> float:
        """Run a forward pass of ``max_num_tokens`` tokens; return free memory minus its activation peak."""
        n = min(self.max_num_tokens, self.max_seq_len)
        blocks = -(-n // self.block_size)
        shape = (2, blocks, self.block_size, self.num_kv_heads, self.cfg.head_dim)
        caches = [torch.empty(shape, dtype=self.kv_dtype, device=self.device) for _ in self.model.layers]
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seq = ScheduledSeq(0, [0] * n, 0, list(range(blocks)), True)
        ids, pos, meta, sample_idx = self.prepare([seq])
        hidden = self._forward(ids, pos, meta, caches)
        if self.model.is_last:
            self.model.compute_logits(hidden[-self.max_batch_size:])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del caches, hidden
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info()
        logger.info("profiling pass of %d tokens: %.2f GB activations peak, %.2f GB free", n, peak / 1e9, free / 1e9)
        return max(free - peak, 0)

    def prepare(self, seqs: list[ScheduledSeq]):
        """Flatten a schedule into (input_ids [T], positions [T], AttentionMetadata, sample indices [S])."""
        B = self.block_size
        ids, pos, slots, qsl, lens, sample_idx = [], [], [], [0], [], []
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = []
        for s in seqs:
            n = len(s.token_ids)
            ids.extend(s.token_ids)
            p = range(s.start_pos, s.start_pos + n)
            pos.extend(p)
            bt = s.block_table
            slots.extend(bt[q // B] * B + q % B for q in p)
            if s.all_logits:
                sample_idx.extend(range(qsl[-1], qsl[-1] + n))
            elif s.sample:
                sample_idx.append(qsl[-1] + n - 1)
            qsl.append(qsl[-1] + n)
            lens.append(s.start_pos + n)
            tables.append(bt + [0] * (max_blocks - len(bt)))
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            max_query_len=max(len(s.token_ids) for s in seqs),
            max_seq_len=max(lens),
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                meta, sample_idx)

    def _forward(self, ids, pos, meta, caches, hidden=None, residual=None):
        return self.model(ids, pos, meta, caches, hidden, residual)

    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns (logits [R, vocab] float32 for the sampled rows, row index per seq or -1).

        Rows are in schedule order: a sequence with ``sample`` contributes one row (its last token);
        one with ``all_logits`` contributes one row per computed token.
        """
        ids, pos, meta, sample_idx = self.prepare(seqs)
        hidden = self._forward(ids, pos, meta, self.kv_caches)
        if not sample_idx:
            return torch.empty(0, self.cfg.vocab_size, device=self.device), []
        logits = self.model.compute_logits(hidden[torch.tensor(sample_idx, device=self.device)])
        return logits, sample_idx
