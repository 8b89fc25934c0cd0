"""LoRA adapters in the engine match peft on transformers (float32, CPU, random weights).

A tiny random Llama and random PEFT adapters (``init_lora_weights=False``): one on all seven
projections, one on q/v/down with rsLoRA and per-module rank and alpha patterns. Teacher-forced
prompt log-probabilities and the log-probabilities of generated tokens match peft's model within
1e-4; a batch mixing both adapters and the base model gives every request what it gets alone
(with ``max_loras`` 1 too, where the scheduler holds back the second adapter); prefix-cache blocks
are never shared across adapters.
"""

from __future__ import annotations

import json

import pytest
import torch

from support.engine import make_tiny_llama
from support.fp8_checkpoints import per_channel_fp8_reference
from support.lora import make_peft_adapter

from kvpilot import LLM, KvCacheConfig, SamplingParams
from kvpilot.executor import LoRARequest
from kvpilot.llmapi import LoraConfig
from kvpilot.lora.adapter import LoRAAdapterError

peft = pytest.importorskip("peft")

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = make_tiny_llama(d / "base", seed=5, layers=2)
    a = make_peft_adapter(base, d / "a", 1, r=4, lora_alpha=8, target_modules=ALL)
    b = make_peft_adapter(base, d / "b", 2, r=6, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"],
                      rank_pattern={"v_proj": 3}, alpha_pattern={"down_proj": 7})
    llm = LLM(str(base), skip_tokenizer_init=True, device="cpu", dtype="float32", max_batch_size=8,
              max_num_tokens=64, kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024),
              lora_config=LoraConfig(lora_dir=[str(a)], max_loras=2, max_lora_rank=8))
    yield d, base, a, b, llm
    llm.shutdown()


_models: dict = {}


def _peft_logprobs(base, adapter, tokens):
    """log p(tokens[i] | tokens[:i]) for i >= 1 under base (+ adapter), by transformers + peft."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    key = (str(base), str(adapter))
    model = _models.get(key)
    if model is None:
        model = LlamaForCausalLM.from_pretrained(str(base), dtype=torch.float32, attn_implementation="eager").eval()
        if adapter is not None:
            model = PeftModel.from_pretrained(model, str(adapter)).eval()
        _models[key] = model
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    lp = torch.log_softmax(logits, -1)
    return [float(lp[i - 1, tokens[i]]) for i in range(1, len(tokens))]


PROMPTS = [[1, 17, 99, 4, 250, 31, 8, 77, 5, 140, 61], [1, 300, 12, 12, 45], [1, 9, 200, 33, 71, 2, 150, 88, 19]]


def _req(d, name, i):
    return LoRARequest(name, i, str(d / name))


def test_prompt_and_generated_logprobs_match_peft(setup):
    d, base, a, b, llm = setup
    sp = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=0, logprobs=0, ignore_eos=True)
    for adapter, lr in ((a, _req(d, "a", 1)), (b, _req(d, "b", 2)), (None, None)):
        for prompt in PROMPTS[:2]:
            out = llm.generate(prompt, sp, lora_request=lr)
            c = out.outputs[0]
            tokens = prompt + list(c.token_ids)
            ref = _peft_logprobs(base, adapter, tokens)
            got = [next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]]
            got += [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]
            assert len(got) == len(ref)
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=0, atol=1e-4)


def test_adapters_change_the_output(setup):
    d, base, a, b, _ = setup
    tokens = PROMPTS[0]
    ref_base = torch.tensor(_peft_logprobs(base, None, tokens))
    for adapter in (a, b):
        assert (torch.tensor(_peft_logprobs(base, adapter, tokens)) - ref_base).abs().max() > 0.05


def _greedy(llm, prompts, loras, n=8):
    sp = SamplingParams(max_tokens=n, temperature=0.0, logprobs=0, ignore_eos=True)
    outs = llm.generate(prompts, sp, lora_request=loras, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), [lp[t].logprob for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])
            for o in outs]


def test_mixed_batch_matches_each_request_alone(setup):
    d, base, a, b, llm = setup
    ra, rb = _req(d, "a", 1), _req(d, "b", 2)
    prompts = PROMPTS + [PROMPTS[0], PROMPTS[1]]
    loras = [ra, None, rb, rb, ra]
    seen = []
    llm.add_stat_logger(seen.append)
    mixed = _greedy(llm, prompts, loras)
    llm._loop.stat_loggers.remove(seen.append)
    assert ["a", "b"] in [s.running_lora_adapters for s in seen]  # both adapters ran in one step
    assert all(s.max_lora == 2 for s in seen)
    for p, lr, got in zip(prompts, loras, mixed):
        alone = _greedy(llm, [p], [lr])[0]
        assert got[0] == alone[0]
        torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(alone[1]), rtol=0, atol=1e-5)
    assert mixed[0][0] != mixed[3][0] or mixed[0][1] != mixed[3][1]  # same prompt, other adapter


def test_one_slot_serves_two_adapters_in_turn(setup):
    d, base, a, b, llm = setup
    ra, rb = _req(d, "a", 1), _req(d, "b", 2)
    want = _greedy(llm, [PROMPTS[0], PROMPTS[2], PROMPTS[1]], [ra, rb, None])
    one = LLM(str(base), skip_tokenizer_init=True, device="cpu", dtype="float32", max_batch_size=8,
              max_num_tokens=64, kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024),
              lora_config=LoraConfig(max_loras=1, max_lora_rank=8))
    try:
        got = _greedy(one, [PROMPTS[0], PROMPTS[2], PROMPTS[1]], [ra, rb, None])
        assert [g[0] for g in got] == [w[0] for w in want]
        assert one._executor.lora.loads == 2
    finally:
        one.shutdown()


def test_prefix_cache_blocks_are_not_shared_across_adapters(setup):
    d, base, a, b, llm = setup
    ra = _req(d, "a", 1)
    prompt = [1] + list(range(40, 60))  # 21 tokens: five full blocks of 4
    stats = llm._core.kv.stats
    _greedy(llm, [prompt], [None], n=2)
    hits = stats.hits
    with_a = _greedy(llm, [prompt], [ra], n=4)
    assert stats.hits == hits  # the base model's blocks are not reused for the adapter
    _greedy(llm, [prompt], [ra], n=2)
    assert stats.hits > hits  # the adapter's own blocks are
    ref = _peft_logprobs(base, a, prompt + with_a[0][0])[-4:]
    torch.testing.assert_close(torch.tensor(with_a[0][1]), torch.tensor(ref), rtol=0, atol=1e-4)


def test_bad_adapters_and_requests_are_clear_errors(setup, tmp_path):
    d, base, a, b, llm = setup
    with pytest.raises(ValueError, match="lora_int_id 1 is already the adapter"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=1), lora_request=LoRARequest("b", 1, str(b)))
    with pytest.raises(FileNotFoundError, match="no directory"):
        llm.generate(PROMPTS[0], lora_request=LoRARequest("x", 9, str(tmp_path / "missing")))
    big = make_peft_adapter(base, tmp_path / "big", 3, r=16, lora_alpha=16, target_modules=["q_proj"])
    with pytest.raises(LoRAAdapterError, match="rank 16 .* above max_lora_rank 8"):
        llm.generate(PROMPTS[0], lora_request=LoRARequest("big", 10, str(big)))
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "use_dora": True}))
    (dora / "adapter_model.safetensors").write_bytes((a / "adapter_model.safetensors").read_bytes())
    with pytest.raises(LoRAAdapterError, match="DoRA"):
        llm.generate(PROMPTS[0], lora_request=LoRARequest("dora", 11, str(dora)))
    with pytest.raises(ValueError, match="2 lora_request entries for 3 prompts"):
        llm.generate(PROMPTS, lora_request=[None, None])
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 0"):
        LoRARequest("x", -1, "p")
    with pytest.raises(ValueError, match="max_cpu_loras must be an integer >= max_loras"):
        LoraConfig(max_loras=4, max_cpu_loras=2)


@pytest.mark.parametrize("bad", [5, [3], {"a": "p"}])
def test_lora_dir_that_is_not_paths_is_a_value_error_naming_the_field(bad, tmp_path):
    with pytest.raises(ValueError, match="LoraConfig.lora_dir must be a list of adapter directories"):
        LoraConfig(lora_dir=bad)
    assert LoraConfig(lora_dir=tmp_path).lora_dir == [str(tmp_path)]


def test_lora_request_without_lora_config_is_refused(tmp_path):
    base = make_tiny_llama(tmp_path / "base", seed=5, layers=1)
    with LLM(str(base), skip_tokenizer_init=True, device="cpu", dtype="float32",
             kv_cache_config=KvCacheConfig(max_tokens=256)) as llm:
        with pytest.raises(ValueError, match="needs an LLM created with lora_config"):
            llm.generate([1, 2, 3], lora_request=LoRARequest("a", 1, str(tmp_path)))


def test_adapter_for_another_model_is_refused_at_start(setup, tmp_path):
    d, base, a, b, llm = setup
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(vocab_size=384, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(str(other))
    wrong = make_peft_adapter(other, tmp_path / "wrong", 4, r=4, lora_alpha=4, target_modules=["q_proj"])
    with pytest.raises(LoRAAdapterError, match="another model"):
        LLM(str(base), skip_tokenizer_init=True, device="cpu", dtype="float32",
            kv_cache_config=KvCacheConfig(max_tokens=256), lora_config=LoraConfig(lora_dir=[str(wrong)], max_lora_rank=8))


@pytest.mark.slow  # two worker processes: ~30 s on two cores (the shard math: test_lora_tensor_parallel_shards.py)
def test_tensor_parallel_adapters_match_peft(setup):
    """TP 2 on CPU (gloo): adapters sharded like their base layers (q/k/v, gate/up by output rows;
    o/down by input columns, added before the all-reduce) give peft's log-probabilities."""
    d, base, a, b, _ = setup
    ra, rb = _req(d, "a", 1), _req(d, "b", 2)
    with LLM(str(base), skip_tokenizer_init=True, device="cpu", dtype="float32", tensor_parallel_size=2,
             max_batch_size=8, max_num_tokens=64, kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024),
             lora_config=LoraConfig(max_loras=2, max_lora_rank=8)) as tp:
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
        got = _greedy(tp, prompts, [ra, rb, None], n=5)
    for p, adapter, (toks, lps) in zip(prompts, (a, b, None), got):
        ref = _peft_logprobs(base, adapter, p + toks)[-5:]
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref), rtol=0, atol=1e-4)


def test_engine_with_the_triton_kernels_matches_the_reference(setup, monkeypatch):
    """The engine's projections through the Triton shrink/expand kernels (TRITON_INTERPRET=1 on
    CPU) give the tokens and log-probabilities of the PyTorch reference, in a mixed batch."""
    pytest.importorskip("triton")
    from kvpilot.kernels import lora as KL
    from kvpilot.lora import layers as LL

    d, base, a, b, llm = setup
    ra, rb = _req(d, "a", 1), _req(d, "b", 2)
    prompts, loras = [PROMPTS[1], PROMPTS[1], [1, 5, 9]], [ra, None, rb]
    want = _greedy(llm, prompts, loras, n=2)
    calls = []

    def triton_apply(x, out, a_, b_, slot, slots=None, tiles=None):
        calls.append(x.shape[0])
        return KL.lora_apply_triton(x, out, a_, b_, slot, tiles=tiles)

    monkeypatch.setattr(LL, "lora_apply", triton_apply)
    got = _greedy(llm, prompts, loras, n=2)
    assert calls
    for (gt, gl), (wt, wl) in zip(got, want):
        assert gt == wt
        torch.testing.assert_close(torch.tensor(gl), torch.tensor(wl), rtol=0, atol=1e-5)


def test_adapters_on_fp8_base_weights_match_peft(setup):
    """On-the-fly FP8 base weights (``QuantConfig(quant_algo="FP8")``: per-channel weight scales,
    inputs rounded per token) with an adapter: the adapter's update reads the unrounded input, as
    peft's LoRA layer does around the FP8-dequantized linear layers of transformers."""
    from peft import PeftModel

    from kvpilot.llmapi import QuantConfig

    d, base, a, b, _ = setup
    ref = per_channel_fp8_reference(base)
    ref = PeftModel.from_pretrained(ref, str(a)).eval()
    prompt = PROMPTS[0]
    with LLM(str(base), skip_tokenizer_init=True, device="cpu", dtype="float32",
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=256),
             quant_config=QuantConfig(quant_algo="FP8"), lora_config=LoraConfig(max_lora_rank=8)) as fp8:
        assert fp8._executor.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        out = fp8.generate(prompt, SamplingParams(max_tokens=1, prompt_logprobs=0), lora_request=_req(d, "a", 1))
    got = [next(iter(e.values())).logprob for e in out.prompt_logprobs[1:]]
    with torch.no_grad():
        lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].float(), -1)
    want = [float(lp[i - 1, prompt[i]]) for i in range(1, len(prompt))]
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-4)


def test_ngram_speculation_keeps_each_adapters_greedy_tokens(setup):
    """Drafts are verified by the target model with each request's adapter: greedy tokens with
    n-gram speculation equal those without, in a mixed batch."""
    from kvpilot.llmapi import NGramDecodingConfig

    d, base, a, b, llm = setup
    ra, rb = _req(d, "a", 1), _req(d, "b", 2)
    prompts = [[1, 5, 6, 7, 5, 6, 7, 5, 6], [1, 5, 6, 7, 5, 6, 7, 5, 6], [1, 9, 9, 9, 9]]
    loras = [ra, rb, None]
    want = _greedy(llm, prompts, loras, n=6)
    with LLM(str(base), skip_tokenizer_init=True, device="cpu", dtype="float32", max_batch_size=8,
             max_num_tokens=64, kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024),
             lora_config=LoraConfig(max_loras=2, max_lora_rank=8),
             speculative_config=NGramDecodingConfig(max_draft_len=3, max_matching_ngram_size=2)) as spec:
        got = _greedy(spec, prompts, loras, n=6)
        drafted = spec._core.spec.totals.num_draft_tokens
    assert drafted > 0
    assert [g[0] for g in got] == [w[0] for w in want]


@pytest.mark.slow  # two worker processes: ~30 s on two cores
def test_pipeline_parallel_adapters_match_peft(setup):
    """PP 2 on CPU (gloo): each stage applies its layers' share of every adapter; micro-batches with
    adapters run eagerly on every stage."""
    d, base, a, b, _ = setup
    ra, rb = _req(d, "a", 1), _req(d, "b", 2)
    with LLM(str(base), skip_tokenizer_init=True, device="cpu", dtype="float32", pipeline_parallel_size=2,
             max_batch_size=8, max_num_tokens=64, kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024),
             lora_config=LoraConfig(max_loras=2, max_lora_rank=8)) as pp:
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1]]
        got = _greedy(pp, prompts, [ra, rb, None, ra], n=5)
    for p, adapter, (toks, lps) in zip(prompts, (a, b, None, a), got):
        ref = _peft_logprobs(base, adapter, p + toks)[-5:]
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref), rtol=0, atol=1e-4)
