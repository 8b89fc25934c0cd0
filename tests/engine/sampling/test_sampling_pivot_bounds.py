"""The Triton sampler's pivot path (top-p / min-p rows) at its bounds: every generation cap equals the
exact draw with bounds checks on, all-NaN greedy and plain rows get token 0, and the pivot kernels
compile one variant set for every batch size (a subprocess compiling for sm_90; skipped without
Triton's nvidia backend). The kernels run under ``TRITON_INTERPRET=1``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvpilot.sampling.sampler import Sampler, SamplingRow

from support.paths import TOOLS

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels in the interpreter")


def _needs_nvidia_backend() -> None:
    import importlib.util

    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None:
        pytest.skip("triton's nvidia backend is not installed")


def _run_script(tmp_path: Path, source: str, *args: str) -> str:
    """Run ``source`` in a fresh interpreter without TRITON_INTERPRET (so kernels are real
    JITFunctions), from ``tmp_path`` (the repository's ``operator/`` must not shadow the stdlib)."""
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(source))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")
    proc = subprocess.run([sys.executable, str(script), str(TOOLS), *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


# ==== 1. the sampler's pivot path ===============================================================
def _rows(settings, seed0=0, step=3):
    """SamplingRow per (temperature, top_p, min_p[, top_k])."""
    return [SamplingRow(temperature=s[0], top_p=s[1], min_p=s[2], top_k=s[3] if len(s) > 3 else 0,
                        seed=seed0 + i, step=step) for i, s in enumerate(settings)]


def _mixed_pivot_batch():
    """min-p-only rows between top-p rows (both kinds in one launch), a top-p + min-p row, a row
    with a third of its vocabulary masked, one with a single finite token, and one all -inf."""
    g = torch.Generator().manual_seed(3)
    settings = [(1.0, 0.5, 0.0), (1.0, 1.0, 0.3), (0.7, 0.9, 0.05), (1.0, 1.0, 0.9), (1.3, 0.05, 0.0),
                (1.0, 1.0, 0.1), (1.0, 0.9, 0.0), (1.0, 1.0, 0.5), (0.9, 0.01, 0.0)]
    rows = _rows(settings, seed0=11)
    scales = torch.tensor([0.3, 0.5, 1.0, 2.0, 0.2, 0.4, 3.0, 0.6, 0.8])[:, None]
    logits = torch.randn(len(rows), 600, generator=g) * scales
    logits[4, ::3] = float("-inf")
    logits[5, :] = float("-inf")
    logits[5, 17] = 1.0
    logits[6, :] = float("-inf")
    return logits, rows


@needs_interpreter
@pytest.mark.parametrize("fuse", [0, 1], ids=["separate C passes", "fused"])
def test_pivot_every_generation_cap_equals_exact_with_bounds_checks(monkeypatch, fuse):
    """Checked: the ``[launches + 1, rows]`` state rows for every ``pivot_rounds`` 1..4 with and
    without ``pivot_fuse`` (launches = G fused, 2G - 1 otherwise; the last row is what
    `_resolve_kernel` reads), one chunk (and three for G = 1 and 4), under
    ``check=True`` (no index of any pass leaves its buffer). Every settled row equals
    the exact reference; the all -inf row is always handed to the exact path (-1); from two
    generations on every other row settles."""
    from support.sampling import _kernel_draw

    logits, rows = _mixed_pivot_batch()
    want = Sampler("exact").choose(logits, rows)
    assert want[5] == 17
    multi = dict(chunk=256, block=256, pivot_block=128, pivot_cblock=64)
    for G in (1, 2, 3, 4):
        for cfg in ({}, multi) if G in (1, 4) else ({},):
            got = _kernel_draw(logits, rows, pivot_rounds=G, pivot_fuse=fuse, check=True, **cfg)
            assert got[6] == -1, (G, cfg)
            assert [t for t in got if t >= 0] == [w for t, w in zip(got, want) if t >= 0], (G, cfg)
            if G >= 2:
                assert sum(t < 0 for t in got) == 1, (G, cfg, got)


@needs_interpreter
def test_all_nan_greedy_and_plain_rows_get_token_0():
    """A greedy or plain-temperature row whose logits are all NaN (a numerically broken forward) gets
    token 0, as on the exact and torch paths (torch.argmax of an all-NaN row).

    Every comparison with NaN is false, so no column ever becomes the chunk's best and the id would
    stay the INT_MAX sentinel (`_plain_kernel` / `_resolve_kernel`); with async scheduling the device
    would feed it straight into the next step's embedding lookup (a read far out of bounds on the
    GPU). `_resolve_kernel`'s plain branch maps the sentinel to 0. The pivot path hands NaN rows to the
    exact path."""
    rows = _rows([(0.0, 1.0, 0.0), (0.8, 1.0, 0.0), (1.0, 0.9, 0.0), (1.0, 1.0, 0.1), (1.0, 0.9, 0.0, 20)])
    logits = torch.full((len(rows), 300), float("nan"))
    want = Sampler("exact").choose(logits, rows)
    assert want == Sampler("torch").choose(logits, rows)
    got = Sampler("triton").choose(logits, rows)
    assert all(0 <= t < 300 for t in got), got
    assert got == want


_SPECIALIZATION_SCRIPT = """
import json
import importlib.util, sys
_spec = importlib.util.spec_from_file_location("compile_kernels", sys.argv[1] + "/compile_kernels.py")
ck = sys.modules["compile_kernels"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ck)  # tools/compile_kernels.py: removes TRITON_INTERPRET; its fake driver reports an sm_90 GPU
import torch, triton
from triton.runtime.jit import JITFunction, compute_cache_key
triton.runtime.driver.set_active(ck.FakeCudaDriver())
KEYS, CUR = {}, None

def record(self, *args, grid, warmup, **kwargs):
    # The key JITFunction.run looks its compiled variants up by; nothing is compiled or launched.
    kwargs["debug"] = kwargs.get("debug", self.debug)
    _, _, _, _, binder = self.device_caches[triton.runtime.driver.active.get_current_device()]
    _, spec, options = binder(*args, **kwargs)
    KEYS.setdefault(self.__name__, {}).setdefault(compute_cache_key({}, spec, options), []).append(CUR)

JITFunction.run = record
from kvpilot.kernels import sampling as ks
from kvpilot.sampling.sampler import SamplingRow, _Draw
V = 128256
for S in (1, 7, 16, 33, 48):  # the batch: only the row count of the logits changes
    CUR = S
    rows = [SamplingRow(temperature=1.0, top_p=0.9, seed=i, step=1) for i in range(S)]
    d = _Draw(rows, V)
    fprm, iprm, order = (torch.from_numpy(a) for a in (d.fprm, d.iprm, d.order))
    ks.draw(torch.empty(S, V), fprm, iprm, order[:0], order, n_pivot=d.n_pivot)
print(json.dumps({k: len(v) for k, v in KEYS.items()}))
"""


def test_pivot_kernels_compile_one_variant_set_for_every_batch_size(tmp_path):
    """`_pivot_first_kernel` and `_pivot_kernel` compile one variant set for every batch size: ``S`` (the
    logits' row count, for the debug bounds check) and ``NC`` (``vcy.numel()``, which scales with the
    pivot-row count) are in ``do_not_specialize``. Triton specialises ints on == 1 and on divisibility by
    16, so otherwise a batch of 1, a batch that is a multiple of 16 and any other batch would each
    compile their own variants the first time they are seen: compiles in the middle of serving, which
    kernels/sampling.py avoids."""
    _needs_nvidia_backend()
    import json

    variants = json.loads(_run_script(tmp_path, _SPECIALIZATION_SCRIPT).strip().splitlines()[-1])
    assert variants["_resolve_kernel"] == 1
    assert variants["_pivot_first_kernel"] == 1, variants
    assert variants["_pivot_kernel"] == 3, variants  # M pass 0 (TOTAL), C pass, later M passes
