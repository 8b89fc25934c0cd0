"""Every Triton kernel compiles for an H200 (sm_90), checked on a machine without a GPU.

The other kernel tests run under ``TRITON_INTERPRET=1``, which never compiles a kernel, so a
specialization the interpreter never executes can still fail to compile on the GPU. These tests run
``tools/compile_kernels.py`` in a subprocess (without ``TRITON_INTERPRET``, with an empty Triton
cache, from a directory where the repository's ``operator/`` cannot shadow the stdlib): it compiles
every kernel, through its public wrapper at Llama-3.1-8B shapes, down to a cubin with ptxas.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.paths import TOOLS

SCRIPT = TOOLS / "compile_kernels.py"

# Kernels the engine launches (the script itself also fails on any @triton.jit kernel of
# kernels/*.py it did not compile; this list checks that its report names them).
EXPECTED = [
    "prefill_attention._prefill_kernel",
    "prefill_attention._prefill_reduce_kernel",
    "decode_attention._decode_kernel",
    "decode_attention._reduce_kernel",
    "fused_decode_attention._rotary_decode_kernel",
    "kv_cache._write_kv_kernel",
    "kv_cache._rotary_write_kv_kernel",
    "pointwise._rms_norm_kernel",
    "pointwise._rotary_kernel",
    "pointwise._silu_and_mul_kernel",
    "pointwise._gelu_tanh_and_mul_kernel",
    "gemv._gemv_kernel",
    "sampling._plain_kernel",
    "sampling._max_kernel",
    "sampling._stats_kernel",
    "sampling._collect_kernel",
    "sampling._resolve_kernel",
    "sampling._pivot_first_kernel",
    "sampling._pivot_kernel",
    "sampling._logprob_kernel",
    "sampling._penalty_kernel",
    "sampling._argmax_chunk_kernel",
    "sampling._argmax_resolve_kernel",
]


def _skip_without_nvidia_backend() -> None:
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton's nvidia backend is not installed")
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(90).path
    except Exception as e:  # noqa: BLE001 - any lookup failure means: cannot compile here
        pytest.skip(f"no ptxas for sm_90: {e}")
    if not os.path.exists(ptxas):
        pytest.skip(f"ptxas not found at {ptxas}")


def _run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    _skip_without_nvidia_backend()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # empty: really compile
    proc = subprocess.run([sys.executable, str(SCRIPT), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode == 3 and proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    return proc


def test_checker_catches_a_kernel_that_does_not_compile(tmp_path):
    # The bug this check exists for: a placeholder of the wrong dtype that the interpreter never
    # reads, but that changes a loop-carried type when compiled. Also: an uncompiled kernel is found.
    proc = _run(tmp_path, "--self-test")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("self-test: ok") == 5, proc.stdout
    assert "Loop-carried variable best has initial type int32" in proc.stdout


def test_every_kernel_compiles_for_sm90(tmp_path):
    proc = _run(tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, f"kernels failed to compile for sm_90:\n{out[-8000:]}\n{proc.stderr[-4000:]}"
    assert "FAIL" not in out
    counts = dict(re.findall(r"^([\w.]+): (\d+)$", out, flags=re.M))
    for name in EXPECTED:
        assert int(counts.get(name, 0)) >= 1, f"{name} not compiled:\n{out[-4000:]}"

    ok = [line for line in out.splitlines() if line.startswith("ok ")]
    # The GPU paths were compiled, not the CPU interpreter's: bf16/FP8 tiles into tl.dot, and the
    # sampler's libdevice exp.
    attention = [line for line in ok if line.split()[1].startswith(("prefill_attention._", "decode_attention._", "fused_decode_attention._")) and "DOT_FP32=" in line]
    assert attention and all("DOT_FP32=False" in line for line in attention)
    assert any("_decode_kernel" in line and "fp8e4m3" in line for line in attention)
    assert any("_prefill_kernel" in line and "fp8e4m3" in line for line in attention)
    # With and without context splits (132 SMs): the prefill kernel's split count is a constexpr, the
    # decode kernel's a runtime argument with a SPLIT flag.
    splits = {m for line in attention if "prefill_attention._prefill_kernel " in line for m in re.findall(r"NUM_SPLITS=(\d+)", line)}
    assert "1" in splits and len(splits) >= 2, splits
    split_flags = {m for line in attention if "decode_attention._decode_kernel " in line for m in re.findall(r"\bSPLIT=(\w+)", line)}
    assert split_flags == {"True", "False"}, split_flags
    # Sliding-window and soft-capped variants of every attention kernel (Mistral, Gemma).
    for kernel in ("prefill_attention._prefill_kernel ", "decode_attention._decode_kernel ",
                   "decode_attention._decode_tma_kernel ", "decode_attention._reduce_kernel ",
                   "fused_decode_attention._rotary_decode_kernel "):
        lines = [line for line in ok if kernel in line]
        assert any("WINDOWED=True" in line for line in lines), kernel
        assert any("WINDOWED=False" in line for line in lines), kernel
        if "_reduce_kernel" not in kernel:
            assert any("WINDOWED=True" in line and "SOFT_CAP=True" in line for line in lines), kernel
    precise = [line for line in ok if "PRECISE=" in line]
    assert precise and all("PRECISE=True" in line for line in precise)
    # The greedy/plain-only draw compiles _resolve_kernel with placeholders for the filtered buffers.
    plain_only = out.split("== sampling draw rows=g\n", 1)[1].split("== ", 1)[0]
    assert "sampling._resolve_kernel" in plain_only
    # GEMV at M = 1 (FMA, M specialised to 1), 2 and 8 (tl.dot) for each prologue.
    gemv = [line for line in ok if "gemv._gemv_kernel" in line]
    for prologue in ("0", "1", "2", "3"):
        blocks = {m for line in gemv if f"PROLOGUE={prologue} " in line for m in re.findall(r"BLOCK_M=(\d+)", line)}
        assert {"1", "2", "16"} <= blocks, (prologue, blocks)
    # Nothing needs more than an H200 block has (the script checks; the report shows it).
    for line in ok:
        m = re.search(r"smem=(\d+)B", line)
        assert m and int(m.group(1)) <= 232448, line
