"""One worker rank of `test_parallel_stage_graphs.py`: a real `Worker` (gloo, CPU) whose stage runs
each plan eagerly and then through CPU doubles of its pipeline-stage decode graphs
(`graph_helpers.cpu_graph_class`), so the worker's graph path (static buffers, padded sends and
receives, micro-batches mixing graph and eager runs) is checked against its eager path on CPU.

Lives in its own module so that spawned processes can import it."""

from __future__ import annotations

import pickle
import traceback

import torch

from support.graphs import cpu_graph_class


def stage_graph_rank(rank: int, spec, plans: list, conn) -> None:
    """Build rank ``rank``'s `Worker`, run every plan eagerly, then with the stage graphs (LM head in
    and outside the graph), and send ``("ok", rank, results)`` on ``conn``: per plan, a tuple of
    (eager result, [(graph result, graphs replayed) per LM-head mode]); results are ``(logits on
    CPU, rows)`` on the last stage, None elsewhere. Any exception is sent as ``("error", rank, text)``.
    Messages are plain pickles (`conn.send_bytes`): `conn.send` would share tensors through file
    descriptors that die with this process."""
    import torch.distributed as dist

    import kvpilot.runner.cuda_graphs as cg
    from kvpilot.runner.cuda_graphs import DecodeGraphs
    from kvpilot.parallel.worker import Worker

    try:
        cg._CONTEXT_BUCKETS = (64, 128)  # with the doubles' 4 SMs: batches 1 and 2 get three buckets
        worker = Worker(rank, spec)
        runner = worker.runner
        torch.manual_seed(100 + rank)
        for cache in runner.kv_caches:  # a context to attend: random K/V in every block
            cache.normal_()
        modes = []
        with torch.inference_mode():
            for in_graph in (True, False):
                g = cpu_graph_class(DecodeGraphs)(runner, lm_head_in_graph=in_graph)
                g.capture()
                modes.append(g)

        def run(plan):
            out = worker.execute(plan)
            return None if out is None else (out[0].clone(), list(out[1]))

        results = []
        for plan in plans:
            runner.graphs = None
            eager = run(plan)
            graphed = []
            for g in modes:
                runner.graphs = g
                before = worker.graph_replays
                graphed.append((run(plan), worker.graph_replays - before))
            results.append((eager, graphed))
        conn.send_bytes(pickle.dumps(("ok", rank, results)))
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - report anything to the test
        text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
        conn.send_bytes(pickle.dumps(("error", rank, text)))
    finally:
        conn.close()
