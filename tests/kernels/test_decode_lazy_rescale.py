"""Decode attention's lazy rescale (``TUNING["decode"]["lazy_rescale"]``): bit-identical to the eager
update on padded GQA rows and underflowing ``alpha`` (``TRITON_INTERPRET=1``), the eager path keeps
its fused multiply-adds when compiled for sm_90 (a subprocess; skipped without Triton's nvidia
backend), and on an H200 the serving shape is bit-identical (``gpu``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch


from support.paths import TOOLS, load_benchmark

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels in the interpreter")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRET, reason="needs a CUDA GPU")


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


# ==== 2. lazy rescale of the decode kernel ======================================================
def _decode_pair(monkeypatch, q_lens_ctx, num_heads, num_kv_heads, spike_at=None, num_splits=1):
    """(eager, lazy, reference) decode outputs on the CPU interpreter for one paged batch."""
    from kvpilot.kernels import attention
    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401
    from kvpilot.kernels.attention import paged_attention_triton
    from kvpilot.kernels.reference import paged_attention_ref
    from support.paged_attention import make_paged_batch

    ctx = q_lens_ctx
    q, kc, vc, bt, sl, qsl, _, _ = make_paged_batch([1] * len(ctx), ctx, num_heads, num_kv_heads, 32, 16)
    if spike_at is not None:
        # keys aligned with their kv head's queries: each row's max jumps late by 70-400 log2
        # units (past 149 alpha underflows to exactly 0: the running output is dropped)
        for s, pos in enumerate(spike_at):
            if pos is None:
                continue
            blk, off = int(bt[s, pos // 16]), pos % 16
            for h in range(num_kv_heads):
                group = q[s, h * (num_heads // num_kv_heads):(h + 1) * (num_heads // num_kv_heads)]
                kc[blk, off, h] = 80.0 * group.mean(0).sign()
    args = (bt, sl, qsl, 0.125, 1, max(ctx) + 1)
    outs = []
    for lazy in (False, True):
        monkeypatch.setitem(attention.TUNING, "decode", dict(attention.TUNING["decode"], lazy_rescale=lazy))
        outs.append(paged_attention_triton(q, kc, vc, *args, num_splits=num_splits))
    return outs[0], outs[1], paged_attention_ref(q, kc, vc, *args)


@needs_interpreter
@pytest.mark.parametrize("num_splits", [1])  # split launches are always eager
def test_lazy_rescale_padded_gqa_rows_and_underflowing_alpha(monkeypatch, num_splits):
    """Checked on the CPU (where no FMA is involved): GQA 3 (13 padded rows of a 16-row tile, q = 0,
    scores 0: their max never moves but they take part in the "did any max move" reduction), and
    keys whose score jumps so far late in the context that alpha is exactly 0; contexts ending on
    and across 64-key tiles, splits whose first tile is short. Lazy = eager bit for bit, and both
    equal the reference."""
    ctx = [1, 64, 129, 200, 255]
    eager, lazy, ref = _decode_pair(monkeypatch, ctx, 6, 2, spike_at=[None, 60, 128, 190, 250],
                                    num_splits=num_splits)
    assert torch.equal(eager, lazy)
    torch.testing.assert_close(lazy, ref, atol=1e-4, rtol=1e-4)


_FMA_SCRIPT = """
import re
import importlib.util, sys
_spec = importlib.util.spec_from_file_location("compile_kernels", sys.argv[1] + "/compile_kernels.py")
ck = sys.modules["compile_kernels"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ck)  # tools/compile_kernels.py: removes TRITON_INTERPRET; compiles for sm_90 without a GPU
ck.install()
ck._patch_gpu_paths()
import torch
from kvpilot.kernels import attention
from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401
attention.TUNING["decode"].update(batch_tma=False, batch_tma_fp8=False)  # the pointer kernel's full batch
for lazy in (False, True):
    attention.TUNING["decode"]["lazy_rescale"] = lazy
    cache = decode_attention._decode_kernel.device_caches[0][0]
    before = set(cache)
    ck._attention(ck.Shard(1), [1] * 64, [1000] * 64, torch.bfloat16)()  # bf16 cache, batch 64
    ptx = [cache[k].asm["ptx"] for k in cache if k not in before]
    assert len(ptx) == 1, len(ptx)
    print(f"lazy={int(lazy)} fma={len(re.findall(r'fma[.]rn[.]f32', ptx[0]))}")
"""


def test_lazy_rescale_has_the_eager_fused_multiply_adds_on_sm90(tmp_path):
    """The lazy-rescale decode kernel has the eager kernel's two ``fma.rn.f32`` per row on sm_90.

    The eager update ``l_i = l_i * alpha + tl.sum(p, 1)`` compiles to one FMA (Triton contracts mul +
    add). The lazy branch computes ``p`` and ``l_i = l_i * alpha + tl.sum(p, 1)`` inside the moved
    branch and ``l_i = l_i + tl.sum(p, 1)`` in an ``else`` (eager's fma(l, 1, s) rounds like l + s);
    split across the branch (multiply inside, add after) they would not be contracted, ``l_i`` would be
    rounded twice in every tile where a row's max moved, and the output would differ from the eager
    kernel's in its last bits on the GPU (the CPU interpreter has no FMA, so CPU tests cannot see it)."""
    _needs_nvidia_backend()
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        if not os.path.exists(get_ptxas(90).path):
            pytest.skip("no ptxas for sm_90")
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"no ptxas for sm_90: {e}")
    fma = {}
    for line in _run_script(tmp_path, _FMA_SCRIPT).splitlines():
        if line.startswith("lazy="):  # "lazy=1 fma=0"
            lazy, n = (part.split("=")[1] for part in line.split())
            fma[lazy == "1"] = int(n)
    assert fma[False] > 0  # the eager kernel fuses the running-sum update
    assert fma[True] == fma[False], fma


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_gpu_decode_lazy_rescale_is_bit_identical_at_serving_shape(monkeypatch, kv):
    """On an H200: Llama-3.1-8B decode (32 query / 8 kv heads of 128), 96 sequences of 200-3,000 tokens,
    with and without splits; lazy equals eager bit for bit."""
    from kvpilot.kernels import attention
    from kvpilot.kernels import attention_common, decode_attention, fused_decode_attention, prefill_attention  # noqa: F401
    from kvpilot.kernels.attention import paged_attention_triton

    decode_batch = load_benchmark("gpu_decode_sampler_checks").decode_batch

    g = torch.Generator(device="cuda").manual_seed(0)
    args = decode_batch(kv, torch.randint(200, 3000, (96,), generator=g, device="cuda").int(), g)
    for splits in (1, None):
        outs = []
        for lazy in (False, True):
            # `_decode_kernel`'s claim: full batches would otherwise take `_decode_tma_kernel`, whose
            # lazy rescale is not bit-identical to its eager one (the running sum is rounded twice).
            monkeypatch.setitem(attention.TUNING, "decode", dict(attention.TUNING["decode"], lazy_rescale=lazy,
                                                                 batch_tma=False, batch_tma_fp8=False))
            kw = {} if splits is None else {"num_splits": splits}
            outs.append(paged_attention_triton(*args, **kw))
        torch.cuda.synchronize()
        diff = (outs[0].float() - outs[1].float()).abs()
        assert torch.equal(outs[0], outs[1]), (splits, int((diff > 0).sum()), float(diff.max()))
