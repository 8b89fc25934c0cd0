"""The one-shot all-reduce folded into the batch-1 decode GEMVs (``KVPILOT_TP_FUSED_ALLREDUCE``), on CPU.

Kernel level (two processes, the real protocol): tests/test_kernels_allreduce.py. Here:

- Engine level (``TRITON_INTERPRET=1``): two processes (gloo) each build a TP-2 `ModelRunner` of a
  tiny biased Llama on CPU whose one-shot all-reduce buffers are shared CPU memory (the kernel's
  device check relaxed, the GEMV dispatchers sent to the Triton kernels as on a GPU). Prefill,
  batch-2 and batch-1 decode steps give bit for bit the same logits with the fold on and off; at
  batch 1 only the embedding's and the last layer's all-reduces remain kernels, the others are
  folded; every buffer ends empty.
- `ParallelContext` wiring with fakes: when a forward pass folds (one row, Triton, switch, sizes),
  what `row_parallel` hands the GEMV (``push`` / ``reset``), and the switch's agreement in
  `CustomAllReduce.create` (the last layer's site: tests/test_kernels_allreduce.py).
- GPU: tests/test_fused_allreduce_gpu.py.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
LAYERS, HIDDEN = 2, 64
PROMPTS = [[1, 17, 40, 3, 99, 5, 60, 7, 8], [1, 2, 30, 44, 5]]
TABLES = [[0, 1, 2], [3, 4]]
SOLO_STEPS = 2


def _steps(runner, tokens=None):
    """Prefill both prompts (14 tokens), one decode step of both (2 rows), then ``SOLO_STEPS`` of the
    first alone (1 row). Decode inputs: the greedy tokens, or ``tokens`` (another run's schedule).
    Returns (logits per step, tokens per step)."""
    from kvpilot.model_runner import ScheduledSeq

    lens = [len(p) for p in PROMPTS]
    logits, _ = runner.execute([ScheduledSeq(i, p, 0, TABLES[i], True) for i, p in enumerate(PROMPTS)])
    out, used = [logits.clone()], []
    nxt = logits.argmax(-1).tolist()
    for step in range(1 + SOLO_STEPS):
        active = [0, 1] if step == 0 else [0]
        toks = tokens[step] if tokens is not None else [nxt[i] for i in active]
        logits, _ = runner.execute([ScheduledSeq(i, [t], lens[i], TABLES[i], True) for i, t in zip(active, toks)])
        out.append(logits.clone())
        used.append(toks)
        for j, i in enumerate(active):
            lens[i] += 1
            nxt[i] = int(logits[j].argmax())
    return out, used


def _engine_rank(rank: int, init_method: str, model_dir: str, bufs: list, conn) -> None:
    import pickle
    import traceback

    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import torch.distributed as dist

        from kvpilot.custom_all_reduce import CustomAllReduce
        from kvpilot.kernels import gemv as G
        from kvpilot.llama import ParallelContext
        from parallel_exact_helpers import _runner

        class HostOneShot(CustomAllReduce):
            """The one-shot kernel on CPU tensors (under the interpreter, in shared memory)."""

            def fits(self, x, site):
                return x.is_contiguous() and 0 < x.numel() <= self.site_numel and 0 <= site < self.num_sites

        # The dispatchers' GPU rule for CPU tensors: Triton up to FUSED_MAX_ROWS[op] rows; grids of
        # persistent programs as on a GPU of one SM (few programs: the interpreter's time goes with them).
        G._use_triton = lambda x, op: x.dim() == 2 and x.shape[0] <= G.FUSED_MAX_ROWS[op]
        # Launch tables of few programs (the interpreter's time goes with them; the kernel paths
        # themselves are tests/test_kernels_allreduce.py's): one or two column tiles per op.
        c = G.launch_config
        G.CONFIGS = {"rmsnorm": [(1, 0, c("fma", 1, 64, 64, norm_one_load=True, early_weight=True))],
                     "silu": [(1, 0, c("fma", 1, 64, 64))], "plain": [(2, 0, c("fma", 2, 64, 64))]}
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2,
                                timeout=timedelta(seconds=120))
        res, tokens = {}, None
        with torch.inference_mode():
            for fold in (True, False):
                car = HostOneShot(bufs[rank], bufs[1 - rank], fold=fold)
                pc = ParallelContext(rank, 2, None, custom_all_reduce=car)
                runner = _runner(model_dir, "bfloat16", pc)
                logits, tokens = _steps(runner, tokens)
                res[fold] = ([t.float() for t in logits], tokens, car.calls, car.folded, pc.num_sites)
        dist.destroy_process_group()
        msg = ("ok", rank, res)
    except BaseException as e:  # noqa: BLE001 - report anything to the test
        msg = ("error", rank, "".join(traceback.format_exception(type(e), e, e.__traceback__)))
    conn.send_bytes(pickle.dumps(msg))
    conn.close()


@pytest.mark.skipif(not INTERPRET, reason="runs the Triton kernels under TRITON_INTERPRET=1")
def test_engine_steps_are_bit_identical_with_the_fold_on_and_off(tmp_path):
    from parallel_exact_helpers import spawn_ranks
    from test_llama_fused_gemv import _checkpoint

    from kvpilot.kernels import allreduce as A

    model_dir = _checkpoint(tmp_path / "ckpt", bias=True)  # o_proj / down biases: rank 0 pushes them
    sites, width = 1 + 2 * LAYERS, 16 * HIDDEN  # the embedding + two per layer; a 14-token prefill fits
    bufs = [A.empty_receive_buffer(sites * width, "cpu").view(sites, width).share_memory_() for _ in range(2)]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        init = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    got = spawn_ranks(_engine_rank, lambda r: (init, str(model_dir), bufs), timeout_s=600)
    for rank in (0, 1):
        (lf, tf, calls_f, folded_f, n_sites), (lu, tu, calls_u, folded_u, _) = got[rank][True], got[rank][False]
        assert n_sites == sites
        assert tf == tu
        assert [tuple(t.shape) for t in lf] == [(2, 128)] * 2 + [(1, 128)] * SOLO_STEPS
        for step, (a, b) in enumerate(zip(lf, lu)):
            assert torch.equal(a, b), (rank, step)
        # Unfolded: every site a kernel at every step. Folded: at batch 1 the embedding's and the last
        # down_proj's all-reduces stay kernels, the other 2 * LAYERS - 1 are pushed by their GEMV.
        steps = 2 + SOLO_STEPS
        assert (calls_u, folded_u) == (steps * sites, 0)
        assert (calls_f, folded_f) == (2 * sites + SOLO_STEPS * 2, SOLO_STEPS * (2 * LAYERS - 1))
    assert torch.equal(got[0][True][0][-1], got[1][True][0][-1])
    for b in bufs:
        assert (b.view(torch.int32) == A.SENTINEL_BITS).all()


# ---- ParallelContext wiring, with fakes ------------------------------------------------------------------
class _FakeCar:
    """`CustomAllReduce`'s interface over plain tensors; ``all_reduce`` doubles (a recognisable sum)."""

    def __init__(self, sites: int, numel: int, fold: bool = True) -> None:
        self.recv = torch.zeros(sites, numel)
        self.peer_recv = torch.zeros(sites, numel)
        self.num_sites, self.site_numel, self.fold = sites, numel, fold
        self.calls = self.folded = 0

    def fits(self, x, site):
        return x.numel() <= self.site_numel and 0 <= site < self.num_sites

    def all_reduce(self, x, site):
        self.calls += 1
        return x.mul_(2)

    def site_recv(self, site, numel):
        return self.recv[site, :numel]

    def site_peer_recv(self, site, numel):
        return self.peer_recv[site, :numel]


def _triton_everywhere(monkeypatch):
    from kvpilot.kernels import gemv as G

    monkeypatch.setattr(G, "_use_triton", lambda x, op: x.dim() == 2 and x.shape[0] <= G.FUSED_MAX_ROWS[op])


def test_a_pass_folds_only_at_one_row_on_triton_with_the_switch_and_room(monkeypatch):
    from kvpilot.llama import ParallelContext

    one, two = torch.ones(1, 8), torch.ones(2, 8)
    pc = ParallelContext(0, 2, None, custom_all_reduce=_FakeCar(4, 8))
    assert not pc.fold_all_reduce(one, 1, 2)  # CPU tensors: the dispatchers run torch, not Triton
    _triton_everywhere(monkeypatch)
    assert pc.may_fold and pc.fold_all_reduce(one, 1, 2)
    assert not pc.fold_all_reduce(two, 1, 2)  # batch 2: no fold
    assert not pc.fold_all_reduce(torch.ones(1, 9), 1, 2)  # larger than the buffers
    assert not pc.fold_all_reduce(one, 1, 4)  # no buffer for site 4
    for off in (ParallelContext(0, 2, None, custom_all_reduce=_FakeCar(4, 8, fold=False)),
                ParallelContext(0, 2, None), ParallelContext(0, 1, None, custom_all_reduce=_FakeCar(4, 8))):
        assert not off.may_fold and not off.fold_all_reduce(one, 1, 2)


def test_row_parallel_hands_the_plan_to_the_gemv_once(monkeypatch):
    from kvpilot.llama import ParallelContext

    car = _FakeCar(4, 8)
    seen = []

    def matmul(x, w, b, out_dtype, push=None, reset=None):
        seen.append((b is not None, push, reset))
        return torch.nn.functional.linear(x, w, b)

    for rank in (0, 1):
        pc = ParallelContext(rank, 2, None, custom_all_reduce=car)
        x, w, bias = torch.ones(1, 8), torch.eye(8), torch.ones(8)
        pc.plan_fold(2, push=True, reset=1)
        out = pc.row_parallel(x, w, bias, matmul, False, site=2)
        has_bias, push, reset = seen[-1]
        assert has_bias is (rank == 0)  # rank 0's partial carries the bias, as unfolded
        assert push.data_ptr() == car.peer_recv[2].data_ptr() and push.numel() == 8
        assert reset.data_ptr() == car.recv[1].data_ptr() and reset.numel() == 8
        assert torch.equal(out, torch.ones(1, 8) + (bias if rank == 0 else 0))  # unreduced: pulled later
        assert car.calls == rank and car.folded == rank + 1  # (rank 0's plain call below counts for rank 1)
        pc.row_parallel(x, w, None, matmul, False, site=2)  # the plan was used up: a plain all-reduce
        assert seen[-1] == (False, None, None) and car.calls == rank + 1
    # reset only (the last layer's down_proj): the GEMV resets, the kernel reduces
    pc.plan_fold(3, push=False, reset=2)
    out = pc.row_parallel(torch.ones(1, 8), torch.eye(8), None, matmul, False, site=3)
    assert seen[-1][1] is None and seen[-1][2].data_ptr() == car.recv[2].data_ptr()
    assert torch.equal(out, torch.full((1, 8), 2.0)) and car.calls == 3
    # a plan to neither push nor reset is no plan
    pc.plan_fold(3, push=False, reset=None)
    pc.row_parallel(torch.ones(1, 8), torch.eye(8), None, matmul, False, site=3)
    assert seen[-1] == (False, None, None)


def test_a_reset_planned_on_the_fp32_reduction_is_done_by_itself():
    # Only if layers mixed KVPILOT_TP_REDUCE_FP32 (the model never does): the buffer is still reset.
    from kvpilot.kernels import allreduce as A
    from kvpilot.llama import ParallelContext

    car = _FakeCar(4, 8)
    pc = ParallelContext(1, 2, None, custom_all_reduce=car)
    pc.plan_fold(2, push=False, reset=1)
    x = torch.ones(1, 8, dtype=torch.bfloat16)
    out = pc.row_parallel(x, torch.eye(8, dtype=torch.bfloat16), None,
                          lambda x, w, b, dt: torch.nn.functional.linear(x, w).to(dt or x.dtype), True, site=2)
    assert out.dtype == torch.bfloat16 and torch.equal(out.float(), torch.full((1, 8), 2.0))
    assert (car.recv[1].view(torch.int32) == A.SENTINEL_BITS).all() and (car.recv[0] == 0).all()
    pc.plan_fold(2, push=True, reset=None)
    with pytest.raises(ValueError, match="16-bit partials"):
        pc.row_parallel(x, torch.eye(8, dtype=torch.bfloat16), None, lambda *a: None, True, site=2)


def test_pushed_partials_are_handed_to_the_next_site_only():
    from kvpilot.llama import ParallelContext

    pc = ParallelContext(0, 2, None)
    pc.pushed(4)
    assert pc.take_pushed(4) == 4 and pc.take_pushed(4) is None  # taken once
    pc.pushed(4)
    assert pc.take_pushed(0) is None and pc.take_pushed(4) is None  # another site clears it


def _create_rank(rank: int, port: int, flags: tuple, q) -> None:
    """`CustomAllReduce.create` with fakes of the GPU-only pieces (tests/test_review_session10.py),
    ``KVPILOT_TP_FUSED_ALLREDUCE`` per rank from ``flags``; puts (rank, fold)."""
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    from kvpilot.custom_all_reduce import CustomAllReduce

    os.environ["KVPILOT_TP_CUSTOM_ALLREDUCE_MAX_TOKENS"] = "2"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=30))
    group = dist.new_group([0, 1])

    class Handle:
        def get_buffer(self, peer, sizes, dtype):
            return torch.empty(sizes, dtype=dtype)

    def rendezvous(tensor, grp):
        dist.barrier(group=grp)
        return Handle()

    real_tensor = torch.tensor
    symm_mem.empty = lambda n, dtype=None, device=None: torch.empty(n, dtype=dtype)
    symm_mem.rendezvous = rendezvous
    torch.cuda.can_device_access_peer = lambda a, b: True
    torch.cuda.synchronize = lambda *a, **k: None
    torch.tensor = lambda *a, device=None, **k: real_tensor(*a, **k)  # agreement tensors on the host
    out = []
    for pair in flags:
        if pair[rank] is None:
            os.environ.pop("KVPILOT_TP_FUSED_ALLREDUCE", None)
        else:
            os.environ["KVPILOT_TP_FUSED_ALLREDUCE"] = pair[rank]
        car = CustomAllReduce.create(group, rank, 2, torch.device("cuda", rank), 3, 8)
        out.append(None if car is None else car.fold)
    q.put((rank, out))
    dist.destroy_process_group()


def test_create_agrees_on_the_fold_switch():
    from test_kernels_allreduce import _run_two

    flags = ((None, None), ("0", "1"), ("1", "0"), ("0", "0"), ("1", None))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    got = _run_two(_create_rank, port, flags)
    want = [True, False, False, False, True]  # on by default; off on either rank: off on both
    assert got[0] == want and got[1] == want


def test_fused_all_reduce_switch(monkeypatch):
    from kvpilot.custom_all_reduce import fused_all_reduce_enabled

    monkeypatch.delenv("KVPILOT_TP_FUSED_ALLREDUCE", raising=False)
    assert fused_all_reduce_enabled()
    for value, on in (("0", False), ("false", False), ("1", True)):
        monkeypatch.setenv("KVPILOT_TP_FUSED_ALLREDUCE", value)
        assert fused_all_reduce_enabled() is on


def test_fold_arguments_need_the_triton_kernel_and_float32_buffers():
    from kvpilot.kernels import gemv as G

    x, w = torch.ones(1, 8), torch.ones(4, 8)
    buf = torch.zeros(16)
    with pytest.raises(ValueError, match="needs the Triton kernel"):
        G.gemv(x, w, push=buf)  # a CPU tensor: the dispatcher would run torch
    with pytest.raises(ValueError, match="needs the Triton kernel"):
        G.silu_mul_gemv(torch.ones(1, 16), w, reset=buf)
    with pytest.raises(ValueError, match="needs the Triton kernel"):
        G.rmsnorm_gemv(x, x, torch.ones(8), 1e-5, w, pull=buf)
    if G.triton is None:
        return
    with pytest.raises(ValueError, match="push must be a contiguous float32"):
        G.gemv_triton(x, w, push=torch.zeros(16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="reset must be a contiguous float32 receive buffer of at least 4"):
        G.gemv_triton(x, w, reset=torch.zeros(3))
    with pytest.raises(ValueError, match="pull must be a contiguous float32 receive buffer of at least 8"):
        G.rmsnorm_gemv_triton(x, x, torch.ones(8), 1e-5, w, pull=torch.zeros(7))
    with pytest.raises(ValueError, match="pull is only for the RMSNorm"):
        G._check_fold(G._PLAIN, 1, 8, 4, torch.zeros(8), None, None)
