"""Programmatic dependent launch (PDL, kernels/pdl.py) between the small-batch decode kernels.

What a PDL launch needs to be correct: every global memory access of a kernel launched with the
PDL attribute comes after its ``griddepcontrol.wait`` in the MACHINE CODE (the compiler, not the
source, decides the order), and only kernels that wait are launched with the attribute (kernels
trigger their successor at entry, before their own wait, so a successor that does not wait would
race; the batch-1 GEMV waits at entry and triggers when a program starts its last column tile). The
CPU tests here check both on what Triton and ptxas produce for sm_90, for every specialization the
wrappers launch with PDL (GEMV M = 1, 2 and 8, where M = 8 is a 3-stage ``cp.async`` pipeline;
attention with and without splits, bf16 and FP8; the reduction; rotary + KV write; RMSNorm), plus
the source-level pairing of launch attribute and wait. On a GPU machine with another Triton, run
``tools/pdl_order_check.py`` there. PDL is off on ROCm GPUs (`kernels/pdl._capable`: Hopper only).

The ``gpu`` tests provoke the race on an H200 (``benchmarks/lab/gpu_pdl_races.py``): a late writer
kernel that triggers its PDL successor at once and writes the successor's input only after
spinning; the successor's output must equal the synchronised result, and a deliberately broken
kernel (load before wait) must be caught (else the harness proves nothing)."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.paths import REPO, TOOLS, load_benchmark

ROOT = REPO
KERNELS = ROOT / "kernels"
CHECKER = TOOLS / "pdl_order_check.py"


def _needs_nvidia_backend() -> None:
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton's nvidia backend is not installed")
    from kvpilot.kernels import pdl

    if not pdl.HAS_GDC:
        pytest.skip("this Triton has no gdc_wait / launch_pdl")


def _run_checker(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """tools/pdl_order_check.py in a fresh interpreter without TRITON_INTERPRET (kernels must be
    real JITFunctions), from ``tmp_path`` (the repository's ``operator/`` must not shadow the
    stdlib)."""
    _needs_nvidia_backend()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(CHECKER), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode == 3 and proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    return proc


# ---- machine-code order -------------------------------------------------------------------------
def test_checker_flags_a_load_before_the_wait_and_a_wait_that_does_not_dominate(tmp_path):
    proc = _run_checker(tmp_path, "--self-test")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("self-test: ok") == 3, proc.stdout
    # The broken kernel is caught in the PTX and, when nvdisasm is there, in the SASS.
    assert "memory access before the wait: 'ld.global" in proc.stdout, proc.stdout


def test_pdl_kernels_touch_no_global_memory_before_griddepcontrol_wait(tmp_path):
    """Every specialization the wrappers launch with PDL (launches of at most PDL_MAX_ROWS rows):
    launch_pdl <=> USE_PDL, and in its PTX and SASS no global/generic load, store, atomic,
    cp.async or prefetch, and no branch, before the first griddepcontrol.wait."""
    proc = _run_checker(tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out[-6000:] + proc.stderr[-3000:]
    assert "FAIL" not in out and "PDL order: ok" in out, out[-4000:]
    checked = [line for line in out.splitlines() if line.startswith("ok ")]
    kernels = {line.split()[1] for line in checked}
    assert kernels == {"allreduce._two_rank_all_reduce_kernel", "decode_attention._decode_kernel",
                       "decode_attention._reduce_kernel", "fused_decode_attention._rotary_decode_kernel", "gemv._gemv_kernel",
                       "kv_cache._rotary_write_kv_kernel",
                       "pointwise._rms_norm_kernel"}, kernels
    # The pipelined tl.dot GEMV (M = 8: BLOCK_M=16, 3 stages of cp.async) is among them, and the
    # attention kernel with and without context splits and with the FP8 cache.
    assert any("gemv._gemv_kernel" in line and "USE_DOT=True" in line and "stages=3" in line for line in checked)
    assert any("_decode_kernel" in line and "SPLIT=False" in line for line in checked)
    assert any("_decode_kernel" in line and "KV_F16=True" in line for line in checked)
    # Launches of more rows than PDL_MAX_ROWS were compiled too, without PDL (checked in the script).
    n_launch, n_pdl = map(int, re.search(r"(\d+) launches, (\d+) with PDL", out).groups())
    assert n_launch > n_pdl > 0


# ---- the source: launch attribute and wait come in pairs ------------------------------------------
def _kernel_sources() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text()) for p in sorted(KERNELS.glob("*.py"))}


def _jit_functions(tree: ast.Module) -> dict[str, ast.FunctionDef]:
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            out[node.name] = node
    return out


# (tools/pdl_order_check.py's EARLY_LOADS; that module cannot be imported here: it sets up Triton for
# compile-only runs.)
# The pointers each may load before its wait: the step's metadata and the rotary table.
_EARLY_LOADS = {"_rotary_decode_kernel": {"qsl_ptr", "seq_lens_ptr", "pos_ptr", "cos_sin_ptr", "slot_ptr",
                                          "block_tables_ptr", "bt_row"}}
_MEMORY_CALLS = ("tl.load", "tl.store", "tl.atomic", "tl.make_block_ptr", "tl.make_tensor_descriptor", "_load")


def test_every_pdl_launch_passes_use_pdl_and_every_use_pdl_kernel_waits_first():
    """Source-level pairing, for launch sites the compile cases may not reach: a launch with
    ``**launch_options(m)`` passes ``USE_PDL=m > 0`` to a kernel with a ``USE_PDL`` parameter, and
    such a kernel calls ``pdl_enter(USE_PDL)`` (or ``pdl_wait(USE_PDL)``, then ``pdl_trigger`` later)
    in its top-level body with no memory access (nor a call of another helper) in the statements
    before it."""
    launches = []
    for fname, tree in _kernel_sources().items():
        jits = _jit_functions(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)):
                continue
            opts = [k for k in node.keywords if k.arg is None and isinstance(k.value, ast.Call)
                    and ast.unparse(k.value.func) == "launch_options"]
            if not opts:
                continue
            kernel = ast.unparse(node.func.value)
            mode = ast.unparse(opts[0].value.args[0])
            use = {k.arg: ast.unparse(k.value) for k in node.keywords if k.arg}.get("USE_PDL")
            assert use == f"{mode} > 0", f"{fname}: {kernel} launched with launch_options({mode}) but USE_PDL={use}"
            assert kernel in jits and "USE_PDL" in [a.arg for a in jits[kernel].args.args], (fname, kernel)
            launches.append(kernel)
        for name, fn in jits.items():
            if "USE_PDL" not in [a.arg for a in fn.args.args] or fname == "pdl.py":
                continue
            calls = [i for i, st in enumerate(fn.body)
                     if ast.unparse(st).strip() in ("pdl_enter(USE_PDL)", "pdl_wait(USE_PDL)")]
            assert calls, f"{fname}: {name} has USE_PDL but does not call pdl_enter/pdl_wait(USE_PDL) at top level"
            if ast.unparse(fn.body[calls[0]]).strip() == "pdl_wait(USE_PDL)":
                # it triggers itself, or through a helper it hands USE_PDL to (gemv's _column_tile)
                helpers = [jits[ast.unparse(n.func)] for n in ast.walk(fn) if isinstance(n, ast.Call)
                           and ast.unparse(n.func) in jits and "USE_PDL" in [ast.unparse(a) for a in n.args]]
                assert "pdl_trigger(USE_PDL)" in ast.unparse(fn) or any(
                    "pdl_trigger(" in ast.unparse(h) for h in helpers), f"{fname}: {name} waits but never triggers"
            before = "\n".join(ast.unparse(st) for st in fn.body[:calls[0]])
            called = {ast.unparse(n.func) for n in ast.walk(ast.parse(before or "pass")) if isinstance(n, ast.Call)}
            if name in _EARLY_LOADS:  # loads of what no kernel of the step writes (pdl_order_check.EARLY_LOADS)
                bad = [c for c in called if c.startswith(_MEMORY_CALLS[1:]) or (c in jits and c != "_split_size")]
                for node in ast.walk(ast.parse(before or "pass")):
                    if isinstance(node, ast.Call) and ast.unparse(node.func) == "tl.load":
                        ptrs = {n.id for n in ast.walk(node.args[0]) if isinstance(n, ast.Name)
                                and (n.id.endswith("_ptr") or n.id == "bt_row")}
                        bad += [f"tl.load of {p}" for p in ptrs - _EARLY_LOADS[name]]
            else:
                bad = [c for c in called if c.startswith(_MEMORY_CALLS) or c in jits]
            assert not bad, (fname, name, bad)
            assert name in launches, f"{fname}: {name} takes USE_PDL but is never launched with launch_options"
    assert sorted(set(launches)) == ["_decode_kernel", "_gemv_kernel", "_reduce_kernel",
                                     "_rms_norm_kernel", "_rotary_decode_kernel", "_rotary_write_kv_kernel",
                                     "_two_rank_all_reduce_kernel"]


# ---- findings -------------------------------------------------------------------------------------
def test_pdl_mode_is_off_on_a_rocm_gpu(monkeypatch):
    """PDL is off on a ROCm GPU. PyTorch's ROCm build reports AMD GPUs as ``cuda`` devices with
    capability (9, 0) (MI200) or (9, 4) (MI300); with the NVIDIA backend's ``launch_pdl`` option in the
    installed Triton, ``pdl_mode`` would otherwise compile ``griddepcontrol`` (PTX) for an AMD target.
    The operator renders AMD pods (``gpuResourceName: amd.com/gpu``); ``_capable`` checks
    ``torch.version.hip is None``."""
    pytest.importorskip("triton")
    from kvpilot.kernels import pdl

    monkeypatch.setattr(pdl, "HAS_GDC", True)
    monkeypatch.setattr(torch.version, "hip", "6.2.0", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 4))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pdl._capable.cache_clear()
    try:
        assert pdl.pdl_mode(torch.device("cuda", 0), 1) == 0
    finally:
        pdl._capable.cache_clear()


def test_pdl_mode_follows_the_row_limit_on_hopper(monkeypatch):
    """The rule the checks above assume (and the CUDA-graph batch sizes 1, 2, 4, 8 rely on): on an
    sm_90 device, PDL for at most PDL_MAX_ROWS rows, off above and under the interpreter."""
    pytest.importorskip("triton")
    from kvpilot.kernels import pdl

    monkeypatch.setattr(pdl, "HAS_GDC", True)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (9, 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    pdl._capable.cache_clear()
    try:
        dev = torch.device("cuda", 0)
        assert [pdl.pdl_mode(dev, r) for r in (1, pdl.PDL_MAX_ROWS, pdl.PDL_MAX_ROWS + 1)] == [1, 1, 0]
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert pdl.pdl_mode(dev, 1) == 0
    finally:
        pdl._capable.cache_clear()


# ---- GPU: provoke the race ----------------------------------------------------------------------------
def _hopper() -> bool:
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    from kvpilot.kernels import pdl

    return pdl.HAS_GDC and torch.cuda.get_device_capability()[0] >= 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper-or-newer GPU with Triton's launch_pdl")


def _pdl_harness():
    return load_benchmark("gpu_pdl_races")


@pytest.mark.gpu
@needs_hopper
def test_gpu_negative_control_is_caught(monkeypatch):
    """The harness can see a race: a kernel that loads before its wait, launched with PDL after a
    late writer, reads the stale input in some trials (otherwise PDL is not in effect and the
    late-writer test below proves nothing)."""
    r = _pdl_harness()
    assert r.negative_control(10, 50.0) > 0


@pytest.mark.gpu
@needs_hopper
def test_gpu_pdl_kernels_never_read_or_overwrite_early(monkeypatch):
    """Every late-writer / late-reader case of benchmarks/lab/gpu_pdl_races.py (Llama-3.1-8B shapes,
    1 and 8 rows, bf16 and FP8 caches, the qkv -> rotary -> attention -> o_proj chain), eagerly
    and from a CUDA graph: the output equals the synchronised call's, bit for bit."""
    r = _pdl_harness()
    bad = {}
    for case in r.build_cases():
        e, g = r.run_case(case, 5, 50.0, graphs=True)
        if e or g:
            bad[case.name] = (e, g)
    assert not bad, bad
