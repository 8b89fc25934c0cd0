"""The PDL order checker (tools/pdl_order_check.py) itself: address conversions (``cvta``) are allowed
before ``griddepcontrol.wait`` (they read nothing; any access through the converted generic address
is still flagged), early loads allow plain loads and branches only, and ``--scan-cache`` checks every
kernel with a ``USE_PDL`` parameter (names taken from the kernels' sources)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys


from support.paths import REPO, TOOLS



# ---- the PDL checker's cvta exemption ----------------------------------------------------------
def _ptx_problems():
    """``ptx_problems`` of tools/pdl_order_check.py without importing it (the import removes
    TRITON_INTERPRET from this process's environment and installs compile-only machinery)."""
    src = (TOOLS / "pdl_order_check.py").read_text()
    wanted = {"_PTX_MEM", "_PTX_OK_SPACES", "_PTX_LOADS", "_ptx_instructions", "ptx_problems"}
    body = [n for n in ast.parse(src).body
            if (isinstance(n, ast.FunctionDef) and n.name in wanted)
            or (isinstance(n, ast.Assign) and any(getattr(t, "id", None) in wanted for t in n.targets))]
    assert len(body) == len(wanted)
    ns: dict = {"re": re}
    exec(compile(ast.Module(body=body, type_ignores=[]), "pdl_order_check.py", "exec"), ns)  # noqa: S102
    return ns["ptx_problems"]


def _ptx(*before: str) -> str:
    lines = "\n".join(f"\t{s}" for s in before)
    return (f".visible .entry k(\n.param .u64 k_param_0\n)\n{{\n{lines}\n\tgriddepcontrol.launch_dependents;\n"
            f"\tgriddepcontrol.wait;\n\tld.global.b32 %r9, [%rd2];\n\tret;\n}}\n")


def test_pdl_checker_allows_address_conversions_only():
    problems = _ptx_problems()
    ok = ("ld.param.b64 %rd2, [k_param_0];", "mov.b32 %r53, k_param_3;", "cvt.u64.u32 %rd15, %r53;",
          "cvta.param.u64 %rd22, %rd15;", "cvta.shared.u64 %rd23, %rd15;")
    assert problems(_ptx(*ok), "k") == []
    bad = {
        "ld.u64 %rd24, [%rd22];": "memory access",  # a generic load through the converted address
        "prefetch.tensormap [%rd22];": "memory access",
        "cvta.to.global.u64 %rd3, %rd2;": "memory access",  # (conservative: global is never exempt)
        "ld.global.nc.b32 %r1, [%rd2];": "memory access",
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
        "[%r1], [%rd22, {%r2, %r3}], [%r4];": "memory access",
    }
    for ins, why in bad.items():
        found = problems(_ptx(*ok, ins), "k")
        assert len(found) == 1 and why in found[0], (ins, found)


def _pdl_kernel_names() -> set[str]:
    """Functions of kernels/*.py (not pdl.py's helpers) with a ``USE_PDL`` parameter, from the sources."""
    names = set()
    for path in (REPO / "kernels").glob("*.py"):
        if path.name != "pdl.py":
            names |= {n.name for n in ast.walk(ast.parse(path.read_text()))
                      if isinstance(n, ast.FunctionDef) and "USE_PDL" in [a.arg for a in n.args.args]}
    return names


def test_pdl_checker_early_loads_allow_plain_loads_and_branches_only():
    """``EARLY_LOADS`` kernels (the fused decode attention) may load the step's metadata and branch before
    the wait; stores, atomics and asynchronous copies stay forbidden."""
    problems = _ptx_problems()
    ok = ("ld.global.b32 %r1, [%rd2];", "ld.global.v4.b32 {%r1, %r2, %r3, %r4}, [%rd2];", "ld.u64 %rd24, [%rd22];",
          "ld.global.nc.b32 %r1, [%rd2];", "bra $L__BB0_2;", "ret;")
    assert problems(_ptx(*ok), "k", True) == []
    assert len(problems(_ptx(*ok), "k")) == len(ok)  # all refused without the exemption
    for ins in ("st.global.b32 [%rd2], %r1;", "atom.global.gpu.acq_rel.add.u32 %r1, [%rd2], 1;",
                "red.global.add.u32 [%rd2], 1;", "cp.async.cg.shared.global [%r1], [%rd2], 16;",
                "prefetch.global.L2 [%rd2];"):
        found = problems(_ptx(ins), "k", True)
        assert len(found) == 1 and "memory access" in found[0], (ins, found)


def test_pdl_checker_scan_mode_checks_every_pdl_kernel(tmp_path):
    """``pdl_order_check.py --scan-cache`` (the check of what the GPU's own Triton compiled) checks every
    kernel with a ``USE_PDL`` parameter, ``_two_rank_all_reduce_kernel`` included: a cache holding each PDL kernel with a global load (a store for the ``EARLY_LOADS`` kernel,
    which may load there) before its wait yields one problem each."""
    names = _pdl_kernel_names()
    assert {"_gemv_kernel", "_two_rank_all_reduce_kernel"} <= names
    cache = tmp_path / "cache"
    for i, name in enumerate(sorted(names)):
        (cache / f"h{i}").mkdir(parents=True)
        access = "st.global.b32 [%rd1], %r1;" if name == "_rotary_decode_kernel" else "ld.global.b32 %r1, [%rd1];"
        (cache / f"h{i}" / f"{name}.ptx").write_text(
            f".visible .entry {name}(\n.param .u64 p0\n)\n{{\n\tld.param.u64 %rd1, [p0];\n"
            f"\t{access}\n\tgriddepcontrol.launch_dependents;\n\tgriddepcontrol.wait;\n"
            f"\tret;\n}}\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(TOOLS / "pdl_order_check.py"), "--scan-cache", str(cache)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    flagged = {re.search(r"/(\w+)\.ptx: memory access before the wait", line).group(1)
               for line in proc.stdout.splitlines() if "memory access before the wait" in line}
    assert flagged == names, (names - flagged, proc.stdout)
