"""Workloads the parallel-engine tests run on a single-process `LLM` and on T x P worker layouts."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys

from dataclasses import dataclass

import pytest

from kvpilot import LLM, KvCacheConfig, SamplingParams

# A pool of 16 blocks x 8 tokens: four 32-token generations need ~20 blocks, so some are preempted.
STORIES_KV = dict(tokens_per_block=8, max_tokens=128)
STORIES_PROMPTS = ["", "Once upon a time", "The little dog", "Lily and Tom went to the park. They"]
# Shares a full first block with the fourth prompt above, so it is served from reused blocks.
REUSE_PROMPT = "Lily and Tom went to the park. They saw a big tree"


def stories_kv_config() -> KvCacheConfig:
    return KvCacheConfig(**STORIES_KV)


@dataclass
class StoriesResult:
    greedy: list[list[int]]
    greedy_text: list[str]
    reused: list[int]
    sampled: list[list[int]]
    sampled_logprobs: list[float]
    prompt_logprobs: list[float]
    preemptions: int
    reused_blocks: int


def run_stories_workload(llm) -> StoriesResult:
    """Greedy batch under KV pressure, a prefix-reuse request, seeded sampling, prompt logprobs."""
    stats = {"preempt": 0, "reused": 0}

    def count(s):
        stats["preempt"] += s.num_preemptions
        stats["reused"] = s.kv_cache.reused_blocks

    llm.add_stat_logger(count)
    greedy = llm.generate(STORIES_PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True),
                          use_tqdm=False)
    reused = llm.generate(REUSE_PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    sampled = llm.generate(STORIES_PROMPTS[:3], SamplingParams(temperature=0.9, top_p=0.95, seed=7, n=2,
                                                               max_tokens=12, logprobs=1), use_tqdm=False)
    plp = llm.generate(REUSE_PROMPT, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))
    prompt_lps = [entry[tok].logprob for entry, tok in zip(plp.prompt_logprobs[1:], plp.prompt_token_ids[1:])]
    return StoriesResult(
        greedy=[o.outputs[0].token_ids for o in greedy], greedy_text=[o.outputs[0].text for o in greedy],
        reused=reused.outputs[0].token_ids,
        sampled=[c.token_ids for o in sampled for c in o.outputs],
        sampled_logprobs=[c.cumulative_logprob for o in sampled for c in o.outputs],
        prompt_logprobs=prompt_lps, preemptions=stats["preempt"], reused_blocks=stats["reused"])


TINY_PROMPTS = [[1, 17, 99, 250], [1, 5], [1, 300, 301, 302, 303, 304, 305, 306, 307, 308, 42], [1, 384, 7]]
TINY_STEPS = 24


def run_tiny_workload(llm) -> tuple[list[list[int]], list[float]]:
    """Greedy token ids and their cumulative logprobs for `TINY_PROMPTS` (no EOS stop)."""
    outs = llm.generate(TINY_PROMPTS, SamplingParams(temperature=0, max_tokens=TINY_STEPS, ignore_eos=True,
                                                     logprobs=0), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].cumulative_logprob for o in outs]


@contextlib.contextmanager
def lws_worker_pod(tmp_path, model_dir, monkeypatch, tp: int = 1, pp: int = 2):
    """A two-'pod' LeaderWorkerSet group on localhost: starts pod 1 (`run_lws_worker` in a
    subprocess) and sets this process's environment as pod 0's, the leader's; the body builds the
    leader's `LLM`. On a clean exit the worker pod must have exited 0; it is killed in any case."""
    from kvpilot.server.launcher import free_port

    env = {"LWS_LEADER_ADDRESS": "127.0.0.1", "LWS_GROUP_SIZE": "2", "MASTER_PORT": str(free_port())}
    worker = subprocess.Popen(
        [sys.executable, "-c", "import sys; from kvpilot.parallel.executor import run_lws_worker; "
         f"sys.exit(run_lws_worker({str(model_dir)!r}, tensor_parallel_size={tp}, "
         f"pipeline_parallel_size={pp}, device='cpu'))"],
        cwd=str(tmp_path), env={**os.environ, **env, "LWS_WORKER_INDEX": "1"},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for k, v in {**env, "LWS_WORKER_INDEX": "0"}.items():
            monkeypatch.setenv(k, v)
        yield worker
        assert worker.wait(timeout=30) == 0, worker.stdout.read()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from support.engine import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_lws"), seed=5, vocab=385, layers=3)


@pytest.fixture(scope="module")
def tiny_single_reference(tiny_model_dir):
    with LLM(str(tiny_model_dir), skip_tokenizer_init=True, device="cpu") as llm:
        return run_tiny_workload(llm)


class _FrontEndDraws:
    """Counts the rows the front end's own sampler is launched on."""

    def __init__(self, sampler) -> None:
        self.sampler, self.rows = sampler, 0

    def __getattr__(self, name):
        return getattr(self.sampler, name)

    def launch(self, logits, rows):
        self.rows += len(rows)
        return self.sampler.launch(logits, rows)

    def __call__(self, logits, rows):
        self.rows += len(rows)
        return self.sampler(logits, rows)
