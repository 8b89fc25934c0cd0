"""Programmatic dependent launch switch (kernels/pdl.py): on for small launches on a Hopper GPU,
never on the CPU or under the interpreter, off with KVPILOT_PDL=0; the GPU path is compiled by tests/compile_kernels.py (cases "pdl=")
and measured by benchmarks/gpu_pdl_ab.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


def test_pdl_mode_off_on_the_cpu(monkeypatch):
    from kvpilot.kernels import pdl

    monkeypatch.delenv("KVPILOT_PDL", raising=False)
    assert pdl.pdl_mode(torch.device("cpu"), 1) == 0  # a CPU tensor: no PDL launch option
    assert pdl.launch_options(0) == {}
    assert pdl.launch_options(1) == {"launch_pdl": True}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_pdl_mode_on_a_hopper_gpu(monkeypatch):
    from kvpilot.kernels import pdl

    dev = torch.device("cuda")
    hopper = torch.cuda.get_device_capability()[0] >= 9 and pdl.HAS_GDC
    monkeypatch.delenv("KVPILOT_PDL", raising=False)  # default: on
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert pdl.pdl_mode(dev, 1) == pdl.pdl_mode(dev, pdl.PDL_MAX_ROWS) == (1 if hopper else 0)
    assert pdl.pdl_mode(dev, pdl.PDL_MAX_ROWS + 1) == 0  # larger launches: not measured, off
    monkeypatch.setenv("KVPILOT_PDL", "0")
    assert pdl.pdl_mode(dev, 1) == 0
