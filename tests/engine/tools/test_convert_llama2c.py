"""The llama2.c -> Hugging Face converter, checked against llama2.c's own algorithms.

References written here in plain Python/torch from llama2.c's ``run.c`` semantics (described in
shared/models/stories260K/SOURCE.md): ``llama2c_encode`` (its ``encode()``) and
``llama2c_forward`` (its ``forward()``, with interleaved RoPE).

Tokenizer contract verified: for every valid Unicode string ``s`` (no lone surrogates),
``tokenizer(s).input_ids == llama2c_encode(s)`` (BOS added, no EOS), for the raw ``tokenizers``
object (with ``encode_special_tokens = True``) and for ``AutoTokenizer``; and
``decode(ids, skip_special_tokens=True) == s`` exactly, leading/repeated spaces included.
"""

from __future__ import annotations

import json
import math
import os
import random
import string
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvpilot.tools.convert_llama2c import (
    convert_llama2c,
    ensure_stories260k,
    read_llama2c_checkpoint,
    read_llama2c_tokenizer,
    stories260k_source_dir,
)

GOLDEN = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it, but it was too high."
)


def _source(name: str) -> Path:
    path = stories260k_source_dir() / name
    if not path.is_file():
        pytest.skip(f"stories260K source file {path} not available")
    return path


def read_pieces() -> list[tuple[bytes, float]]:
    return read_llama2c_tokenizer(_source("tok512.bin"))


# ---------------------------------------------------------------- llama2.c reference encoder


def llama2c_encode(pieces: list[tuple[bytes, float]], text: str, bos: bool = True, eos: bool = False) -> list[int]:
    """llama2.c's encode(): dummy " " prefix, one token per UTF-8 code point (else its bytes + 3),
    then repeatedly merge the adjacent pair whose concatenation is the highest-scoring piece
    (strict >, so the leftmost wins ties). Works on bytes, exactly as the C code does."""
    lookup = {p: i for i, (p, _) in enumerate(pieces)}
    data = text.encode("utf-8")
    tokens = [1] if bos else []
    if data:
        tokens.append(lookup[b" "])
    buf = b""
    for idx, byte in enumerate(data):
        if byte & 0xC0 != 0x80:
            buf = b""
        buf += bytes([byte])
        nxt = data[idx + 1] if idx + 1 < len(data) else 0
        if nxt & 0xC0 == 0x80 and len(buf) < 4:
            continue
        if buf in lookup:
            tokens.append(lookup[buf])
        else:
            tokens.extend(b + 3 for b in buf)
        buf = b""
    while True:
        best_score, best_id, best_idx = -1e10, -1, -1
        for i in range(len(tokens) - 1):
            merged = lookup.get(pieces[tokens[i]][0] + pieces[tokens[i + 1]][0])
            if merged is not None and pieces[merged][1] > best_score:
                best_score, best_id, best_idx = pieces[merged][1], merged, i
        if best_idx == -1:
            break
        tokens[best_idx : best_idx + 2] = [best_id]
    if eos:
        tokens.append(2)
    return tokens


_UNICODE_POOL = [
    "é", "ñ", "â", "日本", "語", "😀", "👩\u200d👩\u200d👧", "’", "‘", "…", "€", "™", "\u00a0", "\u200a",
    "\u2581", "e\u0301", "Привет", "مرحبا", "\x00", "\t", "\r\n", "\x7f", "\U0001f600", "\U00010348",
]
_WORDS = "Once upon a time there was little girl named Lily She loved to play outside in the park One day".split()


def random_texts(rng: random.Random, n_per_family: int, pieces: list[tuple[bytes, float]]) -> list[str]:
    """Strings from several families: printable ASCII, concatenated vocab pieces (which exercise
    merge order hardest), words with irregular whitespace, digits/punctuation, repeated letters,
    Unicode (byte fallback), and random code points."""
    normal = [p.decode() for p, _ in pieces[259:]]
    texts = ["", " ", "  ", "\n", " hi", "hi ", "<s>", "</s>", "<unk>", "<0x41>", "a<s>b", "\u2581x"]
    for _ in range(n_per_family):
        texts.append("".join(rng.choices(string.printable, k=rng.randint(1, 40))))
        texts.append("".join(rng.choices(normal, k=rng.randint(1, 12))))
        sep = lambda: rng.choice([" ", " ", "  ", "   ", "\n", "\n\n", "\t", ", ", ". "])  # noqa: E731
        texts.append("".join(rng.choice(_WORDS) + sep() for _ in range(rng.randint(1, 10))))
        texts.append("".join(rng.choices(string.digits + string.punctuation + " ", k=rng.randint(1, 25))))
        texts.append(" ".join(rng.choice("lpoe") * rng.randint(1, 7) for _ in range(rng.randint(1, 4))))
        texts.append("".join(rng.choice(_UNICODE_POOL + _WORDS + [" "]) for _ in range(rng.randint(1, 10))))
        cps = [rng.choice([rng.randint(1, 0xD7FF), rng.randint(0xE000, 0x10FFFF)]) for _ in range(rng.randint(1, 6))]
        texts.append("".join(map(chr, cps)))
    return texts


@pytest.fixture(scope="module")
def pieces() -> list[tuple[bytes, float]]:
    return read_pieces()


@pytest.fixture(scope="module")
def texts(pieces) -> list[str]:
    return random_texts(random.Random(1234), 60, pieces)


@pytest.fixture(scope="module")
def hf_tokenizer(stories_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(stories_model_dir)


def test_reference_encoder_golden_ids(pieces):
    # Pinned ids (run.c semantics) so the reference itself cannot drift unnoticed.
    assert llama2c_encode(pieces, "") == [1]
    assert llama2c_encode(pieces, "Once upon a time") == [1, 403, 407, 261, 378]
    assert llama2c_encode(pieces, " hi") == [1, 410, 270, 417]
    assert llama2c_encode(pieces, "日本 é") == [1, 410, 233, 154, 168, 233, 159, 175, 410, 485]


def test_raw_tokenizer_matches_llama2c_encoder(stories_model_dir, pieces, texts):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(stories_model_dir / "tokenizer.json"))
    tok.encode_special_tokens = True  # not serialised in tokenizer.json; tokenizer_config.json sets it for transformers
    assert len(texts) > 400
    encodings = tok.encode_batch(texts)
    mismatches = [(s, e.ids) for s, e in zip(texts, encodings) if e.ids != llama2c_encode(pieces, s)]
    assert mismatches == []
    assert [tok.decode(e.ids) for e in encodings] == texts


def test_auto_tokenizer_matches_llama2c_encoder_and_round_trips(hf_tokenizer, pieces, texts):
    ids = hf_tokenizer(texts).input_ids
    assert [i for i, (s, got) in enumerate(zip(texts, ids)) if got != llama2c_encode(pieces, s)] == []
    assert hf_tokenizer.batch_decode(ids, skip_special_tokens=True) == texts
    assert hf_tokenizer("").input_ids == [1]
    assert hf_tokenizer("Once upon a time", add_special_tokens=False).input_ids == [403, 407, 261, 378]
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.unk_token_id) == (1, 2, 0)
    assert hf_tokenizer.model_max_length == 512
    assert not hf_tokenizer.chat_template


def test_merges_are_ranked_by_piece_score(stories_model_dir, pieces):
    model = json.loads((stories_model_dir / "tokenizer.json").read_text())["model"]
    assert model["type"] == "BPE" and model["byte_fallback"] is True
    assert model["merges"][:4] == [[" ", "t"], ["h", "e"], [" ", "a"], [" ", "s"]]
    lookup = {p: i for i, (p, _) in enumerate(pieces)}
    scores = [pieces[lookup[(a + b).encode()]][1] for a, b in model["merges"]]
    assert scores == sorted(scores, reverse=True)
    assert model["vocab"]["<s>"] == 1 and model["vocab"]["<0x0A>"] == 13 and model["vocab"][" the"] == 265


# ---------------------------------------------------------------- config and weights


def test_config_files(stories_model_dir):
    config = json.loads((stories_model_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 172,
        "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
        "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32",
        "hidden_act": "silu",
    }
    assert {k: config[k] for k in expected} == expected
    gen = json.loads((stories_model_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [1, 2] and gen["bos_token_id"] == 1
    tok_cfg = json.loads((stories_model_dir / "tokenizer_config.json").read_text())
    assert {k: tok_cfg[k] for k in ("bos_token", "eos_token", "unk_token", "add_bos_token", "add_eos_token")} == {
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False,
    }
    assert tok_cfg["model_max_length"] == 512 and "chat_template" not in tok_cfg


def test_safetensors_shapes_and_values(stories_model_dir):
    sd = load_file(str(stories_model_dir / "model.safetensors"))
    cfg, raw = read_llama2c_checkpoint(_source("stories260K.bin"))
    assert len(sd) == 2 + 9 * 5 and "lm_head.weight" not in sd
    assert all(t.dtype == torch.float32 for t in sd.values())
    shapes = {
        "self_attn.q_proj.weight": (64, 64), "self_attn.k_proj.weight": (32, 64), "self_attn.v_proj.weight": (32, 64),
        "self_attn.o_proj.weight": (64, 64), "mlp.gate_proj.weight": (172, 64), "mlp.up_proj.weight": (172, 64),
        "mlp.down_proj.weight": (64, 172), "input_layernorm.weight": (64,), "post_attention_layernorm.weight": (64,),
    }
    for i in range(5):
        for name, shape in shapes.items():
            assert tuple(sd[f"model.layers.{i}.{name}"].shape) == shape
    assert torch.equal(sd["model.embed_tokens.weight"], raw["token_embedding"])
    assert torch.equal(sd["model.layers.3.mlp.down_proj.weight"], raw["w2"][3])
    # Head 1 of layer 2: HF row 8+j (first half) is llama2.c row 8+2j, row 8+4+j is 8+2j+1.
    q_hf, q_raw = sd["model.layers.2.self_attn.q_proj.weight"], raw["wq"][2]
    assert torch.equal(q_hf[8:12], q_raw[8:16:2]) and torch.equal(q_hf[12:16], q_raw[9:16:2])
    k_hf, k_raw = sd["model.layers.2.self_attn.k_proj.weight"], raw["wk"][2]
    assert torch.equal(k_hf[24:28], k_raw[24:32:2]) and torch.equal(k_hf[28:32], k_raw[25:32:2])


# ---------------------------------------------------------------- model equivalence


def llama2c_forward(raw: dict[str, torch.Tensor], cfg, tokens: list[int], interleaved: bool = True) -> torch.Tensor:
    """llama2.c forward() over a whole sequence, float64: returns logits [len(tokens), vocab].
    ``interleaved=False`` rotates half-split pairs instead (HF's convention) for a negative control."""
    w = {k: v.double() for k, v in raw.items()}
    T, H, KV, hd = len(tokens), cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    def rmsnorm(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * weight

    freqs = 1.0 / 10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    angle = torch.outer(torch.arange(T, dtype=torch.float64), freqs)[:, None, :]  # [T, 1, hd/2]
    cos, sin = angle.cos(), angle.sin()

    def rope(x):  # x [T, heads, hd]; rotates the pairs (2i, 2i+1), or (i, i + hd/2) if not interleaved
        if not interleaved:
            x0, x1 = x[..., : hd // 2], x[..., hd // 2 :]
            return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).flatten(-2)

    x = w["token_embedding"][tokens]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for layer in range(cfg.n_layers):
        h = rmsnorm(x, w["rms_att"][layer])
        q = rope((h @ w["wq"][layer].T).view(T, H, hd))
        k = rope((h @ w["wk"][layer].T).view(T, KV, hd)).repeat_interleave(H // KV, dim=1)
        v = (h @ w["wv"][layer].T).view(T, KV, hd).repeat_interleave(H // KV, dim=1)
        att = torch.einsum("thd,shd->hts", q, k) / math.sqrt(hd)
        att = att.masked_fill(~causal, float("-inf")).softmax(-1)
        x = x + torch.einsum("hts,shd->thd", att, v).reshape(T, -1) @ w["wo"][layer].T
        h = rmsnorm(x, w["rms_ffn"][layer])
        x = x + (torch.nn.functional.silu(h @ w["w1"][layer].T) * (h @ w["w3"][layer].T)) @ w["w2"][layer].T
    return rmsnorm(x, w["rms_final"]) @ w["token_embedding"].T


@pytest.fixture(scope="module")
def hf_model(stories_model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(stories_model_dir, dtype=torch.float32).eval()


def test_logits_match_llama2c_forward(hf_model, pieces):
    cfg, raw = read_llama2c_checkpoint(_source("stories260K.bin"))
    tokens = llama2c_encode(pieces, "Once upon a time, there was a big dog. He liked to run!")
    assert len(tokens) > 12
    ref = llama2c_forward(raw, cfg, tokens)
    with torch.no_grad():
        got = hf_model(torch.tensor([tokens])).logits[0].double()
    assert got.shape == (len(tokens), 512)
    assert (got - ref).abs().max().item() < 1e-4
    # Negative control: what transformers would compute on unpermuted q/k rows is far off.
    assert (llama2c_forward(raw, cfg, tokens, interleaved=False) - ref).abs().max().item() > 0.1


def test_greedy_generation_golden(hf_model, hf_tokenizer):
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([[1]]), do_sample=False, max_new_tokens=400)[0].tolist()
    text = hf_tokenizer.decode(out, skip_special_tokens=True)
    assert text.startswith(GOLDEN), text
    # The story ends when the model emits BOS; generation_config.json's eos_token_id [1, 2] stops there.
    assert len(out) == 347 and out[-1] == 1 and 1 not in out[1:-1]


# ---------------------------------------------------------------- CLI and cache


def test_cli_convert_matches_cached_conversion(tmp_path, stories_model_dir):
    from kvpilot.cli import main

    out = tmp_path / "hf"
    rc = main(["convert", "llama2c", "--checkpoint", str(_source("stories260K.bin")),
               "--tokenizer", str(_source("tok512.bin")), "--output", str(out)])  # fmt: skip
    assert rc == 0
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in stories_model_dir.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]  # fmt: skip
    for name in names:
        assert (out / name).read_bytes() == (stories_model_dir / name).read_bytes(), name
    missing = main(["convert", "llama2c", "--checkpoint", str(tmp_path / "nope.bin"),
                    "--tokenizer", str(_source("tok512.bin")), "--output", str(tmp_path / "x")])  # fmt: skip
    assert missing == 1 and not (tmp_path / "x").exists()


def test_ensure_stories260k_caches_by_content(tmp_path, monkeypatch):
    _source("stories260K.bin")
    first = ensure_stories260k(tmp_path)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert ensure_stories260k(tmp_path) == first and (first / "model.safetensors").stat().st_mtime_ns == mtime
    assert first.parent == tmp_path and first.name.startswith("stories260K-")
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary directory left behind
    monkeypatch.setenv("KVPILOT_STORIES260K_DIR", str(tmp_path / "empty"))
    with pytest.raises(FileNotFoundError, match="KVPILOT_STORIES260K_DIR"):
        ensure_stories260k(tmp_path)


def test_malformed_inputs_raise_value_error(tmp_path):
    data = _source("stories260K.bin").read_bytes()
    truncated = tmp_path / "short.bin"
    truncated.write_bytes(data[:-4])
    with pytest.raises(ValueError, match="implies"):
        read_llama2c_checkpoint(truncated)
    bad_tok = tmp_path / "tok.bin"
    bad_tok.write_bytes(_source("tok512.bin").read_bytes()[:-3])
    with pytest.raises(ValueError, match="token 511"):
        read_llama2c_tokenizer(bad_tok)
    small_tok = tmp_path / "tok_small.bin"
    small_tok.write_bytes(_source("tok512.bin").read_bytes()[:2000])
    with pytest.raises(ValueError):
        convert_llama2c(_source("stories260K.bin"), small_tok, tmp_path / "out")
    assert os.path.exists(tmp_path / "out") is False
