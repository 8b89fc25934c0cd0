"""Run kernels without programmatic dependent launch, to compare a chain with and without it."""

from __future__ import annotations

import contextlib
import sys


@contextlib.contextmanager
def pdl_forced(mode: int | None):
    """Within the block every kvpilot kernel module's ``pdl_mode`` returns ``mode`` (0: no launch
    uses PDL; 1: every launch does); ``None`` leaves the rule of kernels/pdl.py."""
    from kvpilot.kernels import pdl

    if mode is None:
        yield
        return
    from kvpilot.kernels import allreduce, decode_attention, fused_decode_attention, gemv, kv_cache, pointwise  # noqa: F401

    original = pdl.pdl_mode
    patched = []
    for name, mod in list(sys.modules.items()):
        if name.startswith("kvpilot.kernels") and getattr(mod, "pdl_mode", None) is original:
            patched.append(mod)
            mod.pdl_mode = lambda device, rows: mode
    try:
        yield
    finally:
        for mod in patched:
            mod.pdl_mode = original
