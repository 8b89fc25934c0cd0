"""The fused MoE kernels build for an H100/H200 (sm_90) without a GPU: Triton compiles each kernel
at the launch configurations `kernels/fused_moe.py` uses (bf16, TMA weight tiles on the grouped
path) to a cubin, and ptxas reports no register spills. Marked slow (about a minute of compiling)."""

from __future__ import annotations

import inspect
import subprocess
import tempfile

import pytest

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.slow


def _compile(fn, pointers: dict, constexprs: dict, **options):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {p: "constexpr" if p in constexprs else pointers.get(p, "i32") for p in inspect.signature(fn.fn).parameters}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs), target=GPUTarget("cuda", 90, 32),
                          options=options)


def _spill_bytes(kernel) -> int:
    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90)
    ptxas = getattr(ptxas, "path", ptxas)
    with tempfile.TemporaryDirectory() as tmp:
        with open(f"{tmp}/k.ptx", "w") as f:
            f.write(kernel.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f"{tmp}/k.ptx", "-o", f"{tmp}/k.cubin"],
                             capture_output=True, text=True, check=True)
    lines = [ln for ln in out.stderr.splitlines() if "spill stores" in ln]
    assert lines, out.stderr
    return int(lines[0].split(",")[1].split()[0])


def test_grouped_and_small_kernels_build_for_sm90_without_spills():
    from kvpilot.kernels import fused_moe as FM

    bf = "*bf16"
    for _, bm, bn, bk, group_m, warps, stages in FM.TUNING["grouped"]:
        c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=group_m, PRECISION="tf32", EVEN_K=True, USE_TMA=True)
        desc = f"tensordesc<bf16[{bn},{bk}]>"
        gate_up = _compile(FM._grouped_gate_up_kernel, dict(x_ptr=bf, w_ptr=bf, w_desc=desc, act_ptr=bf,
                                                            pairs_ptr="*i32", block_e_ptr="*i32"),
                           dict(c, K_TOP=8), num_warps=warps, num_stages=stages)
        down = _compile(FM._grouped_down_kernel, dict(act_ptr=bf, w_ptr=bf, w_desc=desc, out_ptr=bf,
                                                      weights_ptr="*fp32", pairs_ptr="*i32", block_e_ptr="*i32"),
                        c, num_warps=warps, num_stages=stages)
        assert (_spill_bytes(gate_up), _spill_bytes(down)) == (0, 0), (bm, bn, bk)
    for t_max in (1, 8):
        bn = FM.TUNING["small_block_n"]
        c = dict(K_TOP=8, T_MAX=t_max, K_P2=8, PAIRS_P2=8 * t_max, BLOCK_N=bn,
                 BLOCK_K=max(16, FM.TUNING["small_tile"] // (t_max * bn)))
        gate_up = _compile(FM._small_gate_up_kernel, dict(x_ptr=bf, w_ptr=bf, act_ptr=bf, ids_ptr="*i32"), c,
                           num_warps=4)
        down = _compile(FM._small_down_kernel, dict(act_ptr=bf, w_ptr=bf, out_ptr=bf, weights_ptr="*fp32",
                                                    ids_ptr="*i32"), c, num_warps=4)
        assert (_spill_bytes(gate_up), _spill_bytes(down)) == (0, 0), t_max
