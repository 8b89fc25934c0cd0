"""Each tensor-parallel rank's LoRA slots hold its share of an adapter: for column-parallel
projections (q/k/v, gate/up) the rank's update is the whole model's update at the rank's output
rows (replicated KV heads at TP 4 over 2 KV heads included); for row-parallel ones (o, down) the
ranks' partial updates over their input columns sum to the whole update. No processes: the ranks'
layers are built one after another with their `ParallelContext`."""

from __future__ import annotations

import pytest
import torch

from support.engine import make_tiny_llama

from kvpilot.executor import LoRARequest
from kvpilot.kernels.lora import lora_apply_ref
from kvpilot.lora.adapter import load_adapter
from kvpilot.lora.config import LoraConfig
from kvpilot.lora.layers import LoRASlots, global_targets
from kvpilot.model.config import ModelConfig
from kvpilot.model.layers import ParallelContext
from kvpilot.model.registry import model_class

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    from peft import LoraConfig as PeftLoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    d = tmp_path_factory.mktemp("shards")
    base = make_tiny_llama(d / "base", seed=3, layers=1)
    torch.manual_seed(0)
    pm = get_peft_model(LlamaForCausalLM.from_pretrained(str(base)), PeftLoraConfig(
        init_lora_weights=False, r=4, lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    pm.save_pretrained(str(d / "a"))
    cfg = ModelConfig.from_dir(base)
    ad = load_adapter(LoRARequest("a", 1, str(d / "a")), global_targets(cfg), cfg.num_hidden_layers, 8, torch.float32)
    return cfg, ad


def _slots(cfg, ad, rank, tp):
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, ParallelContext(rank, tp), None)
    model = model.to_empty(device="cpu")
    slots = LoRASlots(model, LoraConfig(max_loras=1, max_lora_rank=8), torch.float32, torch.device("cpu"))
    slots._slot(ad, set())
    return slots.projections


def _update(p, x):
    idx = torch.zeros(x.shape[0], dtype=torch.int32)
    return lora_apply_ref(x, torch.zeros(x.shape[0], p.b.shape[1]), p.a, p.b, idx, [0])


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_shares_add_up_to_the_whole_update(adapter, tp):
    cfg, ad = adapter
    whole = _slots(cfg, ad, 0, 1)
    ranks = [_slots(cfg, ad, r, tp) for r in range(tp)]
    torch.manual_seed(1)
    for key, full in whole.items():
        x = torch.randn(5, full.a.shape[2])
        want = _update(full, x)
        assert want.abs().max() > 1e-3
        if key[1] in ("o_proj", "down_proj"):
            total = sum(_update(rk[key], x[:, rk[key].col_start:rk[key].col_start + rk[key].a.shape[2]]) for rk in ranks)
            torch.testing.assert_close(total, want, rtol=1e-5, atol=1e-5)
        else:
            for rk in ranks:
                torch.testing.assert_close(_update(rk[key], x), want[:, rk[key].rows], rtol=1e-5, atol=1e-5)


def test_warm_up_compiles_each_projection_shape_once_and_changes_nothing(adapter):
    pytest.importorskip("triton")
    cfg, ad = adapter
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, ParallelContext(), None)
    model = model.to_empty(device="cpu")
    slots = LoRASlots(model, LoraConfig(max_loras=2, max_lora_rank=8), torch.float32, torch.device("cpu"))
    assert slots.warm_up() == 4  # qkv, o, gate_up, down: one shape each (one layer)
    assert all(not p.a.any() and not p.b.any() for p in slots.projections.values())


def test_worker_plans_carry_each_sequences_adapter_request():
    """The plan sent to worker processes names each sequence's adapter by its `LoRARequest` (not
    its tensors), and the worker's decoder turns it back into that rank's loaded adapter."""
    import pickle
    from types import SimpleNamespace

    from kvpilot.parallel.worker import PlanDecoder, PlanEncoder
    from kvpilot.runner.batch import ScheduledSeq

    req = LoRARequest("a", 7, "/adapters/a")
    front = SimpleNamespace(request=req, weights={"big": "tensors"})
    plan = [ScheduledSeq(1, [5, 6], 0, [0], True, lora=front), ScheduledSeq(2, [9], 3, [1], True)]
    encoded = PlanEncoder().encode(plan)
    assert "tensors" not in repr(encoded) and req in encoded[0]
    loaded = {}
    got = PlanDecoder(lambda r: loaded.setdefault(r, SimpleNamespace(request=r))).decode(
        pickle.loads(pickle.dumps(encoded)))
    assert got[0].lora is loaded[req] and got[0].verify is False and got[0].inflight_row == -1
    assert got[1].lora is None
