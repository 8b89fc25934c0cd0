"""The seams later features plug into: a quantization method owning a linear layer's storage and
product (and the loader filling the parameters it registers), the MLP slot a family fills per
layer, the architecture registry, and the tensor-parallel linear layers' shards."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from support.engine import make_tiny_llama

from kvpilot.model import registry
from kvpilot.model.config import ModelConfig
from kvpilot.model.layers import ParallelContext
from kvpilot.model.linear import ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from kvpilot.model.quantization import (UnquantizedLinearMethod, UnsupportedQuantizationError,
                                        get_quantization_method, QuantizationMethod)


class RowScaledMethod(QuantizationMethod):
    """A test method: the weight stored divided by a per-row scale, ``weight_scale`` [N] beside it."""

    def __init__(self):
        self.processed = 0

    def create_weights(self, layer, input_size, output_sizes, bias, dtype=None):
        n = sum(output_sizes)
        layer.weight = nn.Parameter(torch.empty(n, input_size), requires_grad=False)
        layer.weight_scale = nn.Parameter(torch.empty(n), requires_grad=False)
        layer.bias = nn.Parameter(torch.empty(n), requires_grad=False) if bias else None

    def apply(self, layer, x, bias=None, out_dtype=None):
        y = (x @ layer.weight.t()) * layer.weight_scale
        return y if bias is None else y + bias

    def process_weights_after_loading(self, layer):
        self.processed += 1


def test_unquantized_method_is_f_linear():
    torch.manual_seed(0)
    layer = ColumnParallelLinear(8, 6, True, ParallelContext())
    assert isinstance(layer.quant_method, UnquantizedLinearMethod) and layer.quant_method.supports_fused_gemv
    with torch.no_grad():
        layer.weight.normal_(), layer.bias.normal_()
    x = torch.randn(3, 8)
    assert torch.equal(layer(x), nn.functional.linear(x, layer.weight, layer.bias))


def test_a_quantization_method_owns_storage_product_and_load_hooks():
    method = RowScaledMethod()
    layer = RowParallelLinear(8, 4, False, ParallelContext(), method)
    assert {n for n, _ in layer.named_parameters()} == {"weight", "weight_scale"}
    with torch.no_grad():
        layer.weight.copy_(torch.eye(4, 8)), layer.weight_scale.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    x = torch.ones(2, 8)
    assert torch.equal(layer(x), torch.tensor([[1.0, 2.0, 3.0, 4.0]] * 2))
    # the fused decode GEMVs never bypass a method that does not support them
    assert layer(x, fused=lambda *a: pytest.fail("fused path taken")).shape == (2, 4)
    layer.process_weights_after_loading()
    assert method.processed == 1


def test_quantized_checkpoints_are_refused_by_name():
    assert isinstance(get_quantization_method({}), UnquantizedLinearMethod)
    with pytest.raises(UnsupportedQuantizationError, match="'bitsandbytes'"):
        get_quantization_method({"quantization_config": {"quant_method": "bitsandbytes"}})


def test_tensor_parallel_shapes_of_the_linear_layers():
    pc = ParallelContext(tp_rank=1, tp_size=2)
    assert QKVParallelLinear(64, 16, 4, 2, False, pc).output_sizes == [32, 16, 16]
    assert QKVParallelLinear(64, 16, 4, 1, False, ParallelContext(tp_rank=1, tp_size=4)).output_sizes == [16, 16, 16]
    assert MergedColumnParallelLinear(64, [96, 96], False, pc).weight.shape == (96, 64)
    assert RowParallelLinear(96, 64, True, pc).weight.shape == (64, 48)
    with pytest.raises(ValueError, match="must divide num_attention_heads 5"):
        QKVParallelLinear(64, 16, 5, 5, False, pc)
    with pytest.raises(ValueError, match="must divide intermediate_size 95"):
        MergedColumnParallelLinear(64, [95, 95], False, pc)


def test_the_mlp_slot_takes_another_block_and_the_loader_fills_it(tmp_path):
    # A family whose even layers hold a different MLP module (as an MoE block would) and whose
    # projections use a custom quantization method: built, loaded and run without touching the
    # decoder layer or the loader.
    from kvpilot.model.decoder import CausalLM
    from kvpilot.model.llama import LlamaSpec
    from kvpilot.model.mlp import GatedMLP
    from kvpilot.model.weights import load_weights

    class TwoHalvesMLP(GatedMLP):
        """The same gated MLP, its output halved: a stand-in for a block of another kind."""

        def forward(self, x):
            return super().forward(x) * 0.5

    class Spec(LlamaSpec):
        def build_mlp(self, layer_idx, pc, reduce_fp32, quant_method):
            cls = TwoHalvesMLP if layer_idx % 2 == 0 else GatedMLP
            cfg = self.cfg
            return cls(cfg.hidden_size, cfg.intermediate_size, pc, cfg.mlp_bias, "silu", reduce_fp32, quant_method)

    class Model(CausalLM):
        spec_cls = Spec

    path = make_tiny_llama(tmp_path / "m", layers=3)
    cfg = ModelConfig.from_dir(path)
    cfg.raw["_model_dir"] = str(path)
    model = Model(cfg)
    load_weights(model, path)
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["TwoHalvesMLP", "GatedMLP", "TwoHalvesMLP"]
    from safetensors.torch import load_file

    ckpt = load_file(str(path / "model.safetensors"))
    gate, up = ckpt["model.layers.1.mlp.gate_proj.weight"], ckpt["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(model.layers[1].mlp.gate_up_proj.weight, torch.cat([gate, up]))


def test_registry_maps_architectures_and_names_the_supported_ones():
    assert registry.model_class("Qwen3ForCausalLM").__name__ == "Qwen3ForCausalLM"
    assert registry.resolve_architecture({"architectures": ["Foo", "MistralForCausalLM"]}) == "MistralForCausalLM"
    assert registry.resolve_architecture({}) == "LlamaForCausalLM"
    with pytest.raises(registry.UnsupportedArchitectureError, match="Gemma2ForCausalLM, Gemma3ForCausalLM"):
        registry.model_class("GPT2LMHeadModel")
    for arch in registry.supported_architectures():  # every entry imports and is a CausalLM
        from kvpilot.model.decoder import CausalLM

        assert issubclass(registry.model_class(arch), CausalLM)


def test_the_loader_fills_what_a_quantization_method_registers(tmp_path):
    # Checkpoint tensors <proj>.weight_scale go to the parameters the method registered, merged and
    # sliced like the weights; the method's post-load hook runs once per projection.
    from safetensors.torch import load_file, save_file

    from kvpilot.model.llama import LlamaForCausalLM
    from kvpilot.model.weights import load_weights

    method = RowScaledMethod()

    class Model(LlamaForCausalLM):
        def build_layer(self, layer_idx):
            return self.decoder_layer_cls(self.cfg, layer_idx, self.pc, False, False, self.spec, method)

    path = make_tiny_llama(tmp_path / "q", layers=2)
    ckpt = load_file(str(path / "model.safetensors"))
    for key, t in list(ckpt.items()):
        if key.endswith("_proj.weight"):
            ckpt[key.replace(".weight", ".weight_scale")] = torch.arange(t.shape[0], dtype=torch.float32) + len(key)
    save_file(ckpt, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = ModelConfig.from_dir(path)
    cfg.raw["_model_dir"] = str(path)
    model = Model(cfg)
    load_weights(model, path)
    for i, layer in enumerate(model.layers):
        pre = f"model.layers.{i}."
        want = torch.cat([ckpt[pre + f"self_attn.{p}_proj.weight_scale"] for p in "qkv"])
        assert torch.equal(layer.self_attn.qkv_proj.weight_scale, want)
        assert torch.equal(layer.self_attn.o_proj.weight_scale, ckpt[pre + "self_attn.o_proj.weight_scale"])
        want = torch.cat([ckpt[pre + f"mlp.{p}_proj.weight_scale"] for p in ("gate", "up")])
        assert torch.equal(layer.mlp.gate_up_proj.weight_scale, want)
        assert torch.equal(layer.mlp.down_proj.weight_scale, ckpt[pre + "mlp.down_proj.weight_scale"])
        assert not layer.can_fuse  # the fused GEMVs do not read this storage
    assert method.processed == 4 * len(model.layers)


def test_tp_invariant_mode_is_refused_for_families_without_shard_layers(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from kvpilot.model.qwen2 import Qwen2ForCausalLM as Ours
    from kvpilot.tuning import Tuning

    path = tmp_path / "qwen2"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(str(path))
    with pytest.raises(ValueError, match="Llama only, not Qwen2ForCausalLM"):
        Ours(ModelConfig.from_dir(path), tuning=Tuning(tp_invariant=2))
