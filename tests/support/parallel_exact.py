"""Rank processes of `test_parallel_exactness.py` (gloo, CPU): a spawned process imports this module.

Each entry point sends ``("ok", rank, results)`` or ``("error", rank, traceback)`` as a plain pickle
on ``conn`` (`conn.send` would share tensors through file descriptors that die with the process);
`spawn_ranks` starts such entry points (also `stage_graph_helpers.stage_graph_rank`) and collects
their answers.
"""

from __future__ import annotations

import pickle
import traceback
from pathlib import Path

import torch

from kvpilot.tuning import Tuning

BLOCK = 8
PROMPTS = [[1, 17, 40, 3, 99, 5, 60, 7, 8], [1, 2, 30, 44, 5], [1, 90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100]]
DECODE_STEPS = 12


def _tables() -> list[list[int]]:
    per = -(-(max(len(p) for p in PROMPTS) + DECODE_STEPS) // BLOCK)
    return [list(range(i * per, (i + 1) * per)) for i in range(len(PROMPTS))]


def greedy_steps(runner, prompts=PROMPTS, steps: int = DECODE_STEPS):
    """Prefill ``prompts`` in one step, then ``steps`` greedy decode steps of all of them.

    Returns (logits per step as float32 CPU tensors [len(prompts), vocab], tokens per step)."""
    from kvpilot.runner.model_runner import ScheduledSeq

    tables = _tables()
    lens = [len(p) for p in prompts]
    logits, rows = runner.execute([ScheduledSeq(i, p, 0, tables[i], True) for i, p in enumerate(prompts)])
    out = [logits.float().cpu().clone()]
    toks = [logits.argmax(-1).tolist()]
    for _ in range(steps):
        seqs = [ScheduledSeq(i, [t], lens[i], tables[i], True) for i, t in enumerate(toks[-1])]
        logits, _ = runner.execute(seqs)
        for i in range(len(prompts)):
            lens[i] += 1
        out.append(logits.float().cpu().clone())
        toks.append(logits.argmax(-1).tolist())
    return out, toks


def _runner(model_dir: str, dtype: str, pc=None, max_num_tokens: int = 64, tuning=None):
    from kvpilot.config import KvCacheConfig
    from kvpilot.model.config import ModelConfig
    from kvpilot.runner.model_runner import ModelRunner

    return ModelRunner(Path(model_dir), ModelConfig.from_dir(Path(model_dir)),
                       KvCacheConfig(tokens_per_block=BLOCK, max_tokens=512), max_num_tokens=max_num_tokens,
                       max_batch_size=4, max_seq_len=64, device="cpu", dtype=dtype, pc=pc, tuning=tuning)


def spawn_ranks(target, args_of_rank, world: int = 2, timeout_s: float = 240.0) -> dict:
    """Run ``target(rank, *args_of_rank(rank), conn)`` in ``world`` spawned processes and return
    ``{rank: results}`` from their ``("ok", rank, results)`` answers (plain pickles on ``conn``).

    Raises:
        AssertionError: a rank answered ``("error", rank, traceback)`` or not within ``timeout_s``.
    """
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    conns, procs = [], []
    for rank in range(world):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(rank, *args_of_rank(rank), child), daemon=True)
        p.start()
        child.close()
        conns.append(parent)
        procs.append(p)
    answers = {}
    try:
        for conn in conns:
            assert conn.poll(timeout_s), "a rank did not answer"
            kind, rank, payload = pickle.loads(conn.recv_bytes())
            assert kind == "ok", f"rank {rank} failed:\n{payload}"
            answers[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return answers


def _send(conn, msg) -> None:
    conn.send_bytes(pickle.dumps(msg))
    conn.close()


def tp_reduce_rank(rank: int, init_method: str, model_dir: str, conn) -> None:
    """TP 2 rank: greedy steps of `PROMPTS` in bf16 with the fp32 reduce (``Tuning(tp_reduce_fp32=True)``,
    mode "1") and with the default bf16 one (mode None), and in float32; rank 0 also runs the single-process model
    in both dtypes. Results: {"tp": {(dtype, mode): (logits, tokens, reduce_fp32 flag)}, "single":
    {dtype: (logits, tokens)}, "o_bias": this rank's loaded o_proj bias of layer 0,
    "down_bias": its down_proj bias of layer 0}."""
    import torch.distributed as dist

    from kvpilot.model.llama import ParallelContext

    try:
        torch.set_num_threads(1)  # the single-process reference and the ranks use the same CPU kernels
        dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
        pc = ParallelContext(rank, 2, None)
        res = {"tp": {}, "single": {}}
        with torch.inference_mode():
            for dtype, mode in (("bfloat16", "1"), ("bfloat16", None), ("float32", "1")):
                runner = _runner(model_dir, dtype, pc, tuning=Tuning(tp_reduce_fp32=mode == "1"))
                flag = runner.model.layers[0].mlp.reduce_fp32
                assert all(layer.self_attn.reduce_fp32 is flag and layer.mlp.reduce_fp32 is flag
                           for layer in runner.model.layers)
                logits, toks = greedy_steps(runner)
                res["tp"][(dtype, mode)] = (logits, toks, flag)
                layer = runner.model.layers[0]
                for name, lin in (("o_bias", layer.self_attn.o_proj), ("down_bias", layer.mlp.down_proj)):
                    res[name] = None if lin.bias is None else lin.bias.detach().float().clone()
            if rank == 0:
                for dtype in ("bfloat16", "float32"):
                    res["single"][dtype] = greedy_steps(_runner(model_dir, dtype))
        dist.destroy_process_group()
        _send(conn, ("ok", rank, res))
    except BaseException as e:  # noqa: BLE001 - report anything to the test
        _send(conn, ("error", rank, "".join(traceback.format_exception(type(e), e, e.__traceback__))))


def pp_padding_rank(rank: int, spec, buckets: list[int], plans: list, conn) -> None:
    """PP 2 rank (a real `Worker`, gloo): run ``plans`` (a list of steps, each a list of
    `ScheduledSeq`) with eager prefill steps padded to ``buckets`` (what a CUDA rank does), recording
    the token count of every stage forward; the last stage then runs the same steps on a whole-model
    runner through CPU doubles of one GPU's prefill graphs at ``buckets``. Results: {"pp": [(logits,
    rows) per step] (last stage; None elsewhere), "tokens": [forward token counts], "single": [(logits,
    rows) per step] (last stage), "single_graph_steps": prefill graph replays of the single runner}."""
    import torch.distributed as dist

    from support.graphs import cpu_graph_class
    from kvpilot.runner.cuda_graphs import PrefillGraphs
    from kvpilot.parallel.worker import Worker

    try:
        torch.set_num_threads(1)
        worker = Worker(rank, spec)
        runner = worker.runner
        runner.prefill_pad_buckets = list(buckets)
        tokens = []
        forward = runner._forward

        def recording_forward(ids, *args, **kwargs):
            tokens.append(int(ids.shape[0]))
            return forward(ids, *args, **kwargs)

        runner._forward = recording_forward
        res = {"pp": [], "tokens": tokens, "single": [], "single_graph_steps": 0}
        with torch.inference_mode():
            for plan in plans:
                out = worker.execute(plan)
                res["pp"].append(None if out is None else (out[0].float().clone(), list(out[1])))
            if worker.is_last:
                single = _runner(spec.model_dir, spec.dtype, max_num_tokens=spec.max_num_tokens)
                graphs = cpu_graph_class(PrefillGraphs)(single, token_buckets=list(buckets))
                graphs.capture()
                single.prefill_graphs = graphs
                replay = graphs.run

                def counting_run(*args, **kwargs):
                    res["single_graph_steps"] += 1
                    return replay(*args, **kwargs)

                graphs.run = counting_run
                for plan in plans:
                    logits, rows = single.execute(plan)
                    res["single"].append((logits.float().clone(), list(rows)))
        dist.destroy_process_group()
        _send(conn, ("ok", rank, res))
    except BaseException as e:  # noqa: BLE001 - report anything to the test
        _send(conn, ("error", rank, "".join(traceback.format_exception(type(e), e, e.__traceback__))))


MAX_BS, MAX_SEQ, MAX_TOKENS = 4, 64, 64
BUCKETS = [16, 32, 48, 64]


def exactness_runner(model_dir: Path, dtype: str = "float32"):
    """A CPU `ModelRunner` of ``model_dir`` with this module's batch limits."""
    from kvpilot.config import KvCacheConfig
    from kvpilot.model.config import ModelConfig
    from kvpilot.runner.model_runner import ModelRunner

    return ModelRunner(model_dir, ModelConfig.from_dir(model_dir), KvCacheConfig(tokens_per_block=BLOCK, max_tokens=512),
                       max_num_tokens=MAX_TOKENS, max_batch_size=MAX_BS, max_seq_len=MAX_SEQ, device="cpu",
                       dtype=dtype)
