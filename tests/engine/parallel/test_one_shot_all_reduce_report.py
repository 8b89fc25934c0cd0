"""The one-shot all-reduce's start-up report and switches.

- The ready message's ``one_shot_all_reduce`` holds for every rank of the world, not only for the
  ranks that have a pipe: in a LeaderWorkerSet group the leader's front end hears only its own pod's
  ranks, so with TP 2 x PP 2 over two pods a stage that fell back to NCCL on the other pod must not be
  reported as taking the one-shot kernel. Two CPU processes (gloo) run the real `worker_main` with a
  stand-in `Worker` (the one-shot kernel needs two GPUs): rank 0 with a pipe and the kernel, rank 1
  (another pod: no pipe) without.
- A bad ``Tuning.tp_custom_allreduce_max_tokens`` is refused where the record is built, before any
  worker starts; `make_worker_spec` carries the record to every rank, whatever the layout."""

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


# ---- the one-shot kernel's size cap: a Tuning field, checked before any worker starts ---------------

def _cfg():
    from kvpilot.model.config import ModelConfig

    return ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=6,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
                       rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
                       tie_word_embeddings=False, torch_dtype="float32", bos_token_id=1, eos_token_ids=[2])


def _spec(tp: int, pp: int, device: str, pods: int = 1, tuning=None):
    from kvpilot.config import KvCacheConfig
    from kvpilot.parallel.executor import LwsGroup, make_worker_spec

    group = LwsGroup("10.0.0.1", pods, 0, 29500) if pods > 1 else None
    return make_worker_spec(Path("/nonexistent"), _cfg(), KvCacheConfig(), 64, 4, 128, device, "float32",
                            tp, pp, group, tuning=tuning)


@pytest.mark.parametrize("value,error", [("0", ValueError), ("-3", ValueError), ('"lots"', ValueError)])
def test_bad_max_tokens_fails_before_any_worker_starts(monkeypatch, value, error):
    """A bad ``tp_custom_allreduce_max_tokens`` is refused where the record is built (``KVPILOT_TUNING``
    read by `LLM`, or `Tuning` itself), so no worker ever sees it."""
    from kvpilot.tuning import Tuning

    monkeypatch.setenv("KVPILOT_TUNING", '{"tp_custom_allreduce_max_tokens": %s}' % value)
    with pytest.raises(error, match="tp_custom_allreduce_max_tokens"):
        Tuning.from_env()
    with pytest.raises((TypeError, ValueError), match="tp_custom_allreduce_max_tokens"):
        Tuning(tp_custom_allreduce_max_tokens=0)


@pytest.mark.parametrize("tp,pp,device,pods", [(2, 1, "cuda", 2), (2, 3, "cuda", 2), (2, 1, "cpu", 1),
                                               (1, 2, "cuda", 1), (4, 1, "cuda", 1), (2, 1, "cuda", 1)])
def test_the_spec_carries_the_tuning_to_every_rank(monkeypatch, tp, pp, device, pods):
    from kvpilot.tuning import Tuning

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)  # make_worker_spec's GPU count check
    tuning = Tuning(tp_custom_allreduce=False, tp_custom_allreduce_max_tokens=16)
    spec = _spec(tp, pp, device, pods, tuning)
    assert (spec.tp_size, spec.pp_size, spec.device, spec.tuning) == (tp, pp, device, tuning)
    assert _spec(tp, pp, device, pods).tuning == Tuning()


# ---- benchmarks/lab/gpu_tp_profile.py --sampled ----------------------------------------------------------
