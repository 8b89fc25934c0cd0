"""Programmatic dependent launch: no global memory access before ``griddepcontrol.wait``, checked in
the PTX and the SASS of every kernel the wrappers launch with PDL, compiled for an H200 (sm_90)
on a machine without a GPU.

A kernel launched with the PDL attribute (``launch_pdl=True``, kernels/pdl.py) may start while the
kernel before it in the stream is still running; only ``griddepcontrol.wait`` (``gdc_wait``)
makes that kernel's writes visible. Any global load, store, atomic, ``cp.async`` or prefetch
that the compiler places before the wait (the source's order is not the machine code's: Triton's
software pipeliner hoists loads into loop prologues, ptxas schedules loads early) can read stale
data or overwrite data the previous kernel still reads. This script compiles the decode-path
launches through their public wrappers, with the rule of ``pdl.pdl_mode`` (PDL for launches of at
most ``PDL_MAX_ROWS`` rows; the GPU and interpreter checks forced), using the fake sm_90 driver
of ``tools/compile_kernels.py``, and checks each compiled specialization:

- launched with ``launch_pdl=True`` => compiled with ``USE_PDL=True``; launched without it =>
  compiled with ``USE_PDL=False`` (a kernel that never waits must never be launched with PDL);
- PTX: a ``griddepcontrol.launch_dependents`` and a ``griddepcontrol.wait``; before the first
  wait, no branch (the wait then dominates every later instruction) and no memory instruction
  other than ``.param``/``.const``/``.shared``/``.local`` ones (a generic-address ``ld``/``st``
  counts as global);
- SASS (``nvdisasm`` of the cubin, when Triton ships it): the first ``ACQBULK`` (the wait) comes
  before the first global or generic memory instruction (``LDG``, ``STG``, ``LDGSTS``, ``LD``,
  ``ST``, ``ATOM(G)``, ``RED``, TMA, ...), so ptxas did not hoist a load above it;
- every kernel with a ``USE_PDL`` parameter was compiled with PDL at least once.

Usage (never with ``/work/main`` as the current directory: ``operator/`` shadows the stdlib)::

    cd /tmp && /path/to/python /path/to/tools/pdl_order_check.py [--verbose]

Runs on the GPU machine too (it never launches anything): there it checks the GPU's own Triton
(3.6), whose compiler may order things differently from this machine's. ``--scan-cache [DIR]``
instead checks the PDL kernels already in a Triton cache (the ones a GPU run really compiled, by
whatever Triton is installed; needs no fake driver). ``--self-test`` checks the checker. Exit
status: 0 all good, 1 a violation (listed), 3 (a line starting "SKIP") nothing to check here (no
ptxas for sm_90, no gdc in this Triton, or no PDL kernel in the cache). About 10 s.
"""

from __future__ import annotations

import os

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported (see compile_kernels.py)
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")

import argparse  # noqa: E402
import contextlib  # noqa: E402
import io  # noqa: E402
import glob  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import compile_kernels as ck  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# ---- PTX ----------------------------------------------------------------------------------------
_PTX_MEM = re.compile(r"^(ld|ldu|st|atom|red|cp|prefetch|prefetchu|multimem|tensormap|cvta|discard|applypriority)\b")
_PTX_OK_SPACES = (".param", ".const", ".shared", ".local")
# Kernels that may LOAD (never store, atomically update or copy asynchronously) global memory, and
# branch, before their wait: they read only what no kernel of the step writes (the step's metadata,
# copied before its first kernel, and constant tables). See the comment at the top of the kernel's body.
EARLY_LOADS = {"_rotary_decode_kernel"}
_PTX_LOADS = re.compile(r"^(ld|ldu)(\.global)?(\.nc)?(\.v\d)?\.[busf]\d+$")
_SASS_LOADS = {"LDG", "LD"}


def _ptx_instructions(ptx: str, entry: str) -> list[str]:
    """The instructions of ``.entry entry``'s body, in order, without predicates, comments,
    labels, directives and inline-asm markers."""
    start = ptx.index(f".entry {entry}")
    body = ptx[ptx.index("{", start):]
    out = []
    for raw in body.splitlines():
        line = raw.split("//", 1)[0].strip()
        if not line or line.startswith(".") or line.endswith(":") or line in ("{", "}"):
            continue
        line = re.sub(r"^@!?%\w+\s+", "", line)  # predicate
        out.append(line)
    return out


def ptx_problems(ptx: str, entry: str, loads_ok: bool = False) -> list[str]:
    """Why this kernel's PTX may touch memory before its first ``griddepcontrol.wait`` ([] if it
    cannot). ``loads_ok`` (`EARLY_LOADS` kernels): plain global or generic loads and control flow are
    allowed there, every other memory access is not."""
    ins = _ptx_instructions(ptx, entry)
    waits = [i for i, s in enumerate(ins) if s.startswith("griddepcontrol.wait")]
    problems = []
    if not any(s.startswith("griddepcontrol.launch_dependents") for s in ins):
        problems.append("no griddepcontrol.launch_dependents")
    if not waits:
        return problems + ["no griddepcontrol.wait"]
    for s in ins[:waits[0]]:
        op = s.split()[0]
        if loads_ok and (_PTX_LOADS.match(op) or op.startswith(("bra", "ret", "exit"))):
            continue
        if op.startswith(("bra", "brx", "call", "ret", "exit", "trap")):
            problems.append(f"control flow before the wait: {s!r}")
        # (an address conversion from those spaces, e.g. ``cvta.param`` of a TMA descriptor that
        # is a kernel parameter, reads nothing another kernel writes)
        elif _PTX_MEM.match(op) and not (op.startswith(("ld", "st", "cvta"))
                                         and any(sp in op for sp in _PTX_OK_SPACES)):
            problems.append(f"memory access before the wait: {s!r}")
    return problems


# ---- SASS ---------------------------------------------------------------------------------------
_SASS_GLOBAL = {
    "LDG", "STG", "LDGSTS", "LD", "ST", "ATOM", "ATOMG", "RED", "REDG", "CCTL", "CCTLL",
    "UTMALDG", "UTMASTG", "UTMAREDG", "UTMAPF", "UBLKCP", "UBLKRED", "UBLKPF", "SULD", "SUST", "SURED", "TLD", "TEX",
}


def _nvdisasm() -> str | None:
    hits = glob.glob(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm"))
    return hits[0] if hits and os.access(hits[0], os.X_OK) else None


def sass_problems(cubin: bytes, nvdisasm: str, loads_ok: bool = False) -> list[str]:
    """Why this cubin's SASS may touch global memory before its first ``ACQBULK`` (the machine form
    of ``griddepcontrol.wait`` on sm_90) ([] if it cannot); ``loads_ok`` as for `ptx_problems`."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    ops = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if m:
            ins = re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip())
            ops.append(ins)
    first_wait = next((i for i, s in enumerate(ops) if s.split()[0] == "ACQBULK"), None)
    if first_wait is None:
        return ["no ACQBULK (griddepcontrol.wait) in the SASS"]
    forbidden = _SASS_GLOBAL - _SASS_LOADS if loads_ok else _SASS_GLOBAL
    return [f"SASS memory access before ACQBULK: {s!r}" for s in ops[:first_wait]
            if s.split()[0].split(".")[0] in forbidden]


# ---- self-test: the checker finds what it should -----------------------------------------------
import triton.language as tl  # noqa: E402

from kvpilot.kernels.pdl import HAS_GDC, pdl_enter  # noqa: E402

if HAS_GDC:
    from triton.language.extra.cuda import gdc_wait  # noqa: E402


@triton.jit
def _st_good(x_ptr, y_ptr, USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    offs = tl.arange(0, 128)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs) + 1)


@triton.jit
def _st_load_first(x_ptr, y_ptr, USE_PDL: tl.constexpr):
    offs = tl.arange(0, 128)
    v = tl.load(x_ptr + offs)  # before the wait: a stale read under PDL
    pdl_enter(USE_PDL)
    tl.store(y_ptr + offs, v + 1)


@triton.jit
def _st_wait_in_loop(a_ptr, b_ptr, c_ptr, K, USE_PDL: tl.constexpr):
    # A wait that does not dominate the kernel: inside a loop (triton-lang/triton#11905 reports that
    # Triton 3.7's pipeliner then issues the first iterations' loads in the loop prologue, before
    # any wait; Triton 3.9 here did not pipeline this loop, so the branch rule is what catches it).
    offs = tl.arange(0, 16)
    offs_k = tl.arange(0, 64)
    acc = tl.zeros([16, 16], dtype=tl.float32)
    for k in range(0, K, 64):
        if USE_PDL:
            gdc_wait()
        a = tl.load(a_ptr + offs[:, None] * K + (k + offs_k)[None, :])
        b = tl.load(b_ptr + (k + offs_k)[:, None] * 16 + offs[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + offs[:, None] * 16 + offs[None, :], acc)


def self_test(nvdisasm: str | None) -> int:
    """Compile a good kernel and two bad ones with PDL; the check must pass only the good one."""
    x = torch.empty(4096, dtype=torch.float32)
    a = torch.empty(16 * 1024, dtype=ck.BF16)
    runs = [("good", lambda: _st_good[(1,)](x, x, USE_PDL=True, launch_pdl=True), False),
            ("load before the wait", lambda: _st_load_first[(1,)](x, x, USE_PDL=True, launch_pdl=True), True),
            ("wait inside a loop",
             lambda: _st_wait_in_loop[(1,)](a, a, x, 1024, USE_PDL=True, launch_pdl=True, num_stages=3), True)]
    bad = 0
    for label, fn, expect_problem in runs:
        LAUNCHES.clear()
        _CASE[0] = label
        with contextlib.redirect_stdout(io.StringIO()):
            fn()
        ln = LAUNCHES[-1]
        if ln.compiled is None:
            print(f"self-test: {label}: did not compile")
            bad += 1
            continue
        found = ptx_problems(ln.compiled.asm["ptx"], ln.compiled.metadata.name)
        if nvdisasm is not None:
            found += sass_problems(ln.compiled.asm["cubin"], nvdisasm)
        ok = bool(found) == expect_problem
        bad += not ok
        print(f"self-test: {'ok' if ok else 'WRONG'}: {label}: {found[:2] if found else 'no problem found'}")
    return 1 if bad else 0


# ---- the launches -------------------------------------------------------------------------------
@dataclass
class Launch:
    case: str
    kernel: str
    constexprs: dict
    launch_pdl: bool
    compiled: object


LAUNCHES: list[Launch] = []
_CASE = [""]


def _recording_run(self: JITFunction, *args, grid, warmup, **kwargs):
    compiled = ck._compile_only(self, *args, grid=grid, warmup=warmup, **kwargs)
    names = [p.name for p in self.params]
    const = {p.name for p in self.params if p.is_constexpr}
    bound = dict(zip(names, args))
    bound.update(kwargs)
    LAUNCHES.append(Launch(_CASE[0], ck._name(self), {k: v for k, v in bound.items() if k in const},
                           bool(kwargs.get("launch_pdl", False)), compiled))
    return compiled


def _force_pdl_rule() -> None:
    """``pdl_mode`` as on an H200: 1 for at most ``PDL_MAX_ROWS`` rows."""
    from kvpilot.kernels import pdl

    original = pdl.pdl_mode
    for mod in ck.kernel_modules():
        if mod is not pdl and getattr(mod, "pdl_mode", None) is original:
            mod.pdl_mode = lambda device, rows: 1 if rows <= pdl.PDL_MAX_ROWS else 0


def cases() -> list[tuple[str, object]]:
    """(label, function): the small-batch decode launches (PDL) and a few larger ones (no PDL)."""
    one, tp8 = ck.Shard(1), ck.Shard(8)
    fp8, bf16 = torch.float8_e4m3fn, ck.BF16
    out = []
    for m in (1, 2, 8, 16):  # M=8 takes the tl.dot path with a 3-stage cp.async pipeline
        out.append((f"gemv M={m}", ck._gemv(one, m)))
    out.append(("tp=8 gemv M=1 (K=1792, not a multiple of the K tile)", ck._gemv(tp8, 1)))
    out.append(("tp=8 gemv M=8", ck._gemv(tp8, 8)))
    for dt, dn in ((bf16, "bf16"), (fp8, "fp8")):
        out.append((f"attention decode {dn}, 1 seq, split", ck._attention(one, [1], [3999], dt)))
        out.append((f"attention decode {dn}, 8 seqs, split", ck._attention(one, [1] * 8, [3000] * 8, dt)))
        out.append((f"attention decode {dn}, 8 seqs, no split", ck._attention(one, [1] * 8, [40] * 8, dt)))
        out.append((f"attention mixed {dn}, prefill + 2 decodes", ck._attention(one, [7, 1, 1], [0, 90, 300], dt)))
        out.append((f"rotary+kv write {dn}, 1 token", ck._rotary_write(one, 1, dt)))
        out.append((f"rotary+kv write {dn}, 8 tokens", ck._rotary_write(one, 8, dt)))
        out.append((f"rotary+decode {dn}, 1 seq, split", ck._rotary_decode(one, [3999], dt)))
        out.append((f"rotary+decode {dn}, 8 seqs, no split", ck._rotary_decode(one, [39] * 8, dt)))
    out.append(("attention decode bf16, 16 seqs (no PDL)", ck._attention(one, [1] * 16, [3000] * 16, bf16)))
    out.append(("tp=8 attention decode bf16, 1 seq, split", ck._attention(tp8, [1], [3999], bf16)))
    out.append(("tp=8 rotary+kv write bf16, 1 token", ck._rotary_write(tp8, 1, bf16)))
    for t in (1, 8, 16):
        out.append((f"rms_norm, {t} tokens", ck._pointwise(one, t)))
    for t in (1, 16):  # tensor parallelism 2's one-shot all-reduce (kernels/allreduce.py)
        out.append((f"two-rank all-reduce bf16, {t} tokens", ck._all_reduce(t, bf16)))
    return out


def check(launches: list[Launch], pdl_kernels: set[str], nvdisasm: str | None) -> tuple[list[str], list[str]]:
    """(problems, one report line per compiled PDL specialization)."""
    problems: list[str] = []
    lines: list[str] = []
    seen: set[int] = set()
    pdl_compiled: set[str] = set()
    sass: dict[int, list[str]] = {}
    if nvdisasm is not None:  # nvdisasm's start-up dominates: disassemble in parallel
        from concurrent.futures import ThreadPoolExecutor

        todo = {id(ln.compiled): ln.compiled for ln in launches if ln.launch_pdl and ln.compiled is not None}
        with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
            found = pool.map(lambda c: sass_problems(c.asm["cubin"], nvdisasm, c.metadata.name in EARLY_LOADS),
                             todo.values())
            sass = dict(zip(todo, found))
    for ln in launches:
        where = f"{ln.kernel} ({ln.case})"
        if ln.compiled is None:
            problems.append(f"{where}: did not compile")
            continue
        if ln.launch_pdl != bool(ln.constexprs.get("USE_PDL", False)):
            problems.append(f"{where}: launch_pdl={ln.launch_pdl} but USE_PDL={ln.constexprs.get('USE_PDL')}")
        if ln.launch_pdl and ln.kernel not in pdl_kernels:
            problems.append(f"{where}: launched with PDL but has no USE_PDL parameter")
        if id(ln.compiled) in seen:
            continue
        seen.add(id(ln.compiled))
        ptx = ln.compiled.asm["ptx"]
        entry = ln.compiled.metadata.name
        if not ln.launch_pdl:
            if "griddepcontrol" in ptx:
                problems.append(f"{where}: griddepcontrol in a kernel launched without PDL")
            continue
        pdl_compiled.add(ln.kernel)
        found = [f"{where}: {p}" for p in ptx_problems(ptx, entry, entry in EARLY_LOADS)]
        found += [f"{where}: {p}" for p in sass.get(id(ln.compiled), [])]
        problems += found
        ce = " ".join(f"{k}={v}" for k, v in ln.constexprs.items() if k in ("PROLOGUE", "USE_DOT", "BLOCK_M", "SPLIT",
                                                                          "KV_F16", "HAS_RESIDUAL", "SPLITS_PAD"))
        lines.append(f"{'FAIL' if found else 'ok  '} {ln.kernel} [{ce}] stages={ln.compiled.metadata.num_stages} "
                     f"({ln.case})")
    for name in sorted(pdl_kernels - pdl_compiled):
        problems.append(f"{name}: has a USE_PDL parameter but no case compiled it with PDL")
    return problems, lines


def pdl_kernel_functions() -> dict[str, JITFunction]:
    """"module_short.name" -> the @triton.jit kernels of kvpilot.kernels that take ``USE_PDL`` (not the
    helpers of kernels/pdl.py), read from the sources: a new PDL kernel is checked without being
    listed here (as ``_two_rank_all_reduce_kernel``)."""
    from kvpilot.kernels import pdl

    return {name: fn for name, fn in ck.jit_functions().items()
            if "USE_PDL" in [p.name for p in fn.params] and fn.module != pdl.__name__}


def scan_cache(cache_dir: str) -> int:
    """Check every kvpilot PDL kernel already compiled into a Triton cache (e.g. on the GPU machine,
    after the GPU tests ran, with its own Triton): the PTX wait rule (without the
    launch_dependents requirement: benchmark variants drop it) and the SASS rule."""
    import json

    nvdisasm = _nvdisasm()
    names = {fn.fn.__name__ for fn in pdl_kernel_functions().values()}
    problems, n = [], 0
    for ptx_path in sorted(Path(os.path.expanduser(cache_dir)).glob("*/*.ptx")):
        ptx = ptx_path.read_text()
        entry = ptx_path.stem
        if entry not in names or "griddepcontrol.wait" not in ptx:
            continue
        meta = ptx_path.with_suffix(".json")
        if meta.exists():
            entry = json.loads(meta.read_text()).get("name", entry)
        n += 1
        early = ptx_path.stem in EARLY_LOADS
        found = [p for p in ptx_problems(ptx, entry, early) if "launch_dependents" not in p]
        cubin = ptx_path.with_suffix(".cubin")
        if nvdisasm is not None and cubin.exists():
            found += sass_problems(cubin.read_bytes(), nvdisasm, early)
        problems += [f"{ptx_path.parent.name}/{ptx_path.name}: {p}" for p in found]
    print(f"triton {triton.__version__}: {n} PDL specializations in {cache_dir}; "
          f"SASS check: {'on' if nvdisasm else 'off'}")
    for p in problems:
        print(f"  {p}")
    if n == 0:
        print("SKIP: no compiled PDL kernel in this cache (run the GPU tests or benchmarks first)")
        return 3
    print("PDL order: ok" if not problems else f"{len(problems)} PROBLEM(S)")
    return 1 if problems else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--verbose", action="store_true", help="print every compiled specialization")
    ap.add_argument("--self-test", action="store_true",
                    help="check that the checker flags a load before the wait and a wait inside a loop")
    ap.add_argument("--scan-cache", nargs="?", const=os.environ.get("TRITON_CACHE_DIR", "~/.triton/cache"),
                    default=None, metavar="DIR",
                    help="instead: check the PDL kernels already compiled into this Triton cache (default: "
                         "TRITON_CACHE_DIR or ~/.triton/cache)")
    args = ap.parse_args(argv)
    if args.scan_cache:
        return scan_cache(args.scan_cache)
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        get_ptxas(ck.H200_CAPABILITY)
    except Exception as e:  # noqa: BLE001
        print(f"SKIP: no ptxas for sm_{ck.H200_CAPABILITY}: {e}")
        return 3
    from kvpilot.kernels import pdl

    if not pdl.HAS_GDC:
        print(f"SKIP: triton {triton.__version__} has no gdc_wait/launch_pdl (PDL stays off)")
        return 3
    ck.install()
    ck._patch_gpu_paths()
    JITFunction.run = _recording_run
    if args.self_test:
        return self_test(_nvdisasm())
    _force_pdl_rule()
    names = set(pdl_kernel_functions())
    nvdisasm = _nvdisasm()
    print(f"triton {triton.__version__}, sm_{ck.H200_CAPABILITY}, PDL up to {pdl.PDL_MAX_ROWS} rows, "
          f"kernels with USE_PDL: {', '.join(sorted(names))}; SASS check: {'on' if nvdisasm else 'off'}")
    for label, fn in cases():
        _CASE[0] = label
        with contextlib.redirect_stdout(io.StringIO()) as log:  # compile_kernels prints every spec
            fn()
        if args.verbose:
            print(f"== {label}\n{log.getvalue()}", end="")
    problems, lines = check(LAUNCHES, names, nvdisasm)
    print("\n".join(lines))
    n_pdl = sum(ln.launch_pdl for ln in LAUNCHES)
    print(f"{len(LAUNCHES)} launches, {n_pdl} with PDL, {len(lines)} PDL specializations checked")
    if problems:
        print(f"\n{len(problems)} PROBLEM(S):")
        for p in problems:
            print(f"  {p}")
        return 1
    print("PDL order: ok (no global memory access before griddepcontrol.wait; EARLY_LOADS kernels: loads only)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
