"""On two GPUs (NCCL, CUDA graphs, the output rank's CUDA IPC ids buffer and events, ``SYNC_SELF``
arg-max ids copied through pinned memory): a deferred step that has nothing to sample (every row ended
by the step before, or a non-final prefill chunk alone) is still awaited, so the next request never
reads its stale answer.

Each case runs a request B alone (the reference), then the trigger, then B twice more: B must come
back the same (one layout, one request at a time: the same graphs at the same shapes, so exactly),
and nothing may stay unawaited in the executor (`EngineCore.step` awaits the step's answer before
``publish_tokens(None)``). CPU counterpart: test_tp_async_steps.py.

Run on a machine with two GPUs: ``pytest -q -m gpu tests/engine/parallel/test_tp_async_steps_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from support.parallel_gpu import SHAPE, model_dir  # noqa: F401  (the module fixture)

from kvpilot import LLM, KvCacheConfig, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")]


@pytest.fixture(scope="module")
def llm(model_dir):  # noqa: F811
    mp = pytest.MonkeyPatch()
    mp.setenv("KVPILOT_TUNING", '{"tp_async": true, "async_scheduling": true}')
    try:
        engine = LLM(str(model_dir), skip_tokenizer_init=True, tensor_parallel_size=2, device="cuda",
                     max_batch_size=16, max_num_tokens=256, max_seq_len=1024,
                     kv_cache_config=KvCacheConfig(free_gpu_memory_fraction=0.3))
    finally:
        mp.undo()
    assert engine._executor.defers_logits
    yield engine
    engine.shutdown()


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, SHAPE["vocab_size"], (n,), generator=g).tolist()


@pytest.mark.parametrize("case", ["argmax_stop_id", "sampled_stop_id", "long_prompt_alone"])
def test_a_deferred_step_with_nothing_to_sample_on_two_gpus(llm, case):
    ex = llm._executor
    sampled = case == "sampled_stop_id"
    # logprobs: the front end samples (SYNC_GO, logits through the IPC slots); without: arg-max steps
    extra = {"logprobs": 1} if sampled else {}
    b_prompt, b_params = _prompt(9, 1), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **extra)

    def run_b():
        out = llm.generate(b_prompt, b_params, use_tqdm=False).outputs[0]
        assert not ex._sent and ex._unpublished == 0 and not ex._go_pending
        return out.token_ids

    ref = run_b()
    self_steps = ex.num_self_steps
    if case == "long_prompt_alone":  # 300 tokens at 256 per step: the first chunk samples nothing
        a = llm.generate(_prompt(300, 2), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                         use_tqdm=False).outputs[0]
        assert len(a.token_ids) == 8
    else:
        a_prompt = _prompt(17, 3)
        free = llm.generate(a_prompt, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, **extra),
                            use_tqdm=False).outputs[0]
        stop = free.token_ids[5]
        ends = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop_token_ids=[stop], **extra)
        a = llm.generate(a_prompt, ends, use_tqdm=False).outputs[0]
        assert a.finish_reason == "stop" and a.token_ids[-1] == stop
        assert a.token_ids == free.token_ids[:len(a.token_ids)]
    assert not ex._sent and ex._unpublished == 0  # the trigger's last step was awaited
    assert [run_b(), run_b()] == [ref, ref]
    if not sampled:
        assert ex.num_self_steps - self_steps > 10  # the output rank's own arg-max fed the steps
