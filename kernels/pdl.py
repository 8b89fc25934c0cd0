"""Programmatic dependent launch (PDL) for the decode path's Triton kernels (Hopper).

A kernel launched with PDL may be scheduled while the kernel before it in the stream is still
running: its programs start, and ``griddepcontrol.wait`` (Triton: ``gdc_wait``) blocks each of them
until that kernel has finished and its memory writes are visible. Each kernel here also calls
``griddepcontrol.launch_dependents`` (``gdc_launch_dependents``) on entry, so the next PDL kernel is
scheduled as early as possible; the batch-1 GEMVs (kernels/gemv.py) call it later, when a program
starts its last column tile (`pdl_wait` on entry, `pdl_trigger` then): 129.5 against 130.8 us per
decoder layer, three runs each (H200, BENCHMARKS.md). The gap between two kernels
(the next one's launch and its programs' start) then overlaps the previous kernel's last programs;
the CUDA Programming Guide, "Programmatic Dependent Launch and Synchronization", describes the
mechanism. CUDA graphs keep these programmatic edges when the launches are captured.

Rules the kernels follow: `pdl_enter` (or `pdl_wait`) runs first, before any load or store of
memory another kernel writes or reads. A kernel that never calls ``gdc_wait`` must not be launched
with PDL; a kernel launched without PDL that calls it does not wait (the instruction returns at
once).

PDL is used for launches of at most ``PDL_MAX_ROWS`` tokens or sequences (decode at small batch,
where the gaps between kernels are a measurable share of a step: batch-1 ITL 4.566 -> 4.461 ms on
an H200, BENCHMARKS.md). Only on Hopper (compute capability 9.x, not ROCm), never under the CPU
interpreter, and not when this Triton has no ``gdc_wait`` or ``launch_pdl``. Tests that compare a
chain with and without PDL replace `pdl_mode` in the kernel modules (tests/support/pdl.py).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvpilot import envs

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    from triton.backends.nvidia.compiler import CUDAOptions

    # the launch option that sets the PDL attribute (Triton >= 3.3)
    HAS_GDC = "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
except ImportError:  # an older Triton: PDL stays off (the names are only used when it is on)
    gdc_launch_dependents = gdc_wait = None
    HAS_GDC = False


@functools.lru_cache(maxsize=None)
def _capable(device_index: int) -> bool:
    # Hopper only: measured on an H200; newer GPUs are untested (some projects report graph-capture
    # failures with PDL on sm_120), and a ROCm build reports AMD GPUs as "cuda" with capability 9.x.
    return torch.version.hip is None and torch.cuda.get_device_capability(device_index)[0] == 9


PDL_MAX_ROWS = 8
"""Largest launch (tokens or sequences) that uses PDL: measured at batch 1 (module docstring)."""


def pdl_mode(device: torch.device, rows: int) -> int:
    """1 when a launch of ``rows`` tokens or sequences on ``device`` uses PDL, else 0 (module
    docstring)."""
    if rows > PDL_MAX_ROWS or device.type != "cuda" or not HAS_GDC:
        return 0
    if envs.triton_interpret():
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    return 1 if _capable(index) else 0


def launch_options(mode: int) -> dict:
    """Extra launch keywords of a launch with `pdl_mode` ``mode``."""
    return {"launch_pdl": True} if mode else {}


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait for the kernels before this one (no-op when ``USE_PDL`` is false); for kernels that call
    `pdl_trigger` later themselves."""
    if USE_PDL:
        gdc_wait()


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """Let the next PDL kernel be scheduled (no-op when ``USE_PDL`` is false)."""
    if USE_PDL:
        gdc_launch_dependents()


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """Let the next PDL kernel be scheduled, then wait for the kernels before this one (no-op
    when ``USE_PDL`` is false)."""
    if USE_PDL:
        gdc_launch_dependents()
        gdc_wait()
