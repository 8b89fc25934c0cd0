"""Compile every Triton kernel of ``kvpilot.kernels`` for an H200 (sm_90) on a machine without a GPU.

``make test`` runs the kernels under ``TRITON_INTERPRET=1``, which never compiles them: a kernel can
pass every CPU test and still fail to compile on the GPU (e.g. a specialization whose branch the
interpreter never executes). This script compiles them for real, down to a cubin through ptxas,
against a fake CUDA driver that reports an sm_90 target:

1. ``JITFunction.run`` is patched so that every launch ``kernel[grid](...)`` becomes a compile-only
   warm-up: nothing runs, outputs stay uninitialised (CPU tensors only provide dtypes, strides and
   alignment, which are what Triton specialises on).
2. The PUBLIC wrappers of every kernel module are called with CPU tensors in the shapes and dtypes
   the engine uses on the GPU (Llama-3.1-8B, bf16 activations, bf16 and FP8 KV caches, decode and
   prefill with and without context splits, every sampler row kind, GEMV at M = 1, 2, 8, plus one
   GPU's slice at tensor parallelism 8), so each wrapper compiles exactly the specializations it
   would launch on the H200.
3. Every compiled specialization is printed (kernel, constexprs, pointer dtypes, the arguments
   Triton specialised as 1 or found not 16-aligned, registers and spill bytes from ``ptxas -v``,
   shared memory, seconds; registers only when ptxas ran, i.e. not from a warm cache). Failures
   are collected, not raised: the script goes on and at the end lists every failure and exits 1.
   It also fails when a ``@triton.jit`` kernel defined in
   ``kernels/*.py`` was never compiled (a new kernel without a case here), unless it is a helper
   called from a compiled kernel (helpers are compiled as part of their callers), and when a
   specialization needs more shared memory or registers than an H200 block can have (Triton would
   refuse the launch).

Where a wrapper picks its GPU path from the device (``is_cuda`` / ``device.type``), the GPU value is
forced (see ``GPU_CONSTEXPRS`` and ``_patch_gpu_paths``), so the GPU path is the one compiled.

Usage (never with ``/work/main`` as the current directory: ``operator/`` shadows the stdlib)::

    cd /tmp && /path/to/.venv/bin/python /path/to/tools/compile_kernels.py \
        [--only SUBSTR ...] [--jobs N] [--list] [--self-test]

``TRITON_INTERPRET`` is removed from the environment here, before Triton is imported. Compiled
kernels go to Triton's cache (``TRITON_CACHE_DIR``, default ``~/.triton/cache``); point it at an
empty directory to really compile (``tests/kernels/test_compile.py`` does). Exit status: 0 when
everything compiled, 1 on any failure, 2 on bad arguments, 3 (with a line starting "SKIP") when
this Triton has no ptxas for sm_90.

Limits: the compiler is the one installed here (the venv's Triton, 3.9 when written), not the GPU
machine's (3.6): a front-end difference between versions can still make one compile and the other
fail. Nothing checks values; the GPU tests do that.
"""

from __future__ import annotations

import os

# Must happen before triton is imported: with TRITON_INTERPRET=1, @triton.jit builds interpreter
# objects that never compile. (The engine's GPU Triton, 3.6, fuses FP multiply-adds by default;
# setting the knob also silences Triton 3.9's warning about that default changing.)
os.environ.pop("TRITON_INTERPRET", None)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import argparse  # noqa: E402
import ast  # noqa: E402
import contextlib  # noqa: E402
import importlib  # noqa: E402
import io  # noqa: E402
import math  # noqa: E402
import pkgutil  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Callable  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# ---- the target: one H200 ----------------------------------------------------------------------
H200_CAPABILITY = 90
H200_SMS = 132
H200_MAX_SHARED = 232448  # bytes per block (cudaDevAttrMaxSharedMemoryPerBlockOptin), what Triton checks
H200_REGS_PER_BLOCK = 65536

# ---- the model: Llama-3.1-8B ----------------------------------------------------------------------
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4096, 32, 8, 128, 14336, 128256
BLOCK_SIZE = 32  # KvCacheConfig.tokens_per_block default
EPS = 1e-5
BF16 = torch.bfloat16


class FakeCudaDriver(DriverBase):
    """A Triton driver that reports an sm_90 CUDA device, so ``JITFunction.run`` compiles for it.

    It can compile, never launch: the patched ``run`` (``_compile_only``) always passes
    ``warmup=True``. Tensors stay on the CPU; Triton only reads their dtypes, data pointers
    (alignment) and strides.
    """

    def __init__(self):
        self.target = GPUTarget("cuda", H200_CAPABILITY, 32)

    @staticmethod
    def is_active():
        return True

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_device_interface(self):
        return torch.cuda

    def get_benchmarker(self):
        raise NotImplementedError("compile-only driver: nothing can be timed")

    def map_python_to_cpp_type(self, ty):
        from triton.backends.nvidia.driver import ty_to_cpp

        return ty_to_cpp(ty)


# Constexprs whose value a wrapper derives from the device, not from shapes or dtypes: the value
# it passes on a CUDA device. (module, constexpr) -> value.
GPU_CONSTEXPRS = {
    # paged_attention_triton: dot_fp32 = q.dtype == bf16 and not q.is_cuda (the CPU interpreter's
    # bf16 tl.dot is wrong); on CUDA, bf16 and FP8 tiles go to tl.dot in bf16.
    ("kvpilot.kernels.prefill_attention", "DOT_FP32"): False,
    ("kvpilot.kernels.decode_attention", "DOT_FP32"): False,
    ("kvpilot.kernels.fused_decode_attention", "DOT_FP32"): False,
    # sampling.draw: precise = dev.type == "cuda" and libdevice is not None and not interpreting.
    ("kvpilot.kernels.sampling", "PRECISE"): True,
}


@dataclass
class Spec:
    """One specialization compiled (or not) by one launch."""

    kernel: str  # "module_short.fn_name"
    constexprs: dict
    dtypes: str  # dtypes of the tensor arguments
    args: str  # how Triton specialised the other arguments (see _arg_spec)
    options: str
    key: tuple = ()  # identifies the specialization (what Triton caches it under, roughly)
    seconds: float = 0.0
    error: str = ""
    regs: int | None = None
    spill_bytes: int | None = None
    shared: int | None = None

    def line(self) -> str:
        ce = " ".join(f"{k}={v}" for k, v in self.constexprs.items())
        res = ""
        if self.regs is not None:
            res = f" regs={self.regs} spill={self.spill_bytes}B"
        if self.shared is not None:
            res += f" smem={self.shared}B"
        status = "FAIL" if self.error else "ok  "
        parts = [status, self.kernel, f"[{ce}]", f"ptrs={self.dtypes}", self.args, self.options, res.strip(),
                 f"{self.seconds:.2f}s"]
        return " ".join(p for p in parts if p)

    def failure(self) -> str:
        return f"{self.line()}\n      " + self.error.replace("\n", "\n      ")


@dataclass
class Report:
    """What the launches of one process (or one case, in a worker) compiled."""

    specs: list[Spec] = field(default_factory=list)  # new specializations, failed ones included
    case_failures: list[str] = field(default_factory=list)  # wrappers that raised outside a compile
    overrides_used: set = field(default_factory=set)  # GPU_CONSTEXPRS keys applied
    seen: set = field(default_factory=set)  # Spec.key of every specialization tried


REPORT = Report()


def _dtype_name(t: torch.Tensor) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4m3",
            torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.bool: "i1"}.get(t.dtype, str(t.dtype))


def _arg_spec(fn: JITFunction, args: tuple, kwargs: dict) -> tuple[str, tuple]:
    """(summary, key) of Triton's specialization of the non-constexpr arguments of one launch.

    Triton compiles separately for integers equal to 1 (made constants) and for pointers and
    integers that are, or are not, multiples of 16 (bytes or value). The summary names the
    arguments that are 1 (``n=1``) and those that are not multiples of 16 (``not16=a,b``); the
    key is the whole specialization. Empty when Triton's binder is not the expected one.
    """
    try:
        binder = fn.device_caches[0][4]
        _, specialization, _ = binder(*args, **kwargs)
    except Exception:  # noqa: BLE001 - only a summary; the compile below reports real errors
        return "", ()
    ones, not16 = [], []
    for p, (ty, attr) in zip(fn.params, specialization):
        if p.is_constexpr:
            continue
        if ty == "constexpr":
            ones.append(f"{p.name}={attr}")
        elif attr == "" and (ty.startswith("*") or ty[0] in "iu"):
            not16.append(p.name)
    summary = " ".join(ones) + (" not16=" + ",".join(not16) if not16 else "")
    return summary.strip(), tuple(map(tuple, specialization[: len(fn.params)]))


def _short_error(e: Exception) -> str:
    """A compile error in a few lines: its first line (the kernel position), then the last three
    (the source line, the caret, the message)."""
    lines = f"{type(e).__name__}: {e}".strip().splitlines()
    return "\n".join(lines if len(lines) <= 4 else [lines[0], "...", *lines[-3:]])


def _ptxas_usage(log: str) -> tuple[int | None, int | None]:
    """(registers, spill store bytes) from the ``ptxas -v`` log of one kernel, or Nones."""
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return (int(regs.group(1)) if regs else None, int(spill.group(1)) if spill else None)


def _compile_only(self: JITFunction, *args, grid, warmup, **kwargs):
    """Replacement of ``JITFunction.run``: compile the launch's specialization, never launch it.

    Records one ``Spec`` per new specialization; a compile error is recorded, not raised, so the
    wrapper (and the script) go on. Returns the compiled kernel, or None after an error.
    """
    module = self.module
    for (mod, name), value in GPU_CONSTEXPRS.items():
        if mod == module and name in kwargs:
            kwargs[name] = value
            REPORT.overrides_used.add((mod, name))
    names = [p.name for p in self.params]
    const_names = {p.name for p in self.params if p.is_constexpr}
    bound = dict(zip(names, args))
    bound.update(kwargs)
    constexprs = {k: bound[k] for k in names if k in const_names and k in bound}
    dtypes = ",".join(sorted({_dtype_name(v) for v in bound.values() if isinstance(v, torch.Tensor)}))
    options = " ".join(f"{k}={kwargs[k]}" for k in ("num_warps", "num_stages", "enable_fp_fusion") if k in kwargs)
    kernel_name = _name(self)
    arg_summary, arg_key = _arg_spec(self, args, kwargs)
    spec = Spec(kernel_name, constexprs, dtypes, arg_summary, options,
                key=(kernel_name, repr(constexprs), dtypes, repr(arg_key), options))

    cache = self.device_caches[0][0]
    before = len(cache)
    log = io.StringIO()
    t0 = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):  # TRITON_DUMP_PTXAS_LOG prints ptxas -v here
            kernel = _ORIGINAL_RUN(self, *args, grid=grid, warmup=True, **kwargs)
    except Exception as e:  # noqa: BLE001 - every compile error is a finding; keep going
        if spec.key not in REPORT.seen:  # a failed compile is not cached: report it once
            REPORT.seen.add(spec.key)
            spec.seconds = time.perf_counter() - t0
            spec.error = _short_error(e)
            REPORT.specs.append(spec)
            print(spec.failure(), flush=True)
        return None
    if len(cache) == before:  # this specialization was compiled by an earlier launch
        return kernel
    REPORT.seen.add(spec.key)
    spec.seconds = time.perf_counter() - t0
    spec.regs, spec.spill_bytes = _ptxas_usage(log.getvalue())
    spec.shared = getattr(kernel.metadata, "shared", None)
    problems = []
    if spec.shared is not None and spec.shared > H200_MAX_SHARED:
        problems.append(f"needs {spec.shared} B of shared memory, an H200 block has {H200_MAX_SHARED}")
    warps = getattr(kernel.metadata, "num_warps", None)
    if spec.regs is not None and warps and spec.regs * 32 * warps > H200_REGS_PER_BLOCK:
        problems.append(f"{spec.regs} registers x {32 * warps} threads exceed {H200_REGS_PER_BLOCK}")
    if problems:
        spec.error = "; ".join(problems)
    REPORT.specs.append(spec)
    print(spec.failure() if spec.error else spec.line(), flush=True)
    return kernel


_ORIGINAL_RUN = JITFunction.run


def install() -> None:
    """Activate the fake sm_90 driver and the compile-only ``JITFunction.run``; ask for ptxas logs."""
    triton.runtime.driver.set_active(FakeCudaDriver())
    JITFunction.run = _compile_only
    from triton import knobs

    knobs.nvidia.dump_ptxas_log = True


def _patch_gpu_paths() -> None:
    """Make the wrappers take the decisions they take on an H200 from CPU tensors.

    - ``attention_common._device_sms`` returns 4 for CPU tensors (so the interpreter tests exercise the
      split path); the split heuristics (``NUM_SPLITS`` constexpr) need the H200's 132 SMs.
    - ``gemv._sm_count`` likewise (it only sizes the persistent grid, not a constexpr).
    Constexprs derived from the device itself are forced in ``_compile_only`` (``GPU_CONSTEXPRS``).
    """
    from kvpilot.kernels import attention, gemv
    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401

    attention_common._device_sms = lambda device: H200_SMS
    gemv._sm_count = lambda device: H200_SMS


# ---- cases: the wrappers, called as the engine calls them on the GPU ----------------------------
@dataclass(frozen=True)
class Shard:
    """One GPU's slice of Llama-3.1-8B under tensor parallelism ``tp`` (as LlamaAttention and
    LlamaMLP split it): query heads, kv heads and intermediate columns per GPU."""

    tp: int = 1

    @property
    def heads(self) -> int:
        return HEADS // self.tp

    @property
    def kv_heads(self) -> int:
        return max(1, KV_HEADS // self.tp)

    @property
    def inter(self) -> int:
        return INTER // self.tp


def _qkv(sh: Shard, tokens: int):
    """q [T, heads, 128], k and v [T, kv_heads, 128] bf16: strided views of one fused QKV output,
    as in LlamaAttention.forward."""
    sizes = [sh.heads * HEAD_DIM, sh.kv_heads * HEAD_DIM, sh.kv_heads * HEAD_DIM]
    q, k, v = torch.empty(tokens, sum(sizes), dtype=BF16).split(sizes, dim=-1)
    return (q.reshape(tokens, sh.heads, HEAD_DIM), k.reshape(tokens, sh.kv_heads, HEAD_DIM),
            v.reshape(tokens, sh.kv_heads, HEAD_DIM))


def _kv_cache(sh: Shard, dtype: torch.dtype, num_blocks: int = 256):
    """(k_cache, v_cache) [num_blocks, 32, kv_heads, 128]: the two halves of one layer's
    ``[2, num_blocks, block_size, kv_heads, head_dim]`` cache, as the model runner allocates it."""
    kv = torch.empty(2, num_blocks, BLOCK_SIZE, sh.kv_heads, HEAD_DIM, dtype=dtype)
    return kv[0], kv[1]


def _batch(q_lens: list[int], ctx_lens: list[int]):
    """Attention metadata as ModelRunner._prepare builds it: block tables, seq_lens and
    query_start_loc int32, slot mapping and positions int64 (valid slots; contents irrelevant)."""
    seq_lens = [q + c for q, c in zip(q_lens, ctx_lens)]
    width = max(triton.cdiv(s, BLOCK_SIZE) for s in seq_lens)
    tables = torch.arange(len(q_lens) * width, dtype=torch.int32).reshape(len(q_lens), width)
    qsl = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(q_lens), 0)
    pos = torch.cat([torch.arange(c, c + q) for q, c in zip(q_lens, ctx_lens)]).to(torch.int64)
    return dict(block_tables=tables, seq_lens=torch.tensor(seq_lens, dtype=torch.int32), query_start_loc=qsl,
                max_query_len=max(q_lens), max_seq_len=max(seq_lens), positions=pos, slot_mapping=pos.clone())


def _attention(sh: Shard, q_lens, ctx_lens, kv_dtype, **window):
    """``window``: ``sliding_window`` / ``logits_soft_cap`` keywords of the launch."""
    def case():
        from kvpilot.kernels.attention import paged_attention_triton

        b = _batch(q_lens, ctx_lens)
        q, _, _ = _qkv(sh, sum(q_lens))
        k_cache, v_cache = _kv_cache(sh, kv_dtype, num_blocks=b["block_tables"].numel())
        paged_attention_triton(q, k_cache, v_cache, b["block_tables"], b["seq_lens"], b["query_start_loc"],
                               HEAD_DIM ** -0.5, b["max_query_len"], b["max_seq_len"], **window)

    return case


def _rotary_write(sh: Shard, tokens, kv_dtype):
    def case():
        from kvpilot.kernels import apply_rotary_triton, rotary_write_kv_cache_triton, write_kv_cache_triton

        b = _batch([tokens], [0])
        cos_sin = torch.empty(8192, HEAD_DIM, dtype=torch.float32)  # build_rope_cache: fp32
        q, k, v = _qkv(sh, tokens)
        k_cache, v_cache = _kv_cache(sh, kv_dtype)
        rotary_write_kv_cache_triton(q, k, v, b["positions"], cos_sin, k_cache, v_cache, b["slot_mapping"])
        # kvpilot.kernels.rotary_write_kv_cache's fallback when the fused kernel fails: two launches.
        q, k = apply_rotary_triton(q, k, b["positions"], cos_sin)
        write_kv_cache_triton(k, v, k_cache, v_cache, b["slot_mapping"])

    return case


def _rotary_decode(sh: Shard, ctx_lens, kv_dtype, **window):
    """The fused rotary + KV write + decode attention of a decode-only batch (one token per sequence);
    ``window`` as for `_attention`."""
    def case():
        from kvpilot.kernels.fused_decode_attention import rotary_decode_attention_triton

        b = _batch([1] * len(ctx_lens), ctx_lens)
        cos_sin = torch.empty(8192, HEAD_DIM, dtype=torch.float32)
        q, k, v = _qkv(sh, len(ctx_lens))
        k_cache, v_cache = _kv_cache(sh, kv_dtype, num_blocks=b["block_tables"].numel())
        rotary_decode_attention_triton(q, k, v, b["positions"], cos_sin, k_cache, v_cache, b["slot_mapping"],
                                       b["block_tables"], b["seq_lens"], b["query_start_loc"], HEAD_DIM ** -0.5,
                                       b["max_seq_len"], **window)

    return case


def _pointwise(sh: Shard, tokens):
    def case():
        from kvpilot.kernels import gelu_tanh_and_mul_triton, rms_norm_triton, silu_and_mul_triton

        x = torch.empty(tokens, HIDDEN, dtype=BF16)
        w = torch.empty(HIDDEN, dtype=BF16)  # RMSNorm weights are cast to the model dtype
        rms_norm_triton(x, w, EPS)  # first layer's input norm
        rms_norm_triton(x, w, EPS, torch.empty_like(x))  # fused residual add
        silu_and_mul_triton(torch.empty(tokens, 2 * sh.inter, dtype=BF16))
        gelu_tanh_and_mul_triton(torch.empty(tokens, 2 * sh.inter, dtype=BF16))  # GeGLU (Gemma)

    return case


def _gemv(sh: Shard, m):
    def case():
        from kvpilot.kernels import gemv as G

        x = torch.empty(m, HIDDEN, dtype=BF16)
        nw = torch.empty(HIDDEN, dtype=BF16)
        w_qkv = torch.empty((sh.heads + 2 * sh.kv_heads) * HEAD_DIM, HIDDEN, dtype=BF16)
        w_gate_up = torch.empty(2 * sh.inter, HIDDEN, dtype=BF16)
        w_o = torch.empty(HIDDEN, sh.heads * HEAD_DIM, dtype=BF16)
        w_down = torch.empty(HIDDEN, sh.inter, dtype=BF16)
        G.rmsnorm_gemv_triton(x, torch.empty_like(x), nw, EPS, w_qkv)  # input norm + qkv
        G.rmsnorm_gemv_triton(x, None, nw, EPS, w_qkv)  # first layer: no residual yet
        G.rmsnorm_gemv_triton(x, torch.empty_like(x), nw, EPS, w_gate_up)  # post-attention norm + gate_up
        a_o = torch.empty(m, sh.heads * HEAD_DIM, dtype=BF16)
        G.gemv_triton(a_o, w_o)  # o_proj
        G.gemv_triton(a_o, w_o, torch.empty(HIDDEN, dtype=BF16))  # o_proj of a model with attention_bias
        G.silu_mul_gemv_triton(torch.empty(m, 2 * sh.inter, dtype=BF16), w_down)  # down_proj
        # tensor parallelism's row-parallel layers: the fp32 accumulator stored unrounded
        G.gemv_triton(a_o, w_o, out_dtype=torch.float32)
        G.silu_mul_gemv_triton(torch.empty(m, 2 * sh.inter, dtype=BF16), w_down, out_dtype=torch.float32)
        G.gelu_tanh_mul_gemv_triton(torch.empty(m, 2 * sh.inter, dtype=BF16), w_down)  # GeGLU down_proj

    return case


# Sampler rows: (temperature, top_k, top_p, min_p). g = greedy, t = plain temperature, k = top-k,
# p = top-p, m = min-p, a = all three.
_ROW_KINDS = {"g": (0.0, 0, 1.0, 0.0), "t": (0.8, 0, 1.0, 0.0), "k": (0.7, 50, 1.0, 0.0),
              "p": (1.0, 0, 0.9, 0.0), "m": (1.0, 0, 1.0, 0.05), "a": (0.6, 20, 0.95, 0.01)}


def _draw_inputs(kinds: str):
    """(fprm, iprm, plain_rows, filtered_rows) for ``sampling.draw``, one row per letter of ``kinds``.

    Laid out as the engine's sampler sends them (engine/sampling/sampler.py, ``_Draw.tensors``): fprm
    [S, 4] float32 (temperature, top_p, log(min_p) or -inf, 0); iprm [S, 4] int64 (top_k, seed,
    step, 0) and the row order (plain and greedy rows, then filtered ones) as views of one int64
    buffer. Built here from draw()'s documented contract rather than by calling the sampler, so
    that a refactor of the engine's host code does not break this check.
    """
    params = [_ROW_KINDS[c] for c in kinds]
    S = len(params)
    fprm = torch.zeros(S, 4, dtype=torch.float32)
    ints = torch.zeros(5 * S, dtype=torch.int64)
    iprm = ints[: 4 * S].view(S, 4)
    for i, (temp, top_k, top_p, min_p) in enumerate(params):
        fprm[i, :3] = torch.tensor([temp, top_p, math.log(min_p) if min_p > 0 else float("-inf")])
        iprm[i, :3] = torch.tensor([top_k, 1000 + i, 3])
    filtered = [i for i, (temp, top_k, top_p, min_p) in enumerate(params)
                if temp > 0 and (top_k > 0 or top_p < 1 or min_p > 0)]
    plain = [i for i in range(S) if i not in filtered]
    ints[4 * S:] = torch.tensor(plain + filtered)
    order = ints[4 * S:]
    return fprm, iprm, order[: len(plain)], order[len(plain):]


def _sampling_draw(kinds: str, config: dict | None = None):
    """``sampling.draw`` on rows of ``kinds``, under ``sampling.CONFIG`` overrides ``config`` (e.g.
    the fused pivot passes, or the pivot path off: top-p/min-p rows through the window path)."""
    def case():
        from kvpilot.kernels import sampling

        fprm, iprm, plain, filtered = _draw_inputs(kinds)
        if (plain.numel() > 0, filtered.numel() > 0) != (any(c in "gt" for c in kinds),
                                                          any(c in "kpma" for c in kinds)):
            raise AssertionError(f"rows {kinds!r} split into {plain.numel()} plain and {filtered.numel()} filtered")
        logits = torch.empty(len(kinds), VOCAB, dtype=torch.float32)  # compute_logits: fp32
        saved = dict(sampling.CONFIG)
        sampling.CONFIG.update(config or {})
        try:
            # Top-k rows first, then the top-p/min-p-only ones: the engine's order (`_Draw`).
            k = [int(r) for r in filtered if int(iprm[int(r), 0]) > 0]
            rest = [int(r) for r in filtered if int(iprm[int(r), 0]) == 0]
            filtered = torch.tensor(k + rest, dtype=torch.int64)
            sampling.draw(logits, fprm, iprm, plain, filtered, n_pivot=len(rest))
        finally:
            sampling.CONFIG.clear()
            sampling.CONFIG.update(saved)

    return case


def _sampling_logprobs(num_rows: int, n: int):
    def case():
        from kvpilot.kernels import sampling

        logits = torch.empty(num_rows + 1, VOCAB, dtype=torch.float32)
        # As Sampler.__call__: one int64 [2, R] tensor of (rows, chosen tokens).
        idx = torch.tensor([list(range(num_rows)), [7 * i for i in range(num_rows)]], dtype=torch.int64)
        sampling.raw_logprobs(logits, idx[0], idx[1], n)

    return case


def _sampling_argmax(num_rows: int, dtype: torch.dtype):
    def case():
        from kvpilot.kernels import sampling

        sampling.argmax(torch.empty(num_rows, VOCAB, dtype=dtype))  # greedy rows (kvpilot.sampling.sampler.greedy_ids)

    return case


def _sampling_penalties(rep_on: bool, freq_on: bool):
    def case():
        from kvpilot.kernels import sampling

        P, slots_n = 3, 8
        logits = torch.empty(P + 1, VOCAB, dtype=torch.float32)
        rows = torch.arange(P, dtype=torch.int64)
        slots = torch.tensor([5, 0, 7], dtype=torch.int64)  # rows of the per-sequence token counts
        counts = torch.empty(slots_n, VOCAB, dtype=torch.int32)
        pen = torch.empty(P, 3, dtype=torch.float32)  # repetition, frequency, presence
        sampling.apply_penalties(logits, rows, slots, counts, pen, rep=rep_on, freq=freq_on)

    return case


def _all_reduce(tokens: int, dtype: torch.dtype):
    def case():
        from kvpilot.kernels.allreduce import empty_receive_buffer, two_rank_all_reduce

        # o_proj / down_proj partial sums (bf16, or float32 with Tuning(tp_reduce_fp32=True)), one site's buffers
        recv = empty_receive_buffer(64 * HIDDEN, "cpu")
        two_rank_all_reduce(torch.empty(tokens, HIDDEN, dtype=dtype), recv, empty_receive_buffer(64 * HIDDEN, "cpu"))

    return case


def _with_pdl(mode: int, case: Callable[[], None]) -> Callable[[], None]:
    """``case`` with programmatic dependent launch (kernels/pdl.py) forced to ``mode`` in every
    kernel module that launches with it (on a CPU tensor the wrappers would pick 0)."""
    def run():
        from kvpilot.kernels import allreduce, decode_attention, fused_decode_attention, gemv, kv_cache, pointwise

        mods = (allreduce, decode_attention, fused_decode_attention, gemv, kv_cache, pointwise)
        saved = [m.pdl_mode for m in mods]
        for m in mods:
            m.pdl_mode = lambda device, rows: mode
        try:
            case()
        finally:
            for m, f in zip(mods, saved):
                m.pdl_mode = f

    return run


def _with_decode_tuning(case: Callable[[], None], **overrides) -> Callable[[], None]:
    """``case`` with ``kernels.attention.TUNING["decode"]`` updated by ``overrides`` (restored after)."""
    def run():
        from kvpilot.kernels import attention
        from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401

        saved = dict(attention.TUNING["decode"])
        attention.TUNING["decode"].update(overrides)
        try:
            case()
        finally:
            attention.TUNING["decode"].clear()
            attention.TUNING["decode"].update(saved)

    return run



def _fused_moe(tokens: int, path: str):
    def case():
        from kvpilot.kernels import fused_moe as FM

        E, H, I, K = 128, 2048, 768, 8
        x = torch.empty(tokens, H, dtype=BF16)
        w13, w2 = torch.empty(E, 2 * I, H, dtype=BF16), torch.empty(E, H, I, dtype=BF16)
        ids = (torch.arange(tokens * K, dtype=torch.int32).reshape(tokens, K) * 7) % E
        FM.fused_moe_triton(x, w13, w2, torch.full((tokens, K), 1.0 / K), ids, path=path)

    return case


def _fp8_gemv(m: int, block):
    def case():
        from kvpilot.kernels import fp8_gemv

        n, k = 6144, 4096  # the 8B shape's q/k/v projection
        w = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        scale = torch.ones(n // 128, k // 128) if block else torch.ones(n)
        fp8_gemv.fp8_gemv_triton(torch.empty(m, k, dtype=BF16), w, scale, block=block)

    return case


def _fp8_quantize_rows():
    def case():
        from kvpilot.kernels import fp8_gemv

        x = torch.empty(8, 4096, dtype=BF16)
        fp8_gemv.quantize_rows_triton(x)
        fp8_gemv.quantize_rows_triton(x, torch.ones(1))

    return case

def cases() -> list[tuple[str, Callable[[], None]]]:
    """(label, function) of every case, in compile order."""
    out = []
    one, tp8 = Shard(1), Shard(8)
    for dt, dn in ((BF16, "bf16"), (torch.float8_e4m3fn, "fp8")):
        # Decode: 1 sequence of 4,000 tokens is 8 programs -> 16 context splits on 132 SMs;
        # 64 sequences are 512 programs -> no split.
        out.append((f"attention decode {dn} kv, split", _attention(one, [1], [3999], dt)))
        out.append((f"attention decode {dn} kv, no split", _attention(one, [1] * 64, [1000] * 64, dt)))
        # The full-batch launch takes `_decode_tma_kernel` where TUNING switches it on for the dtype
        # (FP8 by default); the pointer kernel stays the fallback. Both TMA loop steps.
        out.append((f"attention decode {dn} kv, no split, pointer kernel",
                    _with_decode_tuning(_attention(one, [1] * 64, [1000] * 64, dt), batch_tma=False,
                                        batch_tma_fp8=False)))
        for pages in (1, 2):
            out.append((f"attention decode {dn} kv, no split, TMA {pages} page(s)",
                        _with_decode_tuning(_attention(one, [1] * 64, [1000] * 64, dt), batch_tma=True,
                                            batch_tma_fp8=True, batch_tma_pages=pages)))
        # Prefill: a 64-token chunk after a 4,000-token prefix -> splits; 4 x 512 new tokens plus
        # 3 decodes (a mixed batch) -> no split.
        out.append((f"attention prefill {dn} kv, split", _attention(one, [64], [4000], dt)))
        out.append((f"attention prefill {dn} kv, mixed, no split",
                    _attention(one, [512] * 4 + [1] * 3, [0, 100, 2000, 0] + [500] * 3, dt)))
        # Rotary + KV write: < 32 tokens split heads over programs, from 32 on one program per token.
        out.append((f"rotary+kv write {dn} kv, 1 token", _rotary_write(one, 1, dt)))
        out.append((f"rotary+kv write {dn} kv, 256 tokens", _rotary_write(one, 256, dt)))
        # Fused rotary + write + decode: 1 x 4,000 keys and 8 x 1,000 split; 8 x 40 keys do not.
        out.append((f"rotary+decode {dn} kv, split", _rotary_decode(one, [3999], dt)))
        out.append((f"rotary+decode {dn} kv, 8 seqs, split", _rotary_decode(one, [999] * 8, dt)))
        out.append((f"rotary+decode {dn} kv, 8 seqs, no split", _rotary_decode(one, [39] * 8, dt)))
    # Sliding window (Mistral / Gemma local layers) with Gemma 2's logit soft cap, and each alone.
    win = dict(sliding_window=1024, logits_soft_cap=50.0)
    for dt, dn in ((BF16, "bf16"), (torch.float8_e4m3fn, "fp8")):
        out.append((f"attention decode {dn} kv, split, window+cap", _attention(one, [1], [3999], dt, **win)))
        out.append((f"attention decode {dn} kv, no split, pointer kernel, window+cap",
                    _with_decode_tuning(_attention(one, [1] * 64, [1000] * 64, dt, **win), batch_tma=False,
                                        batch_tma_fp8=False)))
        for pages in (1, 2):
            out.append((f"attention decode {dn} kv, no split, TMA {pages} page(s), window+cap",
                        _with_decode_tuning(_attention(one, [1] * 64, [1000] * 64, dt, **win), batch_tma=True,
                                            batch_tma_fp8=True, batch_tma_pages=pages)))
        out.append((f"attention prefill {dn} kv, split, window+cap", _attention(one, [64], [4000], dt, **win)))
        out.append((f"attention prefill {dn} kv, mixed, window+cap",
                    _attention(one, [512] * 4 + [1] * 3, [0, 100, 2000, 0] + [500] * 3, dt, **win)))
        out.append((f"rotary+decode {dn} kv, split, window+cap", _rotary_decode(one, [3999], dt, **win)))
    out.append(("attention prefill bf16 kv, mixed, window", _attention(one, [512, 1], [0, 500], BF16,
                                                                       sliding_window=4096)))
    out.append(("attention decode bf16 kv, split, soft cap", _attention(one, [1], [3999], BF16,
                                                                        logits_soft_cap=50.0)))
    for t in (1, 256):  # RMSNorm's early weight load is on up to 64 rows
        out.append((f"rms_norm + silu_and_mul, {t} tokens", _pointwise(one, t)))
    for m in (1, 2, 8):
        out.append((f"gemv M={m}", _gemv(one, m)))
    # One GPU of tensor parallelism 8: 4 query heads and 1 kv head per GPU, K of down_proj 1792
    # (not a multiple of the GEMV's K tile).
    out.append(("tp=8 attention decode bf16 kv, split", _attention(tp8, [1], [3999], BF16)))
    out.append(("tp=8 attention prefill fp8 kv, mixed", _attention(tp8, [512, 1], [0, 500], torch.float8_e4m3fn)))
    out.append(("tp=8 rotary+kv write bf16 kv, 1 token", _rotary_write(tp8, 1, BF16)))
    out.append(("tp=8 rotary+decode bf16 kv, split", _rotary_decode(tp8, [3999], BF16)))
    out.append(("tp=8 rms_norm + silu_and_mul, 1 token", _pointwise(tp8, 1)))
    out.append(("tp=8 gemv M=1", _gemv(tp8, 1)))
    # The batch-1 decode chain with programmatic dependent launch (kernels/pdl.py, on by default).
    out.append(("pdl=1 gemv M=1", _with_pdl(1, _gemv(one, 1))))
    out.append(("pdl=1 attention decode fp8 kv, split", _with_pdl(1, _attention(one, [1], [3999], torch.float8_e4m3fn))))
    out.append(("pdl=1 rotary+kv write fp8 kv, 1 token", _with_pdl(1, _rotary_write(one, 1, torch.float8_e4m3fn))))
    out.append(("pdl=1 rotary+decode fp8 kv, split", _with_pdl(1, _rotary_decode(one, [3999], torch.float8_e4m3fn))))
    out.append(("pdl=1 rotary+decode bf16 kv, split", _with_pdl(1, _rotary_decode(one, [3999], BF16))))
    out.append(("pdl=1 rms_norm + silu_and_mul, 1 token", _with_pdl(1, _pointwise(one, 1))))
    # Tensor parallelism 2: the one-shot all-reduce (PDL at batch 1, not at 64 tokens)
    out.append(("pdl=1 two-rank all-reduce bf16, 1 token", _with_pdl(1, _all_reduce(1, BF16))))
    out.append(("two-rank all-reduce fp32, 64 tokens", _all_reduce(64, torch.float32)))
    for kinds in ("g", "gttg", "k", "kpma", "gtkpma"):
        out.append((f"sampling draw rows={kinds}", _sampling_draw(kinds)))
    out.append(("sampling draw rows=gkpm pivot fused", _sampling_draw("gkpm", {"pivot_fuse": 1})))
    out.append(("sampling draw rows=gkpm pivot off", _sampling_draw("gkpm", {"pivot_rounds": 0})))
    for n in (0, 1, 5, 32):
        out.append((f"sampling raw_logprobs n={n}", _sampling_logprobs(3, n)))
    out.append(("sampling argmax 1 row fp32", _sampling_argmax(1, torch.float32)))
    for rep_on, freq_on in ((True, True), (True, False), (False, True)):
        out.append((f"sampling apply_penalties rep={rep_on} freq={freq_on}", _sampling_penalties(rep_on, freq_on)))
    # Fused MoE (Qwen3-30B-A3B layer shape: 128 experts of 768, top 8, hidden 2048): the small-token
    # path at 1 and 8 tokens, the grouped path at 64 and 1,024.
    for t, path in ((1, "small"), (8, "small"), (64, "grouped"), (1024, "grouped")):
        out.append((f"fused moe {path}, {t} tokens", _fused_moe(t, path)))
    # FP8 weights: the GEMV at M = 1 and 8 with per-row and 128 x 128 block scales; the row quantizer.
    for m in (1, 8):
        for block in (None, (128, 128)):
            out.append((f"fp8 gemv M={m}, {'block' if block else 'per-row'} scales", _fp8_gemv(m, block)))
    out.append(("fp8 quantize rows, dynamic and static", _fp8_quantize_rows()))
    return out


# ---- coverage: every @triton.jit function of kernels/*.py --------------------------------------
def kernel_modules() -> list:
    """Every module of the ``kvpilot.kernels`` package (imported)."""
    import kvpilot.kernels as pkg

    return [importlib.import_module(f"{pkg.__name__}.{m.name}") for m in pkgutil.iter_modules(pkg.__path__)]


def jit_functions() -> dict[str, JITFunction]:
    """"module_short.name" -> JITFunction for every @triton.jit function defined in kernels/*.py."""
    found = {}
    for mod in kernel_modules():
        for obj in vars(mod).values():
            if isinstance(obj, JITFunction) and obj.module == mod.__name__:
                found[_name(obj)] = obj
    return found


def _name(fn: JITFunction) -> str:
    return f"{fn.module.rsplit('.', 1)[-1]}.{fn.fn.__name__}"


def _callees(fn: JITFunction) -> set[str]:
    """Names of the @triton.jit functions that ``fn``'s body calls (defined in its module or
    imported into it, e.g. ``pdl.pdl_enter``)."""
    names = {n.func.id for n in ast.walk(ast.parse(fn.src)) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    g = fn.fn.__globals__
    return {_name(g[n]) for n in names if isinstance(g.get(n), JITFunction)}


def coverage(compiled: set[str], fns: dict[str, JITFunction]) -> tuple[list[str], dict[str, str]]:
    """(functions of ``fns`` never compiled, {helper: a compiled kernel that calls it}).

    ``compiled`` holds the names (``_name``) of the kernels compiled (or tried). A helper is
    compiled inside every kernel that calls it, directly or through other helpers.
    """
    callees = {name: _callees(fn) for name, fn in fns.items()}
    inside: dict[str, str] = {}
    todo = [(k, k) for k in sorted(compiled)]
    while todo:
        name, root = todo.pop()
        for c in callees.get(name, ()):
            if c not in compiled and c not in inside:
                inside[c] = root
                todo.append((c, root))
    missing = sorted(n for n in fns if n not in compiled and n not in inside)
    return missing, inside


# ---- self-test: the checker itself finds what it should ----------------------------------------

@triton.jit
def _selftest_helper(x):
    return x + 1


@triton.jit
def _selftest_kernel(x_ptr, idx_ptr, n):
    # A pattern sampling.draw must avoid: a placeholder buffer of the wrong dtype makes a
    # loop-carried variable change type. Under TRITON_INTERPRET=1 with n = 0 this "works".
    best = tl.full((), 0, tl.int32)
    i = 0
    while i < n:
        best = tl.load(idx_ptr + i)
        i = _selftest_helper(i)
    tl.store(x_ptr, best.to(tl.float32))


@triton.jit
def _selftest_never(x_ptr):
    tl.store(x_ptr, 0.0)


def self_test() -> int:
    """Compile ``_selftest_kernel`` with a good and a bad placeholder dtype; check that exactly the
    bad one fails, and that the coverage check finds ``_selftest_never`` and the helper."""
    install()
    x = torch.empty(16, dtype=torch.float32)
    _selftest_kernel[(1,)](x, torch.empty(16, dtype=torch.int32), 0)
    _selftest_kernel[(1,)](x, x, 0)  # fp32 placeholder for an int32 buffer: must not compile
    fns = {_name(f): f for f in (_selftest_helper, _selftest_kernel, _selftest_never)}
    missing, inside = coverage({s.kernel for s in REPORT.specs}, fns)
    kernel = _name(_selftest_kernel)
    ok = [s for s in REPORT.specs if s.kernel == kernel and not s.error]
    bad = [s for s in REPORT.specs if s.kernel == kernel and s.error]
    checks = {
        "the int32 placeholder compiled": len(ok) == 1 and ok[0].dtypes == "fp32,i32",
        "the fp32 placeholder failed (loop-carried type)": len(bad) == 1 and "Loop-carried" in bad[0].error,
        "the failure was reported once": len(_failures(REPORT.specs)) == 1,
        "never-launched kernel found": missing == [_name(_selftest_never)],
        "helper found inside its caller": inside == {_name(_selftest_helper): kernel},
    }
    for what, good in checks.items():
        print(f"self-test: {'ok  ' if good else 'FAIL'} {what}")
    return 0 if all(checks.values()) else 1


# ---- main --------------------------------------------------------------------------------------
def _failures(specs: list[Spec]) -> list[str]:
    """One line (plus the error) per failed specialization, each specialization once."""
    out, seen = [], set()
    for sp in specs:
        if sp.error and sp.key not in seen:
            seen.add(sp.key)
            out.append(sp.failure())
    return out


def _run_cases(indices: list[int]) -> tuple[str, list[Spec], list[str], set]:
    """Run these cases of ``SELECTED``; return (their printed report, new specs, case failures,
    overrides used so far)."""
    start = len(REPORT.specs), len(REPORT.case_failures)
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        for index in indices:
            label, fn = SELECTED[index]
            print(f"== {label}")
            try:
                fn()
            except Exception:  # noqa: BLE001 - a wrapper failing outside a compile is a finding too
                tb = "\n      ".join(traceback.format_exc().strip().splitlines()[-8:])
                REPORT.case_failures.append(f"case {label!r} raised outside a compile:\n      {tb}")
                print(f"FAIL case raised:\n      {tb}")
    return (text.getvalue(), REPORT.specs[start[0]:], REPORT.case_failures[start[1]:], set(REPORT.overrides_used))


SELECTED: list[tuple[str, Callable[[], None]]] = []


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", default=None, metavar="SUBSTR",
                    help="run only the cases whose label contains one of these (skips the coverage check)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="worker processes compiling families of cases in parallel (default 1: on a busy "
                         "2-core machine 2 workers measured slower)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--self-test", action="store_true",
                    help="check that the checker catches a bad kernel and an uncompiled one, then exit")
    args = ap.parse_args(argv)

    from triton.backends.nvidia.compiler import get_ptxas

    try:
        get_ptxas(H200_CAPABILITY)
    except Exception as e:  # noqa: BLE001
        print(f"SKIP: no ptxas for sm_{H200_CAPABILITY}: {e}")
        return 3

    if args.self_test:
        return self_test()
    SELECTED[:] = [(label, fn) for label, fn in cases() if args.only is None or any(s in label for s in args.only)]
    if args.list:
        print("\n".join(label for label, _ in SELECTED))
        return 0
    if not SELECTED:
        print(f"no case matches {args.only}", file=sys.stderr)
        return 2
    install()
    _patch_gpu_paths()
    cache_dir = os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache")
    print(f"triton {triton.__version__}, target cuda sm_{H200_CAPABILITY}, cache {cache_dir}, {args.jobs} job(s)")
    t_start = time.perf_counter()
    specs: list[Spec] = []
    case_failures: list[str] = []
    overrides_used: set = set()
    # One task per family of cases (the label's first word): cases of a family share
    # specializations, which a worker then compiles once.
    families: dict[str, list[int]] = {}
    for i, (label, _) in enumerate(SELECTED):
        families.setdefault(label.split()[0], []).append(i)
    if args.jobs > 1 and len(families) > 1:
        import multiprocessing

        # fork: the workers inherit the fake driver, the patches and the imported kernels.
        with multiprocessing.get_context("fork").Pool(min(args.jobs, len(families))) as pool:
            results = list(pool.imap(_run_cases, families.values(), chunksize=1))
    else:
        results = [_run_cases([i for f in families.values() for i in f])]
    for text, case_specs, case_fail, used in results:
        print(text, end="", flush=True)
        specs += case_specs
        case_failures += case_fail
        overrides_used |= used

    # Workers may compile the same specialization twice: count each once.
    unique = list({sp.key: sp for sp in specs}.values())
    counts: dict[str, int] = {}
    for sp in unique:
        counts[sp.kernel] = counts.get(sp.kernel, 0) + 1
    print(f"\n== specializations per kernel ({time.perf_counter() - t_start:.1f} s in all)")
    for name in sorted(counts):
        failed = sum(1 for sp in unique if sp.kernel == name and sp.error)
        print(f"{name}: {counts[name]}" + (f" ({failed} failed)" if failed else ""))
    failures = _failures(specs) + case_failures
    if args.only is None:
        missing, inside = coverage({sp.kernel for sp in specs}, jit_functions())
        for helper in sorted(inside):
            print(f"{helper}: helper, compiled inside {inside[helper]}")
        for name in missing:
            failures.append(f"{name}: @triton.jit kernel never compiled (add a case to tools/compile_kernels.py)")
        for key in sorted(set(GPU_CONSTEXPRS) - overrides_used):
            failures.append(f"GPU_CONSTEXPRS entry {key} matched no launch: the wrapper changed; "
                            "check which path it now takes on CUDA")
    if failures:
        print(f"\n{len(failures)} FAILURE(S):")
        for f in failures:
            print(f"  {f}")
        return 1
    print(f"\nall {len(unique)} specializations of {len(counts)} kernels compiled for sm_{H200_CAPABILITY}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
