"""`ModelRunner.warm_up_eager`: the start-up steps that make Triton compile the eager mixed-step kernels.

On the GPU the runner calls it after CUDA-graph capture (``KVPILOT_WARMUP``, default 1); here it is
called directly on the CPU runner of stories260K, to check which steps it builds and that it leaves
the engine's results unchanged (it writes keys and values into blocks no sequence holds yet).
"""

from __future__ import annotations

import pytest

from engine_helpers import GOLDEN
from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.model_runner import ModelRunner, warm_up_enabled


def _greedy(llm: LLM, n: int = 60) -> str:
    return llm.generate([1], SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False).outputs[0].text


def test_warm_up_steps_and_unchanged_results(stories_model_dir, monkeypatch):
    """Steps: a prefill chunk plus 1, 2, 4, ... decode rows (below max_batch_size) at a short and a long
    context; every step carries the chunk and len(rows) decode rows, as scheduled. Greedy text after
    the warm-up is the golden text, and a second warm-up between requests changes nothing either."""
    calls = []
    real = ModelRunner.execute

    def execute(self, seqs):
        calls.append([(len(s.token_ids), s.start_pos, len(s.block_table), s.seq_id < 0) for s in seqs])
        return real(self, seqs)

    with LLM(str(stories_model_dir), max_batch_size=12, max_num_tokens=256,
             kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=4096)) as llm:
        runner = llm._executor
        monkeypatch.setattr(ModelRunner, "execute", execute)
        steps = runner.warm_up_eager()
        # rows 1, 2, 4, 8 (< 12); contexts 33 and min(4096, max_seq_len - 1, (blocks - 1) * 16).
        long_ctx = min(4096, runner.max_seq_len - 1, (runner.num_blocks - 1) * 16)
        assert steps == len(calls) == 2 * 4
        chunk = min(64, 256 - 64, long_ctx)
        got = [(len(c) - 1, c[1][1] + 1) for c in calls]
        assert got == [(n, ctx) for ctx in (33, long_ctx) for n in (1, 2, 4, 8)]
        for c in calls:
            assert c[0] == (chunk, 0, -(-chunk // 16), True)
            assert all(row[0] == 1 and row[3] for row in c[1:])
        monkeypatch.setattr(ModelRunner, "execute", real)
        assert GOLDEN.startswith(_greedy(llm))
        runner.warm_up_eager()
        assert GOLDEN.startswith(_greedy(llm)) and len(_greedy(llm)) > 100


def test_warm_up_skips_when_nothing_fits(stories_model_dir):
    """A step budget too small for a chunk plus 64 decode rows: no step, no error."""
    with LLM(str(stories_model_dir), max_batch_size=4, max_num_tokens=64) as llm:
        assert llm._executor.warm_up_eager() == 0
        assert GOLDEN.startswith(_greedy(llm, 20))


@pytest.mark.parametrize("value,on", [(None, True), ("1", True), ("0", False), ("no", False)])
def test_warm_up_switch(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv("KVPILOT_WARMUP", raising=False)
    else:
        monkeypatch.setenv("KVPILOT_WARMUP", value)
    assert warm_up_enabled() is on
