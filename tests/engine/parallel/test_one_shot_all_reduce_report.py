"""The one-shot all-reduce's start-up report and switches.

- The ready message's ``one_shot_all_reduce`` holds for every rank of the world, not only for the
  ranks that have a pipe: in a LeaderWorkerSet group the leader's front end hears only its own pod's
  ranks, so with TP 2 x PP 2 over two pods a stage that fell back to NCCL on the other pod must not be
  reported as taking the one-shot kernel. Two CPU processes (gloo) run the real `worker_main` with a
  stand-in `Worker` (the one-shot kernel needs two GPUs): rank 0 with a pipe and the kernel, rank 1
  (another pod: no pipe) without.
- `make_worker_spec` checks ``KVPILOT_TP_CUSTOM_ALLREDUCE_MAX_TOKENS`` exactly where a worker would
  read it: not for TP 2 with one rank per pod (each TP group spans pods: NCCL) or on ROCm, where a
  bad value has no effect and refusing to start is wrong; still on one node with TP 2 on CUDA."""

from __future__ import annotations

import logging
import socket
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the ready message in a group whose ranks do not all have a pipe --------------------------------

class _StandInWorker:
    """What `worker_main` reads of a `Worker`; joins the world's gloo group as the real one does."""

    def __init__(self, rank: int, spec) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=spec.init_method, rank=rank, world_size=2,
                                timeout=timedelta(seconds=30))
        self.rank, self.spec, self.device = rank, spec, "cpu"
        self.logits_buf = None
        self.num_blocks = 7
        car = object() if rank in spec.one_shot_ranks else None
        self.runner = SimpleNamespace(model=SimpleNamespace(pc=SimpleNamespace(custom_all_reduce=car)))


def _rank(rank: int, ports: list, q) -> None:
    import multiprocessing

    import kvpilot.parallel.worker as W

    W.Worker = _StandInWorker
    W._serve = lambda worker, conn: None  # start-up only
    out = {}
    for case, port in zip(("rank1_without_kernel", "both_with_kernel"), ports):
        spec = SimpleNamespace(log_level=logging.WARNING, init_method=f"tcp://127.0.0.1:{port}",
                               one_shot_ranks=(0,) if case == "rank1_without_kernel" else (0, 1))
        # Rank 0 is the leader pod's rank (a pipe to the front end); rank 1 is on another pod (none).
        front, conn = multiprocessing.Pipe() if rank == 0 else (None, None)
        W.worker_main(rank, spec, conn)
        out[case] = front.recv() if front is not None else None
    q.put((rank, out))


@pytest.fixture(scope="module")
def ready_messages():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ports = [_free_port(), _free_port()]
    procs = [ctx.Process(target=_rank, args=(r, ports, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=120) for _ in range(2))
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return got[0]


def test_ready_message_reports_the_one_shot_all_reduce_of_every_rank_not_only_piped_ones(ready_messages):
    msg = ready_messages["rank1_without_kernel"]
    assert msg[:3] == ("ready", 7, None), msg
    # rank 0 reported its own kernel, though rank 1 (no pipe) sums with NCCL.
    assert msg[3] == {"one_shot_all_reduce": False}, msg
    assert ready_messages["both_with_kernel"][3] == {"one_shot_all_reduce": True}


# ---- make_worker_spec's check of KVPILOT_TP_CUSTOM_ALLREDUCE_MAX_TOKENS ------------------------------

def _cfg():
    from kvpilot.model.config import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                       rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                       tie_word_embeddings=False, torch_dtype="float32", bos_token_id=1, eos_token_ids=[2])


def _spec(tp: int, pp: int, device: str, pods: int = 1):
    from kvpilot.config import KvCacheConfig
    from kvpilot.parallel.executor import LwsGroup, make_worker_spec

    group = LwsGroup("10.0.0.1", pods, 0, 29500) if pods > 1 else None
    return make_worker_spec(Path("/nonexistent"), _cfg(), KvCacheConfig(), 64, 4, 128, device, "float32",
                            tp, pp, group)


@pytest.fixture
def bad_max_tokens(monkeypatch):
    monkeypatch.setenv("KVPILOT_TP_CUSTOM_ALLREDUCE_MAX_TOKENS", "lots")
    monkeypatch.delenv("KVPILOT_TP_CUSTOM_ALLREDUCE", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # make_worker_spec's GPU count check
    monkeypatch.setattr(torch.version, "hip", None)


def test_bad_max_tokens_fails_before_workers_start_where_a_worker_would_read_it(bad_max_tokens):
    with pytest.raises(ValueError, match="KVPILOT_TP_CUSTOM_ALLREDUCE_MAX_TOKENS must be a positive integer"):
        _spec(2, 1, "cuda")
    with pytest.raises(ValueError, match="KVPILOT_TP_CUSTOM_ALLREDUCE_MAX_TOKENS"):
        _spec(2, 2, "cuda", pods=2)  # two ranks per pod: each pod holds one whole TP group


@pytest.mark.parametrize("tp,pp,device,pods", [(2, 1, "cuda", 2), (2, 3, "cuda", 2), (2, 1, "cpu", 1),
                                               (1, 2, "cuda", 1), (4, 1, "cuda", 1)])
def test_bad_max_tokens_is_ignored_where_no_worker_reads_it(bad_max_tokens, tp, pp, device, pods):
    # TP 2 with a TP group spanning pods (one or three ranks per pod): the workers keep NCCL there
    # and never read the variable, so the engine starts.
    spec = _spec(tp, pp, device, pods)
    assert (spec.tp_size, spec.pp_size, spec.device) == (tp, pp, device)


def test_bad_max_tokens_is_ignored_on_rocm(bad_max_tokens, monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.2.0")  # the one-shot kernel is off on ROCm
    assert _spec(2, 1, "cuda").tp_size == 2
    monkeypatch.setenv("KVPILOT_TP_CUSTOM_ALLREDUCE", "0")
    monkeypatch.setattr(torch.version, "hip", None)
    assert _spec(2, 1, "cuda").tp_size == 2  # switched off: not read either


# ---- benchmarks/lab/gpu_tp_profile.py --sampled ----------------------------------------------------------
