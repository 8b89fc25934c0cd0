"""`ModelRunner.warm_up_eager`: the start-up steps that make Triton compile the eager mixed-step kernels.

On the GPU the runner calls it after CUDA-graph capture (``Tuning.warmup``, default on); here it is
called directly on the CPU runner of stories260K, to check which steps it builds and that it leaves
the engine's results unchanged (it writes keys and values into blocks no sequence holds yet).
"""

from __future__ import annotations

import pytest

from support.engine import GOLDEN
from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.runner.model_runner import ModelRunner
from kvpilot.tuning import Tuning


def _greedy(llm: LLM, n: int = 60) -> str:
    return llm.generate([1], SamplingParams(temperature=0.0, max_tokens=n), use_tqdm=False).outputs[0].text


def test_warm_up_steps_and_unchanged_results(stories_model_dir, monkeypatch):
    """The steps: a 2-token chunk plus s - 1 decode rows for s = 2, 3, 5, 9 (<= max_batch_size 12) at
    each context 64, 128, ... the pool allows, eagerly; then a chunk past the prefill graphs (64
    tokens here, no graphs on CPU) plus 1 decode row through `execute` (64 rows exceed the batch).
    Greedy text after the warm-up is the golden text; once a request has run, a warm-up is refused."""
    forwards, executes = [], []
    real_forward, real_execute = ModelRunner._forward, ModelRunner.execute

    def forward(self, ids, pos, meta, caches):
        forwards.append((int(meta.query_start_loc.numel()) - 1, int(meta.max_seq_len), int(ids.numel())))
        return real_forward(self, ids, pos, meta, caches)

    def execute(self, seqs):
        executes.append([(len(s.token_ids), s.start_pos, s.seq_id < 0) for s in seqs])
        return real_execute(self, seqs)

    with LLM(str(stories_model_dir), max_batch_size=12, max_num_tokens=256,
             kv_cache_config=KvCacheConfig(tokens_per_block=16, max_tokens=4096)) as llm:
        runner = llm._executor
        monkeypatch.setattr(ModelRunner, "_forward", forward)
        monkeypatch.setattr(ModelRunner, "execute", execute)
        steps = runner.warm_up_eager()
        max_ctx = min(runner.max_seq_len - 1, (runner.num_blocks - 1) * 16)
        contexts = [c for c in (64, 128, 256, 512, 1024, 2048, 4096) if c <= max_ctx]
        assert len(contexts) >= 2
        grid = [(s, max(ctx, 2), 2 + s - 1) for s in (2, 3, 5, 9) for ctx in contexts]
        assert steps == len(grid) + 1 == len(forwards)
        assert forwards[:-1] == grid
        assert executes == [[(64, 0, True), (1, contexts[-1] - 1, True)]]
        assert forwards[-1] == (2, contexts[-1], 65)
        monkeypatch.setattr(ModelRunner, "_forward", real_forward)
        monkeypatch.setattr(ModelRunner, "execute", real_execute)
        assert GOLDEN.startswith(_greedy(llm)) and len(_greedy(llm)) > 100
        # After a real step KV blocks may hold cached prefixes: a warm-up would overwrite them.
        with pytest.raises(RuntimeError, match="before the first step"):
            runner.warm_up_eager()


def test_warm_up_failure_is_logged_not_raised(stories_model_dir, monkeypatch, caplog):
    """A step that raises (a compile failure, say) ends the warm-up with a warning and the engine
    still serves; a CUDA error, which leaves the context unusable, is raised."""
    with LLM(str(stories_model_dir), max_batch_size=4) as llm:
        def boom(*a, **k):
            raise RuntimeError("injected")

        monkeypatch.setattr(llm._executor, "_forward", boom)
        assert llm._executor.warm_up_eager() == 0
        assert "warm-up failed after 0 steps" in caplog.text

        def sticky(*a, **k):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(llm._executor, "_forward", sticky)
        with pytest.raises(RuntimeError, match="illegal memory access"):
            llm._executor.warm_up_eager()
        monkeypatch.undo()
        assert not llm._executor._warming_up
        assert GOLDEN.startswith(_greedy(llm, 20))


def test_warm_up_skips_when_nothing_fits(stories_model_dir):
    """A step budget too small for a chunk plus 64 decode rows: no step, no error."""
    with LLM(str(stories_model_dir), max_batch_size=4, max_num_tokens=64) as llm:
        assert llm._executor.warm_up_eager() == 0
        assert GOLDEN.startswith(_greedy(llm, 20))


@pytest.mark.parametrize("value,on", [(None, True), ('{"warmup": true}', True), ('{"warmup": false}', False)])
def test_warm_up_switch(monkeypatch, value, on):
    if value is not None:
        monkeypatch.setenv("KVPILOT_TUNING", value)
    assert Tuning.from_env().warmup is on
