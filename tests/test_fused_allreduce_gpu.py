"""The one-shot all-reduce folded into the batch-1 decode GEMVs (``KVPILOT_TP_FUSED_ALLREDUCE``) on two GPUs.

1. Kernels, Llama-3.1-8B's TP-2 shapes in bf16: a chain of decoder-layer GEMVs (QKV, o_proj, gate_up,
   down; attention left out) at one row, with the all-reduces folded (push / pull / reset), is bit for
   bit the chain with NCCL between the GEMVs (gemv -> all-reduce -> rmsnorm_gemv), on both ranks,
   eagerly and from a CUDA graph of several forward passes back to back (PDL on), replayed with fresh
   inputs; every receive buffer is empty afterwards.
2. Model: a TP-2 `ModelRunner` pair (the random 8-layer model of tests/test_parallel_gpu.py, hidden
   2048: the vec and masked-K GEMV tiles) gives bit for bit the same logits over batch-1 and batch-2
   decode steps with the fold on and off, and folds 2 * layers - 1 all-reduces per batch-1 step.
3. Engine: `LLM` at TP 2 gives the same tokens and logprobs with ``KVPILOT_TP_FUSED_ALLREDUCE`` 1 and 0
   (worker processes, decode CUDA graphs).

Skipped without two CUDA GPUs. CPU counterparts: tests/test_kernels_allreduce.py, tests/test_fused_allreduce.py.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_parallel_gpu import SHAPE, model_dir  # noqa: F401  (the module fixture)

from kvpilot import LLM, KvCacheConfig, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]

HIDDEN, Q, KV, INTER, LAYERS, EPS = 4096, 2048, 512, 7168, 4, 1e-5  # Llama-3.1-8B, one GPU of TP 2
PASSES, REPLAYS = 4, 25  # forward passes per graph, graph replays


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, *args, timeout: float = 500) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=target, args=(r, port, *args, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = dict(q.get(timeout=timeout) for _ in range(2))
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    return got


def _init(rank: int, port: int):
    os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, device_id=dev)
    return dev, dist.new_group([0, 1])


def _layer_weights(rank: int, dev) -> list[dict]:
    g = torch.Generator(device=dev).manual_seed(100)  # norm weights: the same on both ranks
    norms = [{k: (1 + 0.1 * torch.randn(HIDDEN, generator=g, device=dev)).bfloat16() for k in ("nw1", "nw2")}
             for _ in range(LAYERS)]
    g = torch.Generator(device=dev).manual_seed(200 + rank)  # this rank's shards

    def w(n, k):
        return (torch.randn(n, k, generator=g, device=dev) / k ** 0.5).bfloat16()

    return [dict(nw, qkv=w(Q + 2 * KV, HIDDEN), o=w(HIDDEN, Q), gu=w(2 * INTER, HIDDEN), down=w(HIDDEN, INTER))
            for nw in norms]


def _chain(x, weights, reduce, car=None):
    """One forward pass at one row: ``reduce`` "nccl" (gemv -> dist.all_reduce -> rmsnorm_gemv) or
    "fold" (sites: o_proj of layer l is 2l, its down_proj 2l + 1; the last down_proj by the kernel).
    Returns (final hidden, residual, [gate_up output per layer])."""
    from kvpilot.kernels import gemv as G

    hidden, res, outs = x, None, []
    for layer, w in enumerate(weights):
        o_site, d_site, prev, last = 2 * layer, 2 * layer + 1, 2 * layer - 1, layer == len(weights) - 1
        pull = car.site_recv(prev, HIDDEN) if reduce == "fold" and layer else None
        if res is None:
            qkv, res = G.rmsnorm_gemv(hidden, None, w["nw1"], EPS, w["qkv"]), hidden
        else:
            qkv, res = G.rmsnorm_gemv(hidden, res, w["nw1"], EPS, w["qkv"], pull=pull)
        a = qkv[:, :Q].contiguous()  # stands in for attention's output
        if reduce == "fold":
            o = G.gemv(a, w["o"], push=car.site_peer_recv(o_site, HIDDEN), reset=pull)
            gu, res = G.rmsnorm_gemv(o, res, w["nw2"], EPS, w["gu"], pull=car.site_recv(o_site, HIDDEN))
            hidden = G.silu_mul_gemv(gu, w["down"], push=None if last else car.site_peer_recv(d_site, HIDDEN),
                                     reset=car.site_recv(o_site, HIDDEN))
            if last:
                car.all_reduce(hidden, d_site)
        else:
            o = G.gemv(a, w["o"])
            dist.all_reduce(o)
            gu, res = G.rmsnorm_gemv(o, res, w["nw2"], EPS, w["gu"])
            hidden = G.silu_mul_gemv(gu, w["down"])
            dist.all_reduce(hidden)
        outs.append(gu)
    return hidden, res, outs


def _kernel_rank(rank: int, port: int, q) -> None:
    from kvpilot.custom_all_reduce import CustomAllReduce
    from kvpilot.kernels import gemv as G
    from kvpilot.kernels.allreduce import SENTINEL_BITS
    from kvpilot.kernels.pdl import pdl_mode

    dev, group = _init(rank, port)
    os.environ.pop("KVPILOT_TP_FUSED_ALLREDUCE", None)
    car = CustomAllReduce.create(group, rank, 2, dev, 2 * LAYERS, HIDDEN)
    report = {"created": car is not None and car.fold, "pdl": pdl_mode(dev, 1), "mismatch": []}
    weights = _layer_weights(rank, dev)
    x1 = torch.empty(1, HIDDEN, device=dev, dtype=torch.bfloat16)
    report["triton"] = all(G.takes_triton(x1, op) for op in ("plain", "rmsnorm", "silu"))
    g = torch.Generator(device=dev).manual_seed(7)  # inputs: the same on both ranks

    def fresh(n):
        return torch.randn(n, 1, HIDDEN, generator=g, device=dev).bfloat16()

    def compare(tag, got, want):
        for name, a, b in zip(("hidden", "res", "gate_up"), got, want):
            if isinstance(a, list):
                if any(not torch.equal(u, v) for u, v in zip(a, b)):
                    report["mismatch"].append((tag, name))
            elif not torch.equal(a, b):
                report["mismatch"].append((tag, name))

    # eager: folded and NCCL passes in alternation
    for i, x in enumerate(fresh(4)):
        compare(("eager", i), _chain(x, weights, "fold", car), _chain(x, weights, "nccl"))
    # graph: PASSES folded forward passes back to back, replayed with fresh inputs
    xs = fresh(PASSES)
    outs = [None] * PASSES

    def passes():
        for p in range(PASSES):
            outs[p] = _chain(xs[p], weights, "fold", car)

    passes()  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        passes()
    for rep in range(REPLAYS):
        xs.copy_(fresh(PASSES))
        graph.replay()
        for p in range(PASSES):
            compare(("graph", rep, p), outs[p], _chain(xs[p], weights, "nccl"))
    torch.cuda.synchronize()
    report["empty"] = bool((car.recv.view(torch.int32) == SENTINEL_BITS).all())
    report["residual_sum"] = float(outs[-1][1].float().sum())  # both ranks' residual streams agree
    q.put((rank, report))
    dist.barrier()
    dist.destroy_process_group()


def test_folded_chain_matches_nccl_bit_for_bit():
    got = _spawn(_kernel_rank)
    for rank in (0, 1):
        r = got[rank]
        assert r["created"] and r["triton"], r
        assert r["mismatch"] == [], r["mismatch"][:10]
        assert r["empty"]
    assert got[0]["residual_sum"] == got[1]["residual_sum"]
    print(f"PDL mode {got[0]['pdl']}")


def _runner_rank(rank: int, port: int, model_dir: str, q) -> None:
    from pathlib import Path

    from kvpilot.config import KvCacheConfig as KVC, ModelConfig
    from kvpilot.custom_all_reduce import CustomAllReduce
    from kvpilot.kernels.allreduce import SENTINEL_BITS
    from kvpilot.llama import ParallelContext
    from kvpilot.model_runner import ModelRunner, ScheduledSeq
    from kvpilot.parallel_worker import all_reduce_sites

    dev, group = _init(rank, port)
    cfg = ModelConfig.from_dir(Path(model_dir))
    car = CustomAllReduce.create(group, rank, 2, dev, all_reduce_sites((0, cfg.num_hidden_layers)), cfg.hidden_size)
    report = {"created": car is not None}
    prompts = [[5, 900, 31, 77, 12, 400, 9], [3, 17, 2000, 45]]
    results = {}
    for fold in (True, False):
        car.fold = fold
        pc = ParallelContext(rank, 2, group, custom_all_reduce=car)
        runner = ModelRunner(Path(model_dir), cfg, KVC(tokens_per_block=16, max_tokens=512), max_num_tokens=64,
                             max_batch_size=4, max_seq_len=128, device=f"cuda:{rank}", dtype="bfloat16", pc=pc)
        tables, lens = [[0, 1], [2, 3]], [len(p) for p in prompts]
        logits, _ = runner.execute([ScheduledSeq(i, p, 0, tables[i], True) for i, p in enumerate(prompts)])
        steps, toks = [logits.float().cpu()], logits.argmax(-1).tolist()
        folded0 = car.folded
        for step in range(12):
            active = [0, 1] if step % 4 == 3 else [0]  # mostly batch 1, a batch-2 step now and then
            logits, _ = runner.execute([ScheduledSeq(i, [toks[i]], lens[i], tables[i], True) for i in active])
            for j, i in enumerate(active):
                lens[i] += 1
                toks[i] = int(logits[j].argmax())
            steps.append(logits.float().cpu())
        torch.cuda.synchronize()
        results[fold] = (steps, car.folded - folded0)
        runner.shutdown()
    report["same"] = all(torch.equal(a, b) for a, b in zip(results[True][0], results[False][0]))
    report["folded"] = (results[True][1], results[False][1])
    report["layers"] = cfg.num_hidden_layers
    report["empty"] = bool((car.recv.view(torch.int32) == SENTINEL_BITS).all())
    q.put((rank, report))
    dist.barrier()
    dist.destroy_process_group()


def test_model_runner_logits_equal_with_the_fold_on_and_off(model_dir):  # noqa: F811
    got = _spawn(_runner_rank, str(model_dir))
    for rank in (0, 1):
        r = got[rank]
        assert r["created"] and r["same"] and r["empty"], r
        batch1_steps = 9  # of the 12 decode steps (every fourth is batch 2)
        assert r["folded"] == (batch1_steps * (2 * r["layers"] - 1), 0), r


def _generate(model_dir, monkeypatch, fold: str):  # noqa: F811
    monkeypatch.setenv("KVPILOT_TP_FUSED_ALLREDUCE", fold)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, SHAPE["vocab_size"], (n,), generator=g).tolist() for n in (6, 50, 129)]
    out = []
    with LLM(str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=2, device="cuda",
             max_batch_size=16, max_seq_len=1024, kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.3)) as llm:
        out.append(llm._executor.one_shot_all_reduce)
        for p in prompts:  # one request at a time: batch-1 decode steps, where the fold applies
            o = llm.generate(p, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=1),
                             use_tqdm=False).outputs[0]
            out.append((o.token_ids, [next(iter(lp.values())).logprob for lp in o.logprobs]))
    monkeypatch.delenv("KVPILOT_TP_FUSED_ALLREDUCE")
    return out


def test_engine_tp2_fold_on_equals_off(model_dir, monkeypatch):  # noqa: F811
    on, off = _generate(model_dir, monkeypatch, "1"), _generate(model_dir, monkeypatch, "0")
    assert on[0] is True and off[0] is True  # the one-shot kernel either way
    assert on[1:] == off[1:]
