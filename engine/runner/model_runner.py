"""Runs the model on one device: loads weights, owns the KV pool, turns a schedule into tensors.

The runner takes plain data (`ScheduledSeq` records: which tokens of which sequence to compute, where
their K/V go) and returns the logits of the sequences that sample this step. It flattens all
scheduled tokens into one ragged batch (token ids, positions, slot mapping, block tables, sequence
lengths), so prefill chunks and decode tokens share one forward pass.

On CUDA (TensorRT-LLM's and vLLM's recipe):

- weights are created in their final dtype straight on the device (no float32 staging copy);
- the KV pool gets ``free_gpu_memory_fraction`` of the memory still free after the weights and a
  profiling forward pass of ``max_num_tokens`` tokens (``KvCacheConfig.max_tokens`` caps it);
- decode-only steps replay CUDA graphs captured at padded batch sizes (`cuda_graphs.DecodeGraphs`);
  steps with a prefill chunk of up to 256 tokens (alone or mixed with decodes;
  ``Tuning.prefill_graph_tokens``) replay graphs captured at padded token counts
  (`cuda_graphs.PrefillGraphs`); larger steps and prompt-logprob steps run eagerly;
- inputs are built with numpy in pinned host buffers and sent with one asynchronous copy, so the
  only device-to-host synchronisation per step is the sampler reading the chosen token ids;
- block tables are mirrored in a persistent host array (`HostBlockTables`) that each step updates
  with the blocks appended since the last one, so a step's host work does not grow with context.

Padded eager prefill (``prefill_pad_buckets``, set by tensor/pipeline-parallel ranks,
`parallel_worker.StageRunner`): a step that one GPU would replay from a prefill graph runs eagerly
but padded exactly as that graph pads it (`prefill_padding`: the token bucket, its sequence count,
``max_query_len`` = the bucket, ``max_seq_len`` = the runner's), so cuBLAS and the attention kernels
see the shapes one GPU gives them and pick the same algorithms and context splits, hence the same
rounding (unpadded PP 2 prefill steps made bf16 greedy tokens part from one GPU's).

LoRA (``lora_config``): `kvpilot.lora.layers.LoRASlots` adds ``max_loras`` adapter slots to the
projections before the KV pool is sized (their bytes are not KV). A step in which any sequence has
an adapter (``ScheduledSeq.lora``) runs eagerly, with each token's slot index set before the
forward pass; steps without adapters replay the CUDA graphs as usual (the graphs were captured with
LoRA inactive, so they hold no adapter state).

Async scheduling (``supports_async_scheduling``; `engine_core` explains the engine's side): a step may
be planned before the previous step's sampled tokens are read. A `ScheduledSeq` with
``inflight_row >= 0`` carries a placeholder id; `set_inflight_tokens` hands over the previous step's
sampled-id tensor (still on the device), and `execute` copies row ``inflight_row`` of it into the
input ids on the device, after the inputs' host-to-device copy and before the forward pass (eager) or
the graph replay (`cuda_graphs`' ``fix_inputs`` hook). Ids of -1 (rows the sampler redraws on the
host) are clamped to 0: the engine discards what such a row computes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from kvpilot import kernels as K
from kvpilot.runner.batch import ScheduledSeq  # noqa: F401  (the runner's input record)
from kvpilot.runner.block_tables import HostBlockTables
from kvpilot.config import KvCacheConfig, cpu_kv_cache_bytes
from kvpilot.model.config import ModelConfig
from kvpilot.model.layers import AttentionMetadata, ParallelContext
from kvpilot.model.registry import model_class
from kvpilot.model.quantization import cast_model
from kvpilot.model.weights import load_weights
from kvpilot.tuning import Tuning

logger = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16, "float32": torch.float32, "fp32": torch.float32, "float": torch.float32}


class DeviceUnavailableError(ValueError):
    """The requested device does not exist here: a CPU-only build of torch, no visible GPU, or a
    GPU index past the last one."""


def check_device(device: str) -> torch.device:
    """Parse ``device`` ("auto", "cpu", "cuda", "cuda:N") and check that it exists.

    Raises:
        ValueError: not a device name torch knows.
        DeviceUnavailableError: CUDA requested on a CPU-only torch build, with no GPU visible, or
            with an index >= the number of GPUs.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}") from exc
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")
    if dev.type == "cuda":
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            raise DeviceUnavailableError(
                f"device={device!r}, but this torch ({torch.__version__}) is a CPU-only build; install a "
                f"CUDA build of torch (README: Install) or use device='cpu'")
        count = torch.cuda.device_count()
        if count == 0:
            raise DeviceUnavailableError(f"device={device!r}, but torch sees no CUDA GPU (check the driver and "
                                         f"CUDA_VISIBLE_DEVICES); use device='cpu' to run on the CPU")
        if dev.index is not None and dev.index >= count:
            raise DeviceUnavailableError(f"device={device!r}, but only {count} CUDA GPU(s) are visible")
    return dev


def resolve_device(device: str) -> torch.device:
    """"auto" -> cuda when available, else cpu; a bare "cuda" gets the current device's index.

    Raises:
        ValueError, DeviceUnavailableError: see `check_device`.
    """
    dev = check_device(device)
    if dev.type == "cuda" and dev.index is None:  # torch.cuda.set_device needs an index
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


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


def resolve_kv_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: the model's for "auto", ``torch.float8_e4m3fn`` for "fp8"."""
    if kv_dtype == "auto":
        return model_dtype
    if kv_dtype == "fp8":
        return K.FP8_KV_DTYPE
    return _DTYPES[kv_dtype]


def prefill_padding(seqs: list[ScheduledSeq], buckets: list[int], max_batch_size: int,
                    max_blocks_per_seq: int) -> Optional[tuple[int, int]]:
    """``(tokens, sequences)`` a single-GPU prefill CUDA graph runs ``seqs`` at, or None when one GPU
    would run them eagerly (no chunk of two or more tokens, too many tokens or sequences, prompt
    logprobs, or a block table past ``max_blocks_per_seq``).

    ``buckets``: the prefill graphs' padded token counts, ascending (`cuda_graphs.default_token_buckets`);
    the bucket of ``T`` tokens holds ``min(T, max_batch_size)`` sequences. The same decision and
    shapes as `cuda_graphs.PrefillGraphs.can_run` / ``prepare``.
    """
    if not seqs or not buckets:
        return None
    top = buckets[-1]
    if len(seqs) > min(top, max_batch_size):
        return None
    tokens, longest = 0, 0
    for s in seqs:
        if s.all_logits or len(s.block_table) > max_blocks_per_seq:
            return None
        n = len(s.token_ids)
        tokens += n
        longest = max(longest, n)
    if longest <= 1 or tokens > top:
        return None
    padded = next(t for t in buckets if t >= tokens)
    return padded, min(padded, max_batch_size)


class _Staging:
    """A growable pinned host buffer plus the event of the last copy that read it.

    Reusing the buffer before that copy ran would send the next step's values to the previous step,
    so `take` waits for the event (normally long done: the sampler syncs every step).
    """

    def __init__(self, device: torch.device) -> None:
        self.pinned = device.type == "cuda"
        self.host = torch.empty(0, dtype=torch.int64)
        self.event = torch.cuda.Event() if self.pinned else None

    def take(self, n: int) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        if self.host.numel() < n:
            self.host = torch.empty(max(n, 2 * self.host.numel()), dtype=torch.int64, pin_memory=self.pinned)
        return self.host.numpy()[:n]

    def send(self, n: int, device: torch.device) -> torch.Tensor:
        out = self.host[:n].to(device, non_blocking=True)
        if self.event is not None:
            self.event.record()
        return out


class ModelRunner:
    """Owns the model's weights and KV cache on one device.

    Args:
        model_dir: Hugging Face checkpoint directory.
        cfg: its `ModelConfig`.
        kv_config: pool sizing and block size.
        max_num_tokens: tokens per step (the profiling pass runs this many).
        max_batch_size: sequences per step (CUDA graphs are captured up to this many).
        max_seq_len: longest sequence (prompt + output), tokens.
        device, dtype: "auto" or explicit.
        pc, layer_range: tensor-parallel rank and pipeline stage (defaults: the whole model).
        tuning: the performance switches (`kvpilot.tuning.Tuning`; default: the defaults), given to
            the model, the CUDA graphs and the sampler's arg-max.

    Attributes set for reports: ``weight_bytes``, ``load_seconds``, ``free_bytes_for_kv`` (free memory
    after weights and profiling, before the fraction), ``profile_peak_bytes``, ``num_blocks``,
    ``bytes_per_block``, ``graphs`` (a `DecodeGraphs` or None), ``prefill_graphs`` (a
    `PrefillGraphs` or None). ``block_tables``: the `HostBlockTables` every input path reads.
    ``prefill_pad_buckets``: None (default), or the token buckets eager prefill steps are padded to
    (module docstring; set by `parallel_worker.StageRunner`).

    Raises:
        MemoryError: no room for even one KV block.
    """

    # `EngineCore` may plan a step before it has read the previous step's tokens (see the module
    # docstring); executors without this attribute always get settled plans.
    supports_async_scheduling = True

    def __init__(self, model_dir: Path, cfg: ModelConfig, kv_config: KvCacheConfig, max_num_tokens: int,
                 max_batch_size: int, max_seq_len: int, device: str = "auto", dtype: str = "auto",
                 pc: Optional[ParallelContext] = None, layer_range: Optional[tuple[int, int]] = None,
                 lora_config=None, tuning: Optional[Tuning] = None) -> None:
        self.cfg = cfg
        self.tuning = tuning = tuning or Tuning()
        self.kv_config = kv_config
        self.max_num_tokens = max_num_tokens
        self.max_batch_size = max_batch_size
        self.max_seq_len = max_seq_len
        self.device = resolve_device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(dtype, cfg, self.device)
        self.block_size = kv_config.tokens_per_block
        self.prefill_pad_buckets: Optional[list[int]] = None
        cfg.raw["_model_dir"] = str(model_dir)
        t0 = time.perf_counter()
        with torch.device("meta"):
            model = model_class(cfg.architecture)(cfg, pc, layer_range, tuning)
        # Cast on the meta device first: to_empty then allocates each weight once, in its final dtype.
        # (FP8 weights and their float32 scales keep their dtypes: `cast_model`.)
        model = cast_model(model, self.dtype).to_empty(device=self.device)
        load_weights(model, Path(model_dir))
        model.eval()
        rope_len = max(max_seq_len, cfg.max_position_embeddings)
        model.init_rope(rope_len, self.device)
        self.model = model
        self.lora = None  # kvpilot.lora.layers.LoRASlots when lora_config is given
        if lora_config is not None:
            from kvpilot.lora.layers import LoRASlots

            self.lora = LoRASlots(model, lora_config, self.dtype, self.device)
            logger.info("LoRA: %d slots of rank %d (%.1f MB)", lora_config.max_loras, lora_config.max_lora_rank,
                        self.lora.nbytes / 1e6)
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.load_seconds = time.perf_counter() - t0
        logger.info("loaded %s (%.1f MB, %s, %s) in %.1f s", model_dir, self.weight_bytes / 1e6, self.dtype,
                    self.device, self.load_seconds)
        kv_dtype = resolve_kv_dtype(kv_config.dtype, self.dtype)
        self.kv_dtype = kv_dtype
        self.num_kv_heads = model.layers[0].self_attn.num_kv_heads if len(model.layers) else 1
        # The KV-head count attention's launch decisions assume: one shard's in tensor-parallel-
        # invariant mode (engine/model/tp_invariant.py), else num_kv_heads. Decode graphs' context buckets too.
        self.launch_kv_heads = model.layers[0].self_attn.launch_kv_heads if len(model.layers) else 1
        self.free_bytes_for_kv = 0.0
        self.profile_peak_bytes = 0
        self._staging = _Staging(self.device)
        self._inflight_staging = _Staging(self.device)  # (destination, source) rows of in-flight ids
        self._inflight_tokens: Optional[torch.Tensor] = None
        # `warm_up_eager` writes into KV blocks: only before the first real step (`execute`).
        self._served = False
        self._warming_up = False
        # Tensor-parallel async steps (`parallel_worker.InputSync`): consumed by the next `execute`.
        self.input_sync = None
        self.block_tables = HostBlockTables(self.max_blocks_per_seq, rows=max_batch_size + 64)
        self.num_blocks = self._num_kv_blocks()
        shape = (2, self.num_blocks, self.block_size, self.num_kv_heads, cfg.head_dim)
        self.kv_caches = [torch.zeros(shape, dtype=kv_dtype, device=self.device) for _ in model.layers]
        logger.info("KV pool: %d blocks x %d tokens (%.1f MB)", self.num_blocks, self.block_size,
                    self.num_blocks * self.bytes_per_block / 1e6)
        self.graphs = None
        self.prefill_graphs = None
        single = (pc is None or pc.tp_size == 1) and model.is_first and model.is_last
        if self.device.type == "cuda" and single and tuning.cuda_graphs:
            from kvpilot.runner.cuda_graphs import capture_all

            self.graphs, self.prefill_graphs = capture_all(self, prefill=tuning.prefill_graphs)
        if self.device.type == "cuda" and single and tuning.warmup:
            self.warm_up_eager()

    @property
    def bytes_per_block(self) -> int:
        """K and V of one block across this runner's layers, in bytes."""
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * len(self.model.layers) * self.block_size * self.num_kv_heads * self.cfg.head_dim * elem

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_seq_len // self.block_size)

    def _num_kv_blocks(self) -> int:
        """Blocks for the pool: the free-memory fraction of what is left after weights and a profiling pass."""
        kv = self.kv_config
        per_block = max(self.bytes_per_block, 1)
        if self.device.type == "cuda":
            self.free_bytes_for_kv = self._profile_free_gpu_bytes()
            budget = self.free_bytes_for_kv * kv.free_gpu_memory_fraction
        else:
            self.free_bytes_for_kv = float(cpu_kv_cache_bytes())
            budget = self.free_bytes_for_kv * kv.free_gpu_memory_fraction
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
            # The largest logits block a step can ask for: every decode of a full batch.
            self.model.compute_logits(hidden[-min(self.max_batch_size, n):])
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del caches, hidden
        torch.cuda.empty_cache()
        free, _total = torch.cuda.mem_get_info()
        self.profile_peak_bytes = peak
        logger.info("profiling pass of %d tokens: %.2f GB activations peak, %.2f GB free", n, peak / 1e9, free / 1e9)
        return max(free - peak, 0)

    # ---- inputs ------------------------------------------------------------------------------
    def _prepare(self, seqs: list[ScheduledSeq], pad_ok: bool = True):
        """Flatten a schedule; returns (ids, positions, meta, sample index list, sample index tensor).

        All index arithmetic is numpy on one pinned int64 staging buffer, sent in one copy. Rows of
        sequences that sample give their last token's logits, ``all_logits`` ones every token's.
        With ``prefill_pad_buckets`` (and ``pad_ok``) a step `prefill_padding` accepts is padded as a
        prefill graph pads it: ids and positions 0 and slots -1 for padded tokens, empty query ranges
        for padded sequences; the tensors then have the padded sizes, the sample indices stay the
        real rows.
        """
        B = self.block_size
        n = len(seqs)
        pad = None
        if pad_ok and self.prefill_pad_buckets is not None:
            pad = prefill_padding(seqs, self.prefill_pad_buckets, self.max_batch_size, self.max_blocks_per_seq)
        qlens = np.fromiter((len(s.token_ids) for s in seqs), np.int64, n)
        T = int(qlens.sum())
        starts = np.fromiter((s.start_pos for s in seqs), np.int64, n)
        qsl = np.zeros(n + 1, np.int64)
        np.cumsum(qlens, out=qsl[1:])
        seq_of_tok = np.repeat(np.arange(n), qlens)
        pos = starts[seq_of_tok] + (np.arange(T) - qsl[:-1][seq_of_tok])
        rows, width = self.block_tables.sync(seqs)
        tables = self.block_tables.array[rows, :width].astype(np.int64)  # [n, width]; stale past each length
        slots = tables[seq_of_tok, pos // B] * B + pos % B
        sample = np.fromiter((s.sample for s in seqs), np.bool_, n)
        all_logits = np.fromiter((s.all_logits for s in seqs), np.bool_, n)
        if not all_logits.any():
            sample_idx = (qsl[1:][sample] - 1).tolist()
        else:  # every token of all_logits sequences, the last one of the others that sample
            keep = np.repeat(all_logits, qlens)
            keep[qsl[1:][sample] - 1] = True
            sample_idx = np.flatnonzero(keep).tolist()
        S = len(sample_idx)
        Tp, Sp = pad if pad is not None else (T, n)  # padded token and sequence counts
        # Layout of the staging buffer: ids | pos | slots | seq_lens | qsl | tables | sample_idx, each
        # part starting on a 64-byte boundary: Triton specialises kernels on 16-byte pointer
        # alignment, so a part at an odd offset (pos after an odd token count) compiled a second
        # variant of each kernel that reads it, mid-run (a 190 ms stall seen on an H200).
        sizes = [Tp, Tp, Tp, Sp, Sp + 1, Sp * width, S]
        offs = np.zeros(len(sizes) + 1, np.int64)
        np.cumsum([-(-k // 8) * 8 for k in sizes], out=offs[1:])
        buf = self._staging.take(int(offs[-1]))
        parts = (np.fromiter(chain.from_iterable(s.token_ids for s in seqs), np.int64, T), pos, slots,
                 starts + qlens, qsl, tables.reshape(-1), sample_idx)
        # Padding (as `cuda_graphs.PrefillGraphs.prepare`): token id 0 at position 0 writing no KV
        # (slot -1); sequences with no context and an empty query range at the end of the real ones.
        fills = (0, 0, -1, 0, T, 0, 0)
        for o, k, a, fill in zip(offs, sizes, parts, fills):
            m = len(a)
            buf[o:o + m] = a
            if m < k:
                buf[o + m:o + k] = fill
        dev = self._staging.send(int(offs[-1]), self.device)
        part = [dev[offs[i]:offs[i] + sizes[i]] for i in range(7)]
        meta = AttentionMetadata(
            slot_mapping=part[2],
            block_tables=part[5].view(Sp, width).to(torch.int32),
            seq_lens=part[3].to(torch.int32),
            query_start_loc=part[4].to(torch.int32),
            max_query_len=Tp if pad is not None else int(qlens.max()),
            max_seq_len=self.max_seq_len if pad is not None else int((starts + qlens).max()),
        )
        return part[0], part[1], meta, sample_idx, part[6]

    def prepare(self, seqs: list[ScheduledSeq], pad_ok: bool = True):
        """Flatten a schedule into (input_ids [T] int64, positions [T] int64, AttentionMetadata,
        sample indices: list of rows of the flat batch whose logits the step returns). ``T`` is the
        padded token count when ``prefill_pad_buckets`` pads the step (`_prepare`); ``pad_ok=False``
        never pads (a pipeline micro-batch of a step one GPU would not pad: `parallel_worker.Worker`)."""
        ids, pos, meta, sample_idx, _ = self._prepare(seqs, pad_ok)
        return ids, pos, meta, sample_idx

    def _forward(self, ids, pos, meta, caches, hidden=None, residual=None):
        return self.model(ids, pos, meta, caches, hidden, residual)

    # ---- async scheduling ----------------------------------------------------------------------
    def set_inflight_tokens(self, tokens: torch.Tensor) -> None:
        """Give the next `execute` the previous step's sampled ids: ``tokens`` [S] int64 on this
        runner's device (-1 allowed: clamped to 0), read at row ``inflight_row`` by each sequence of
        the plan that has one. Consumed by that call."""
        self._inflight_tokens = tokens

    def _inflight_fix(self, seqs: list[ScheduledSeq]):
        """The device-side fix-up of this step's input ids, or None: a callable that writes the
        in-flight ids into ``ids`` ([>= T] int64 on the device, flat token order) on the current
        stream. Its index upload is queued now (one small copy; none when the in-flight rows are the
        first k tokens and read rows 0..k-1, the decode-only steady state).
        """
        tokens, self._inflight_tokens = self._inflight_tokens, None
        dst: list[int] = []
        src: list[int] = []
        off = 0
        for s in seqs:
            r = s.inflight_row
            if r >= 0:
                dst.append(off)
                src.append(r)
            off += len(s.token_ids)
        if not dst:
            return None
        k = len(dst)
        if dst[-1] == k - 1 and src == list(range(k)):  # dst is increasing: it is 0..k-1

            def fix(ids: torch.Tensor) -> None:
                torch.clamp(tokens[:k], min=0, out=ids[:k])
            return fix
        buf = self._inflight_staging.take(2 * k)
        buf[:k] = dst
        buf[k:] = src
        idx = self._inflight_staging.send(2 * k, self.device)

        def fix(ids: torch.Tensor) -> None:
            ids.index_copy_(0, idx[:k], tokens.index_select(0, idx[k:]).clamp_(min=0))
        return fix

    # ---- the step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        """Run one step. Returns (logits [R, vocab] float32 for the sampled rows, their flat-batch rows).

        Rows are in schedule order: a sequence with ``sample`` contributes one row (its last token);
        one with ``all_logits`` contributes one row per computed token. On a decode CUDA-graph step
        the logits are a view of a static buffer, valid until the next ``execute``. Sequences with
        ``inflight_row >= 0`` read their input id from the tensor given to `set_inflight_tokens`
        just before (without it they would compute their placeholder). ``input_sync`` (set by a
        tensor-parallel worker for this call only) wraps that fix-up: it waits for the front end's
        sampled ids and broadcasts the input ids over the tensor-parallel group
        (`parallel_worker.InputSync`).

        Raises:
            ValueError: a sequence longer than ``max_seq_len`` on a decode graph step.
        """
        if not self._warming_up:
            self._served = True
        fix = self._inflight_fix(seqs) if self._inflight_tokens is not None else None
        sync, self.input_sync = self.input_sync, None
        if sync is not None:
            fix = sync.wrap(fix)
        if self.lora is not None and self.lora.prepare(seqs):  # adapters: eager (module docstring)
            return self._execute_eager(seqs, fix)
        if self.graphs is not None and self.graphs.can_run(seqs):
            logits = self.graphs.run(seqs) if fix is None else self.graphs.run(seqs, fix_inputs=fix)
            return logits, list(range(len(seqs)))
        if self.prefill_graphs is not None and self.prefill_graphs.can_run(seqs):
            return self.prefill_graphs.run(seqs) if fix is None else self.prefill_graphs.run(seqs, fix_inputs=fix)
        return self._execute_eager(seqs, fix)

    def _execute_eager(self, seqs: list[ScheduledSeq], fix) -> tuple[torch.Tensor, list[int]]:
        ids, pos, meta, sample_idx, sample_t = self._prepare(seqs)
        if self.lora is not None:
            self.lora.pad_to(ids.shape[0])  # padded tokens (`prefill_pad_buckets`) have no adapter
        if fix is not None:
            fix(ids)
        hidden = self._forward(ids, pos, meta, self.kv_caches)
        if not sample_idx:
            return torch.empty(0, self.cfg.vocab_size, device=self.device), []
        if len(sample_idx) != hidden.shape[0]:
            hidden = hidden.index_select(0, sample_t)
        return self.model.compute_logits(hidden), sample_idx

    @torch.inference_mode()
    def warm_up_eager(self) -> int:
        """Run eager mixed steps of representative shapes once, so that Triton compiles their kernel
        specializations at start-up and not in the middle of serving. Returns the steps run (0 when
        nothing fits); a failure is logged, never raised (serving then compiles on first use).

        CUDA-graph capture compiles what the graphs launch, but a step the graphs do not cover (a
        mixed step past the largest prefill graph) sends its decode rows to the decode attention with
        context splits of its own: `_decode_kernel` and `_reduce_kernel` variants follow the split
        count (``SPLITS_PAD``, warps), whether the step uses PDL (at most ``PDL_MAX_ROWS`` sequences)
        and whether the batch fills the GPU; and the greedy rows' arg-max runs outside every graph.
        Without this pass, the first run of `benchmarks/lab/gpu_concurrency.py` on an H200 spent
        0.2-1.0 s compiling at concurrency 1, 4 and 16.

        The steps, eager whatever their size (no graph, no graph padding):
        - a 2-token prefill chunk plus ``s - 1`` decode rows for ``s`` = 2, 3, 5, 9, 17, 33, 65 sequences
          (at most ``max_batch_size``), the rows at contexts of 64, 128, ..., 4,096 keys (the KV pool
          and ``max_seq_len`` allowing), i.e. every split count class;
        - a chunk one token past the largest prefill graph (at least 64 tokens, within
          ``max_num_tokens``) with 1 and with 64 decode rows, through `execute` (the prefill kernel's
          eager launch, the full-batch decode launch);
        then a greedy arg-max over each step's sampled rows. The decode rows share one block table
        and the chunks start at block 0: the steps write keys and values into blocks that no
        sequence holds before the first step, and every real sequence writes each position before
        reading it. Sequence ids are negative (never the scheduler's). No block is allocated and no
        graph is touched. An out-of-memory error or a compile failure ends the warm-up with a
        warning; other CUDA errors (the context is then unusable) are raised.

        Raises:
            RuntimeError: called after the runner's first real step (`execute`), when KV blocks may
                hold cached prefixes that the warm-up would overwrite.
        """
        from kvpilot.sampling.sampler import greedy_ids

        if self._served:
            raise RuntimeError("warm_up_eager runs before the first step only: it writes into KV blocks "
                               "that cached prefixes may hold")
        t0 = time.perf_counter()
        B = self.block_size
        max_ctx = min(self.max_seq_len - 1, (self.num_blocks - 1) * B)
        if max_ctx < 2 or self.max_num_tokens < 66:
            return 0
        sid = [0]

        def step(chunk: int, rows: int, ctx: int, eager: bool) -> None:
            sid[0] -= rows + 1
            seqs = [ScheduledSeq(sid[0], [1] * chunk, 0, list(range(-(-chunk // B))), True)]
            shared = list(range(-(-ctx // B)))
            seqs += [ScheduledSeq(sid[0] - 1 - i, [1], ctx - 1, shared, True) for i in range(rows)]
            if eager:
                ids, pos, meta, _, sample_t = self._prepare(seqs, pad_ok=False)
                hidden = self._forward(ids, pos, meta, self.kv_caches)
                logits = self.model.compute_logits(hidden.index_select(0, sample_t))
            else:
                logits, _ = self.execute(seqs)
            greedy_ids(logits, use_triton=None if self.tuning.triton_sampler else False)

        steps = 0
        self._warming_up = True
        try:
            contexts = [c for c in (64, 128, 256, 512, 1024, 2048, 4096) if c <= max_ctx] or [max_ctx]
            for s in (2, 3, 5, 9, 17, 33, 65):
                if s <= self.max_batch_size:
                    for ctx in contexts:
                        step(2, s - 1, ctx, True)
                        steps += 1
            graph_top = self.prefill_graphs.max_tokens if self.prefill_graphs is not None else 0
            chunk = min(max(graph_top + 1, 64), self.max_num_tokens - 64, max_ctx)
            for rows in (1, 64):
                if rows < self.max_batch_size:
                    step(chunk, rows, contexts[-1], False)
                    steps += 1
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - a warm-up must never keep a healthy engine from serving
            if "CUDA error" in str(e) and not isinstance(e, torch.OutOfMemoryError):
                raise  # a sticky CUDA error: the first real request would fail far from the cause
            logger.warning("warm-up failed after %d steps; kernels compile on first use instead", steps,
                           exc_info=True)
            if isinstance(e, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
            return steps
        finally:
            self._warming_up = False
        logger.info("warm-up: %d eager steps in %.1f s", steps, time.perf_counter() - t0)
        return steps

    def shutdown(self) -> None:
        """Drop graphs, KV pool and weights so their device memory can be reused in this process."""
        self.graphs = self.prefill_graphs = None
        self.kv_caches = []
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
