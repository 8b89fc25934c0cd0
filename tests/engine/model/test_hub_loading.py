"""Loading by Hugging Face Hub id from a Hub cache laid out by the test (offline), through the
Python API and `kvpilot serve`'s argument path; revisions; clear errors for a missing revision or
file, remote code and unknown architectures; ``generation_config.json`` sampling defaults."""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from support.engine import make_tiny_llama
from support.hub_cache import add_snapshot

from kvpilot.model.hub import ALLOW_PATTERNS, ModelNotFoundError, resolve_model
from kvpilot.model.config import GenerationDefaults, ModelConfig
from kvpilot.model.registry import UnsupportedArchitectureError

REPO = "kvpilot-test/tiny-llama"
C1, C2 = "1" * 40, "2" * 40
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """Two revisions of a tiny Llama (different weights) with a tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("hub_src")
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(384)} | {"<unk>": 0}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="w1", eos_token="w2")
    dirs = []
    for seed in (0, 1):
        d = make_tiny_llama(root / f"rev{seed}", seed=seed)
        fast.save_pretrained(str(d))
        dirs.append(d)
    return dirs


@pytest.fixture(scope="module")
def hub_cache(model_dirs, tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf_cache") / "hub"
    add_snapshot(cache, REPO, model_dirs[0], C1, refs=("main",))
    add_snapshot(cache, REPO, model_dirs[1], C2, refs=("v2",))
    add_snapshot(cache, "kvpilot-test/no-weights", model_dirs[0], C1, skip=("model.safetensors",))
    return cache


@pytest.fixture
def offline(hub_cache, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # read by huggingface_hub at import
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def test_hub_ids_resolve_to_their_revisions_snapshot(offline):
    assert resolve_model(REPO) == offline / f"models--kvpilot-test--tiny-llama/snapshots/{C1}"
    assert resolve_model(REPO, revision="v2").name == C2  # a tag
    assert resolve_model(REPO, revision=C2).name == C2  # a commit


def test_missing_revision_or_files_are_clear_errors(offline, model_dirs):
    with pytest.raises(ModelNotFoundError, match=r"kvpilot-test/tiny-llama \(revision nope\).*HF_HUB_OFFLINE"):
        resolve_model(REPO, revision="nope")
    with pytest.raises(ModelNotFoundError, match=r"kvpilot-test/absent.*not in the Hugging Face Hub cache"):
        resolve_model("kvpilot-test/absent")
    with pytest.raises(ModelNotFoundError, match=r"no-weights@main.*no \*\.safetensors"):
        resolve_model("kvpilot-test/no-weights")
    with pytest.raises(ModelNotFoundError, match="neither a local directory nor"):
        resolve_model("not a repo id/at/all")
    with pytest.raises(ValueError, match="revision='v2' applies to Hugging Face Hub ids"):
        resolve_model(str(model_dirs[0]), revision="v2")
    assert resolve_model(str(model_dirs[0])) == model_dirs[0]


def test_downloads_only_what_the_engine_loads():
    files = ["model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json",
             "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
             "pytorch_model.bin", "consolidated.pth", "model.pt", "original/params.json", "README.md"]
    kept = [f for f in files if any(fnmatch.fnmatch(f, p) for p in ALLOW_PATTERNS)]
    assert kept == files[:7]


def test_api_and_cli_load_a_hub_id_offline(offline, model_dirs):
    # A fresh process, as users run it: the cache and offline mode come from the environment.
    script = f"""
import json, sys
from kvpilot import LLM, SamplingParams
from kvpilot.server.cli import build_engine, configure_parser
import argparse
greedy = SamplingParams(temperature=0.0, max_tokens=6)
out = {{}}
llm = LLM({REPO!r}, device="cpu", max_seq_len=64)
out["main"] = llm.generate([1, 5, 9, 13], greedy, use_tqdm=False).outputs[0].token_ids
out["main_dir"] = str(llm.model_dir)
llm.shutdown()
parser = argparse.ArgumentParser(); configure_parser(parser)
args = parser.parse_args([{REPO!r}, "--revision", "v2", "--device", "cpu", "--max-seq-len", "64"])
llm = build_engine(args)
out["v2"] = llm.generate([1, 5, 9, 13], greedy, use_tqdm=False).outputs[0].token_ids
out["v2_dir"] = str(llm.model_dir)
llm.shutdown()
print("RESULT" + json.dumps(out))
"""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(offline), TRITON_INTERPRET="1")
    proc = subprocess.run([str(ROOT / ".venv/bin/python"), "-c", script], cwd="/", env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert out["main_dir"].endswith(C1) and out["v2_dir"].endswith(C2)
    from kvpilot import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=6)
    for rev, d in (("main", model_dirs[0]), ("v2", model_dirs[1])):
        llm = LLM(str(d), device="cpu", max_seq_len=64)
        try:
            assert out[rev] == llm.generate([1, 5, 9, 13], greedy, use_tqdm=False).outputs[0].token_ids
        finally:
            llm.shutdown()
    assert out["main"] != out["v2"]  # the revisions really differ


def test_remote_code_and_unknown_architectures_are_named(tmp_path, model_dirs):
    d = tmp_path / "custom"
    shutil.copytree(model_dirs[0], d)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(cfg, architectures=["FancyForCausalLM"],
                                                   auto_map={"AutoModelForCausalLM": "modeling_fancy.Fancy"})))
    with pytest.raises(UnsupportedArchitectureError, match=r"FancyForCausalLM.*needs modelling code.*remote code"
                                                           r".*Gemma2ForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_dir(d)
    with pytest.raises(UnsupportedArchitectureError, match="FancyForCausalLM.*trust_remote_code=True, but"):
        ModelConfig.from_dir(d, trust_remote_code=True)
    (d / "config.json").write_text(json.dumps(dict(cfg, architectures=["MambaForCausalLM"])))
    with pytest.raises(UnsupportedArchitectureError, match=r"unsupported architecture MambaForCausalLM.*"
                                                           r"LlamaForCausalLM, MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM"):
        ModelConfig.from_dir(d)


def test_generation_config_defaults_apply_to_unset_fields(tmp_path, model_dirs):
    from kvpilot import LLM, SamplingParams
    from kvpilot.server.protocol import CompletionRequest
    from kvpilot.server.sampling import completion_params

    d = tmp_path / "gen"
    shutil.copytree(model_dirs[0], d)
    (d / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, 7], "do_sample": True, "temperature": 0.0, "top_p": 0.8,
         "top_k": 20, "repetition_penalty": 1.05}))
    gd = GenerationDefaults.from_dir(d)
    assert gd.values == {"temperature": 0.0, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    assert "temperature=0.0" in gd.describe() and "top_k=20" in gd.describe()
    assert GenerationDefaults.from_dir(model_dirs[0]).values == {}
    # the server: unset fields take the defaults, set ones win
    p = completion_params(CompletionRequest(model="m", prompt="w1"), 4, gd.values)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.0, 0.8, 20, 1.05)
    p = completion_params(CompletionRequest(model="m", prompt="w1", temperature=0.7, top_k=3), 4, gd.values)
    assert (p.temperature, p.top_p, p.top_k) == (0.7, 0.8, 3)
    p = completion_params(CompletionRequest(model="m", prompt="w1"), 4)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    # the API: no sampling_params -> the defaults (greedy here, so repeatable); eos ids merged
    llm = LLM(str(d), device="cpu", max_seq_len=64)
    try:
        assert 7 in llm.eos_token_ids and 2 in llm.eos_token_ids
        dp = llm.default_sampling_params()
        assert (dp.temperature, dp.top_p, dp.top_k, dp.repetition_penalty) == (0.0, 0.8, 20, 1.05)
        a = llm.generate([1, 5, 9], use_tqdm=False).outputs[0].token_ids
        b = llm.generate([1, 5, 9], SamplingParams(temperature=0.0, top_p=0.8, top_k=20, repetition_penalty=1.05),
                         use_tqdm=False).outputs[0].token_ids
        assert a == b and len(a) > 0
    finally:
        llm.shutdown()
