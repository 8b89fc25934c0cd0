"""FP8 checkpoints in their producers' layouts, built from random-weight tiny Llamas, and the
float32 references they are checked against.

- `modelopt_checkpoint`: NVIDIA ModelOpt's unified Hugging Face export: ``hf_quant_config.json``
  (``producer`` + ``quantization: {quant_algo, kv_cache_quant_algo, exclude_modules}``), FP8 E4M3
  ``weight``, float32 scalar ``weight_scale`` (``amax(|W|) / 448``) and ``input_scale``
  (``amax(|x|) / 448`` over a calibration batch) per linear layer, ``k_proj.k_scale`` /
  ``v_proj.v_scale`` when the KV cache is FP8, ``lm_head`` left unquantized.
- `compressed_tensors_checkpoint`: made by the ``compressed-tensors`` library itself
  (``apply_quantization_config`` with a preset scheme, scales from its ``calculate_qparams``,
  ``ModelCompressor`` compression and ``update_config``), ``ignore: ["lm_head"]``.
- `block_fp8_checkpoint`: the block-wise layout Qwen3 / DeepSeek publish: ``quant_method: "fp8"``,
  ``weight_block_size: [128, 128]``, FP8 ``weight`` and float32 ``weight_scale_inv`` (one
  ``amax / 448`` per 128 x 128 block; ``W ~= weight * weight_scale_inv``).

Each returns ``(checkpoint_dir, reference_dir, act)``: ``reference_dir`` holds the same model with
every quantized weight replaced by its dequantized float32 value (a plain transformers
checkpoint), and ``act`` describes the activation rounding the format prescribes, which
`reference_model` reproduces with forward pre-hooks on the quantized ``nn.Linear`` modules
(written here independently of kvpilot's code).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def tiny_llama(path: Path, seed: int = 0, hidden: int = 64, inter: int = 160, heads: int = 4, kv_heads: int = 2,
               layers: int = 2, vocab: int = 256, head_dim: int | None = None):
    """A random-weight float32 LlamaForCausalLM saved at ``path``; returns the model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=256,
                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, rope_theta=10000.0, head_dim=head_dim,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return model


def _linears(model):
    return {name: m for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and name != "lm_head"}


def _calibrate_input_amax(model, batches) -> dict[str, float]:
    amax: dict[str, float] = {}
    hooks = []
    for name, m in _linears(model).items():
        def hook(mod, args, name=name):
            amax[name] = max(amax.get(name, 0.0), float(args[0].abs().max()))
        hooks.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        for ids in batches:
            model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return amax


def _save_reference(model, deq: dict[str, torch.Tensor], path: Path) -> Path:
    with torch.no_grad():
        for name, w in deq.items():
            model.get_submodule(name).weight.copy_(w)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def modelopt_checkpoint(tmp: Path, calib: list[list[int]], kv_fp8: bool = False, exclude: tuple[str, ...] = ()):
    """ModelOpt FP8 (per-tensor weights, static per-tensor activations). ``exclude``: further
    module names (``model.layers.N.x.y``) left unquantized beside ``lm_head``."""
    src, out, ref = tmp / "bf", tmp / "modelopt", tmp / "modelopt_ref"
    model = tiny_llama(src)
    amax = _calibrate_input_amax(model, calib)
    tensors, deq, input_scales = {}, {}, {}
    for key, t in model.state_dict().items():
        tensors[key] = t.contiguous()
    for name, m in _linears(model).items():
        if name in exclude:
            continue
        w = m.weight.detach().float()
        scale = w.abs().max() / FP8_MAX
        q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale"] = scale.reshape(())
        tensors[f"{name}.input_scale"] = torch.tensor(amax[name] / FP8_MAX)
        input_scales[name] = amax[name] / FP8_MAX
        deq[name] = q.float() * scale
    if kv_fp8:
        for i in range(model.config.num_hidden_layers):
            tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(1.0)
            tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(1.0)
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for f in ("config.json", "generation_config.json"):
        if (src / f).exists():
            shutil.copy(src / f, out / f)
    (out / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.29.0"},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if kv_fp8 else None,
                         "exclude_modules": ["lm_head", *exclude]}}, indent=4))
    _save_reference(model, deq, ref)
    return out, ref, {"mode": "static", "scales": input_scales, "quantized": sorted(deq)}


def block_fp8_checkpoint(tmp: Path, block: int = 128, inter: int = 320):
    """Block-wise FP8 (``quant_method: "fp8"``, ``weight_block_size: [block, block]``,
    ``weight_scale_inv``) of a tiny Llama whose projections are whole 128-blocks and, with the
    default ``inter``, partial ones (gate/up's parts then start inside a block)."""
    src, out, ref = tmp / "bf", tmp / "blockfp8", tmp / "blockfp8_ref"
    model = tiny_llama(src, hidden=256, inter=inter, heads=2, kv_heads=1, head_dim=128)
    tensors = {k: t.contiguous() for k, t in model.state_dict().items()}
    deq = {}
    for name, m in _linears(model).items():
        w = m.weight.detach().float()
        n, k = w.shape
        nb, kb = -(-n // block), -(-k // block)
        padded = torch.zeros(nb * block, kb * block)
        padded[:n, :k] = w
        amax = padded.reshape(nb, block, kb, block).abs().amax(dim=(1, 3))
        scale = (amax / FP8_MAX).clamp(min=1e-12)
        full = scale.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
        q = (w / full).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        tensors[f"{name}.weight"] = q
        tensors[f"{name}.weight_scale_inv"] = scale.contiguous()
        deq[name] = q.float() * full
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                  "weight_block_size": [block, block]}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    _save_reference(model, deq, ref)
    return out, ref, {"mode": None}


def compressed_tensors_checkpoint(tmp: Path, preset: str, calib: list[list[int]]):
    """A compressed-tensors ``float-quantized`` checkpoint made by the library from ``preset``
    ("FP8_DYNAMIC": per-channel weights + dynamic per-token activations; "FP8": per-tensor weights
    + static per-tensor activations; "FP8_W8A16"-like weight-only: preset "W8A16_FP8")."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config, preset_name_to_scheme)
    from compressed_tensors.quantization.utils import calculate_qparams

    src, out, ref = tmp / "bf", tmp / f"ct_{preset}", tmp / f"ct_{preset}_ref"
    model = tiny_llama(src)
    amax = _calibrate_input_amax(model, calib)
    if preset == "W8A16_FP8":
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=8, type="float", strategy="channel", symmetric=True, dynamic=False))
    else:
        scheme = preset_name_to_scheme(preset, ["Linear"])
    qcfg = QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"], format="float-quantized")
    apply_quantization_config(model, qcfg)
    deq, act_scales = {}, {}
    with torch.no_grad():
        for name, m in _linears(model).items():
            w = m.weight.detach().float()
            wa = m.quantization_scheme.weights
            if wa.strategy == "channel":
                lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
            else:
                lo, hi = w.amin().reshape(1), w.amax().reshape(1)
            scale, _ = calculate_qparams(lo, hi, wa)
            m.weight_scale.data = scale.to(m.weight_scale.dtype).reshape(m.weight_scale.shape)
            s = m.weight_scale.float()
            deq[name] = (w / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s
            ia = m.quantization_scheme.input_activations
            if ia is not None and not ia.dynamic:
                a = torch.tensor([amax[name]])
                iscale, _ = calculate_qparams(-a, a, ia)
                m.input_scale.data = iscale.to(m.input_scale.dtype).reshape(m.input_scale.shape)
                act_scales[name] = float(m.input_scale.float().reshape(-1)[0])
        compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
        compressor.compress_model(model)
    out.mkdir()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(src / "config.json", out / "config.json")
    compressor.update_config(str(out))
    ref_model = tiny_llama(tmp / "bf_again")  # same seed: the same float32 weights
    _save_reference(ref_model, deq, ref)
    ia = scheme.input_activations
    mode = None if ia is None else ("token" if ia.dynamic else "static")
    return out, ref, {"mode": mode, "scales": act_scales, "quantized": sorted(deq)}


def reference_model(ref_dir: Path, act: dict):
    """transformers on the dequantized weights, each quantized ``nn.Linear``'s input rounded
    through FP8 as ``act`` says (static per-tensor scales, or dynamic per-token)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(ref_dir), dtype=torch.float32, attn_implementation="eager").eval()
    mode = act.get("mode")
    if mode is None:
        return model
    for name, m in _linears(model).items():
        if name not in act["quantized"]:
            continue

        def hook(mod, args, name=name):
            x = args[0].float()
            if mode == "static":
                s = torch.tensor(act["scales"][name])
            else:
                s = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
            return ((x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s,)
        m.register_forward_pre_hook(hook)
    return model


def per_channel_fp8_reference(path):
    """transformers (float32, eager) on ``path`` with kvpilot's on-the-fly FP8 applied independently:
    every linear layer but ``lm_head`` dequantized from FP8 E4M3 with one ``amax(|W[n]|) / 448`` scale
    per output row, and its input rounded through FP8 per token (``amax(|x|) / 448`` per row)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear) and name != "lm_head":
                w = m.weight.float()
                s = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
                m.weight.copy_((w / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * s)

                def hook(mod, args):
                    x = args[0].float()
                    sx = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
                    return ((x / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * sx,)
                m.register_forward_pre_hook(hook)
    return model
