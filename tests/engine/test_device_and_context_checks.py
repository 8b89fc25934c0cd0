"""Clear errors for a device that is not there and for a context limit past the model's positions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvpilot import LLM
from kvpilot.runner.model_runner import DeviceUnavailableError, check_device

KVPILOT = str(Path(sys.executable).with_name("kvpilot"))
cpu_torch = pytest.mark.skipif(torch.version.cuda is not None, reason="needs a CPU-only build of torch")


@cpu_torch
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_on_a_cpu_build_of_torch(device):
    with pytest.raises(DeviceUnavailableError, match="CPU-only build"):
        check_device(device)


def test_device_names():
    assert check_device("cpu") == torch.device("cpu")
    assert check_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    for bad in ("tpu", "gpu", ""):
        with pytest.raises(ValueError, match="device must be"):
            check_device(bad)


@cpu_torch
def test_llm_refuses_cuda_before_loading(stories_model_dir):
    with pytest.raises(DeviceUnavailableError, match=r"device='cuda'.*install a CUDA build of torch"):
        LLM(str(stories_model_dir), device="cuda")


def test_max_seq_len_past_the_models_positions(stories_model_dir):
    limit = 512  # stories260K's max_position_embeddings
    with pytest.raises(ValueError, match=rf"max_seq_len 4096 is beyond this model's {limit} positions.*"
                                         r"allow_long_max_seq_len=True"):
        LLM(str(stories_model_dir), max_seq_len=4096)
    with LLM(str(stories_model_dir), max_seq_len=limit) as llm:
        assert llm.max_seq_len == limit
    with LLM(str(stories_model_dir), max_seq_len=2 * limit, allow_long_max_seq_len=True) as llm:
        assert llm.max_seq_len == 2 * limit


@pytest.mark.parametrize("args, expect", [
    (["--max-seq-len", "4096"], "max_seq_len 4096 is beyond this model's 512 positions"),
    pytest.param(["--device", "cuda"], "CPU-only build", marks=cpu_torch),
])
def test_serve_reports_one_line_before_starting(stories_model_dir, args, expect):
    proc = subprocess.run([KVPILOT, "serve", str(stories_model_dir), "--port", "1", *args], capture_output=True,
                          text=True, timeout=120, cwd="/")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and expect in lines[0], proc.stderr


def test_serve_with_a_missing_model_directory_is_one_line(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run([KVPILOT, "serve", str(missing), "--port", "1"], capture_output=True, text=True,
                          timeout=120, cwd="/")
    assert proc.returncode == 2
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and f"model '{missing}': no such directory" in lines[0], proc.stderr
