"""On a GPU: decode CUDA-graph steps that read block tables from the runner's persistent
`HostBlockTables` (tables growing in place, replaced, reordered, over many steps) give exactly the
logits of the same steps given fresh copies of every table (which rewrite every row, the behaviour
before the persistent tables), and match eager execution."""

from __future__ import annotations

import pytest
import torch

from support.block_tables import DecodeTables, copies
from support.engine import make_tiny_llama
from kvpilot import LLM, KvCacheConfig

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_gpu
def test_graph_steps_with_persistent_tables_equal_fresh_tables(tmp_path):
    B = 16
    path = make_tiny_llama(tmp_path / "m", seed=9, layers=2)
    with LLM(str(path), skip_tokenizer_init=True, device="cuda", dtype="float32", max_batch_size=64,
             max_seq_len=1024, allow_long_max_seq_len=True,  # 256-position model, 700-token rows
             kv_cache_config=KvCacheConfig(tokens_per_block=B, max_tokens=64 * 1024)) as llm:
        runner = llm._executor
        assert runner.graphs is not None
        torch.manual_seed(0)
        for cache in runner.kv_caches:
            cache.normal_()
        work = DecodeTables(runner.num_blocks, B, num_seqs=60, lo=200, hi=700, seed=1)  # 13-44 blocks each
        for step in range(40):
            seqs = work.step(min_seqs=30)
            got = runner.execute(seqs)[0].clone()
            ref = runner.execute(copies(seqs, 10_000))[0].clone()
            assert torch.equal(got, ref), step
            saved, runner.graphs = runner.graphs, None
            eager = runner.execute(copies(seqs, 20_000))[0]
            runner.graphs = saved
            torch.testing.assert_close(got, eager, rtol=1e-4, atol=1e-4)
            work.advance(seqs, preempt=step % 5 == 4)
