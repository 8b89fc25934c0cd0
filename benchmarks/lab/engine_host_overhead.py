"""Host (CPU) time of one engine step outside the model, and how much of it asynchronous output
processing hides behind the device's work (``Tuning.async_output``).

The model is replaced by a fake executor, so only the engine's own work is real, plus (unless
``--no-runner-host``) the model runner's host side: a decode-only step fills the CUDA-graph input
buffers (`DecodeGraphs.prepare`, on plain CPU buffers, buckets planned for an H200's 132 SMs), any
other step builds the eager inputs (`ModelRunner._prepare`). The engine is set up as the H200
offline run (``max_batch_size`` 512, ``max_num_tokens`` 8192, a KV pool that holds every sequence at
full length, so nothing is preempted); every request has its own ``--prompt-len``-token prompt
(1,500 by default: 47-block tables, as in the middle of a 1,000-in / 1,000-out run). Only the
``--steps`` decode-only steps in which every request of the batch decodes are timed: a request
generates ``--steps`` tokens plus one per chunked-prefill step of the batch, so that the first
admitted are still running when the last prompt is done.

- ``--gpu-ms 0``: the executor returns logits at once; the table gives the host time per step
  (scheduling, sampling, stops, detokenization, outputs, stats, the runner's input buffers).
- otherwise a fake device: each ``execute`` "launches" ``--gpu-ms`` of device work and returns at
  once, and the sampler's read of the chosen ids waits until that work is done, as on a GPU (the one
  device->host synchronisation of a step). ``--device sleep`` (default without CUDA) models the
  device with a deadline and ``time.sleep``; ``--device cuda`` launches a real spin kernel
  (``torch.cuda._sleep``) and samples real device logits. The default device time per step is
  interpolated between 5.0 ms at batch 1 and 10.8 ms at batch 256 (an 8B model's decode step with
  CUDA graphs on an H200).

Each batch runs ``--repeat`` times in each mode, alternating synchronous (``async_output=False``)
and asynchronous on the same engine; a mode's figure is its best median step time (steps/s = 1 /
that); "host ms/step" is that step time minus the device time, i.e. the host work the device
waits for. "CPU ms/step" (sleep device only) is the engine thread's own CPU time per step (waiting
for the fake device excluded): on a shared machine wall-clock time also counts the moments other
processes held the core, which grows with the step's length and reads as a superlinear cost at
large batch; the CPU time does not. The script exits 1 if the two modes' outputs (token ids and
text) differ. Logits are one-hot rows over a fixed pseudo-random token sequence, so detokenization
sees changing text.

    .venv/bin/python benchmarks/lab/engine_host_overhead.py [--batch 1 64 256 448] [--steps 60] [--tokenizer]
        [--streaming] [--logprobs K] [--gpu-ms auto|0|MS] [--device sleep|cuda] [--prompt-len 1500]
        [--max-batch-size 512] [--no-runner-host]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch


def default_gpu_ms(batch: int) -> float:
    """Device time of one decode step (ms), linear between 5.0 ms at batch 1 and 10.8 ms at 256."""
    return 5.0 + (10.8 - 5.0) * (min(batch, 256) - 1) / 255


class _NoEvent:
    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


def _host_decode_graphs(runner):
    """`DecodeGraphs` with plain CPU host buffers and nothing captured: its `prepare` is the host
    work of a decode-graph step (the replay and the copy are device work)."""
    from kvpilot.runner.cuda_graphs import DecodeGraphs

    class HostOnly(DecodeGraphs):
        _needs_cuda = False
        _host_buffer = staticmethod(lambda n, dtype: torch.zeros(n, dtype=dtype))
        _new_event = staticmethod(_NoEvent)

        def _num_sms(self) -> int:
            return 132  # an H200

    g = HostOnly(runner)
    g.plan_buckets()
    g.graphs = {(b, c): None for b, cs in g.buckets.items() for c in cs}  # "captured": can_run answers
    return g


class _FakeExecutor:
    """Stands in for the model: one-hot logits (greedy follows a fixed token sequence) for every
    sampled row, after ``gpu_ms`` of fake device work that `_DeviceWaitingSampler` waits for.
    With ``runner`` it also does that runner's host-side input work first."""

    def __init__(self, num_blocks: int, block_size: int, vocab: int, max_rows: int, device: str,
                 runner=None) -> None:
        self.num_blocks, self.block_size, self.vocab = num_blocks, block_size, vocab
        self.device = device
        self.runner = runner
        self.graphs = _host_decode_graphs(runner) if runner is not None else None
        self.gpu_ms = 0.0
        self.busy_until = 0.0  # sleep device: when the launched work ends (perf_counter seconds)
        self.decode_only = False  # whether the last step was decode-only
        self.last_size = 0  # sequences in the last step
        self.wait_cpu = 0.0  # CPU seconds spent waiting for the fake device (excluded from CPU time)
        rng = random.Random(0)
        seq = [rng.randrange(3, vocab) for _ in range(997)]
        dev = "cuda" if device == "cuda" else "cpu"
        # A few [max_rows, V] patterns, cycled per step: row i of pattern k picks seq[(7 i + k) % 997]
        # (k: the step's position, so that both modes produce the same tokens).
        self.patterns = []
        for k in range(8):
            t = torch.zeros(max_rows, vocab)
            t[torch.arange(max_rows), torch.tensor([seq[(7 * i + k) % len(seq)] for i in range(max_rows)])] = 1.0
            self.patterns.append(t.to(dev))
        self.cycles_per_ms = _calibrate_cuda_sleep() if device == "cuda" else 0.0

    def execute(self, plan):
        self.last_size = len(plan)
        g = self.graphs
        if g is not None:
            self.decode_only = g.can_run(plan)  # the runner's own test
        else:
            self.decode_only = all(len(p.token_ids) == 1 and p.sample and not p.all_logits for p in plan)
        if g is not None and self.decode_only:
            g.prepare(plan)  # the decode graph's host work
            rows = len(plan)
        elif self.runner is not None:
            rows = len(self.runner._prepare(plan)[3])  # the eager path's host work
        else:
            rows = sum(len(p.token_ids) if p.all_logits else int(p.sample) for p in plan)
        if self.gpu_ms > 0:
            if self.device == "cuda":
                torch.cuda._sleep(int(self.gpu_ms * self.cycles_per_ms))
            else:
                self.busy_until = max(time.perf_counter(), self.busy_until) + self.gpu_ms / 1e3
        # The benchmark's requests run in lockstep: one position per step picks the pattern.
        pattern = self.patterns[(plan[0].start_pos + len(plan[0].token_ids)) % len(self.patterns)]
        return pattern[:rows], list(range(rows))


class _DeviceWaitingSampler:
    """The real sampler, after waiting for the fake device (its read of the ids would block so)."""

    def __init__(self, sampler, executor: _FakeExecutor) -> None:
        self.sampler, self.executor = sampler, executor

    def __call__(self, logits, rows):
        c = time.thread_time()
        end = self.executor.busy_until
        left = end - time.perf_counter()
        if left > 3e-4:
            time.sleep(left - 3e-4)
        while time.perf_counter() < end:  # sleep overshoots by ~0.1 ms; spin the rest
            pass
        self.executor.wait_cpu += time.thread_time() - c
        return self.sampler(logits, rows)


def _calibrate_cuda_sleep() -> float:
    """GPU clock cycles of ``torch.cuda._sleep`` per millisecond."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    cycles = 20_000_000
    best = float("inf")
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        torch.cuda._sleep(cycles)
        b.record()
        b.synchronize()
        best = min(best, a.elapsed_time(b))
    return cycles / best


_RUNS = 0


def _prompts(batch: int, length: int, vocab: int) -> list[list[int]]:
    """Distinct prompts (no prefix-cache hits between them, nor with any earlier run's: a hit would
    change the steps' make-up, and with it the fake logits): BOS, then pseudo-random ids."""
    global _RUNS
    _RUNS += 1
    rng = random.Random(1_000_003 * _RUNS + batch)
    return [[1] + [rng.randrange(3, vocab) for _ in range(length - 1)] for _ in range(batch)]


def _run(llm, core, batch: int, args, mode: bool):
    """One batch to the end; (median wall and CPU seconds of its whole-batch decode steps, outputs)."""
    from kvpilot import SamplingParams

    core.async_output = mode
    ex = core.executor
    prefill_steps = -(-batch * args.prompt_len // core.scheduler.max_num_tokens)
    sp = SamplingParams(temperature=0, max_tokens=args.steps + prefill_steps + 1, ignore_eos=True,
                        logprobs=args.logprobs)
    reqs = [llm._make_request(p, sp, args.streaming)
            for p in _prompts(batch, args.prompt_len, llm.model_config.vocab_size)]
    for r in reqs:
        core.add_request(r)
    times, cpu = [], []
    while core.has_work:
        ex.wait_cpu = 0.0
        ex.decode_only = False
        t, c = time.perf_counter(), time.thread_time()
        core.step()
        core.flush_outputs()
        if ex.decode_only and ex.last_size == batch and len(times) < args.steps:  # the whole batch decodes
            times.append(time.perf_counter() - t)
            cpu.append(time.thread_time() - c - ex.wait_cpu)
    outs = []
    for r in reqs:
        o = r.output
        if o.streaming:
            for _ in o:
                pass
        else:
            o.result(timeout=0)
        outs.append((o.outputs[0].token_ids, o.outputs[0].text))
    return statistics.median(times), statistics.median(cpu), outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256, 448])
    ap.add_argument("--steps", type=int, default=60, help="timed decode steps per run")
    ap.add_argument("--prompt-len", type=int, default=1500, help="prompt tokens per request (distinct prompts)")
    ap.add_argument("--max-batch-size", type=int, default=512, help="the engine's (the H200 run's: 512)")
    ap.add_argument("--no-runner-host", action="store_true",
                    help="leave out the model runner's host work (input buffers, block tables)")
    ap.add_argument("--streaming", action="store_true", help="streamed requests (a chunk per step)")
    ap.add_argument("--tokenizer", action="store_true", help="detokenize (default: token ids only)")
    ap.add_argument("--logprobs", type=int, default=None, help="top-K logprobs per token")
    ap.add_argument("--gpu-ms", default="auto", help="fake device ms per step: auto, 0 (host only) or a number")
    ap.add_argument("--device", choices=["sleep", "cuda"], default=None,
                    help="fake device: sleep (CPU deadline) or cuda (spin kernel); default cuda if available")
    ap.add_argument("--repeat", type=int, default=3, help="runs per mode (alternating); the best median counts")
    args = ap.parse_args()
    device = args.device or ("cuda" if torch.cuda.is_available() else "sleep")
    if device == "sleep":
        torch.set_num_threads(1)  # the engine is one thread; intra-op threads only add noise on a busy CPU

    from kvpilot import LLM, KvCacheConfig
    from kvpilot.tuning import Tuning
    from kvpilot.tools.convert_llama2c import ensure_stories260k

    max_batch = max(args.batch)
    if max_batch > args.max_batch_size:
        ap.error(f"--batch {max_batch} exceeds --max-batch-size {args.max_batch_size}")
    seq_len = args.prompt_len + args.steps + -(-max_batch * args.prompt_len // 8192) + 1
    # Every sequence fits at full length: no preemption, as in the H200 run's KV pool.
    llm = LLM(str(ensure_stories260k()), skip_tokenizer_init=not args.tokenizer, max_batch_size=args.max_batch_size,
              max_num_tokens=8192, max_seq_len=seq_len + 32, device="cuda" if device == "cuda" else "cpu",
              kv_cache_config=KvCacheConfig(max_tokens=max_batch * (seq_len + 64)),
              tuning=Tuning(cuda_graphs=False))  # the model is replaced: capture nothing
    core = llm._core
    runner = None if args.no_runner_host else core.executor
    ex = _FakeExecutor(core.executor.num_blocks, core.executor.block_size, llm.model_config.vocab_size,
                       max_batch, device, runner)
    core.executor = ex
    if device == "sleep":  # on CUDA the sampler's own read waits for the spin kernel
        core.sampler = _DeviceWaitingSampler(core.sampler, ex)
    llm._loop.stop()  # drive the core directly, on this thread
    print(f"device: {device}; tokenizer={args.tokenizer} streaming={args.streaming} logprobs={args.logprobs} "
          f"steps={args.steps} prompt_len={args.prompt_len} max_batch_size={args.max_batch_size} "
          f"runner host work={'no' if runner is None else 'yes'}")
    print("| batch | device ms/step | sync steps/s | async steps/s | speedup | sync host ms/step | "
          "async host ms/step | sync us/seq | sync CPU ms/step | async CPU ms/step | sync CPU us/seq |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    ok = True
    for batch in args.batch:
        ex.gpu_ms = default_gpu_ms(batch) if args.gpu_ms == "auto" else float(args.gpu_ms)
        med: dict[bool, list[float]] = {False: [], True: []}
        cpu: dict[bool, list[float]] = {False: [], True: []}
        outs = {}
        for _ in range(args.repeat):
            for mode in (False, True):
                m, c, outs[mode] = _run(llm, core, batch, args, mode)
                med[mode].append(m)
                cpu[mode].append(c)
        s_med, a_med = min(med[False]), min(med[True])
        s_cpu, a_cpu = min(cpu[False]) * 1e3, min(cpu[True]) * 1e3
        s_rate, a_rate = 1 / s_med, 1 / a_med
        s_out, a_out = outs[False], outs[True]
        if s_out != a_out:
            ok = False
            bad = next(i for i, (x, y) in enumerate(zip(s_out, a_out)) if x != y)
            print(f"MISMATCH at batch {batch}, request {bad}: {s_out[bad]!r} != {a_out[bad]!r}", file=sys.stderr)
        # Host time the device waits for: a step's time beyond the device's own.
        s_host, a_host = s_med * 1e3 - ex.gpu_ms, a_med * 1e3 - ex.gpu_ms
        cpu_cols = (f"{s_cpu:.3f} | {a_cpu:.3f} | {s_cpu * 1e3 / batch:.1f}" if device == "sleep" else "- | - | -")
        print(f"| {batch} | {ex.gpu_ms:.2f} | {s_rate:.1f} | {a_rate:.1f} | {a_rate / s_rate:.3f}x | "
              f"{s_host:.3f} | {a_host:.3f} | {s_host * 1e3 / batch:.1f} | {cpu_cols} |")
    llm.shutdown()
    if not ok:
        print("outputs differ between the synchronous and the asynchronous engine", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
