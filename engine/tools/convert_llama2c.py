"""Convert a llama2.c checkpoint and tokenizer into a Hugging Face Llama checkpoint directory.

llama2.c (github.com/karpathy/llama2.c) stores a model as one flat little-endian file: a header of
seven int32 (dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len; a negative
vocab_size means the classifier is NOT shared with the token embedding) followed by float32 tensors
in a fixed order, and its tokenizer as: int32 max_token_length, then per token a float32 merge
score, an int32 byte length and the bytes. The layout is described in
``shared/models/stories260K/SOURCE.md``.

The output directory holds ``config.json`` (LlamaForCausalLM), ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``, so that
``transformers`` and the kvpilot engine load it like any Hub Llama.

Two conventions differ between the formats and are translated here:

* RoPE: llama2.c rotates interleaved pairs (dims 2i, 2i+1); Hugging Face's Llama rotates the two
  halves of each head (dims i, i + head_dim/2). The q/k projection rows are permuted per head
  exactly as ``permute`` in transformers' ``convert_llama_weights_to_hf.py`` does.
* Tokenizer: llama2.c merges, at each step, the adjacent pair whose concatenation is the vocab
  piece with the highest score (ties: leftmost). A ``tokenizers`` BPE model needs an ordered merge
  list instead; every split of a piece into two vocab pieces becomes a merge ranked by the merged
  piece's score, which makes the two algorithms choose the same pair at every step (the test
  suite checks this against a reimplementation of llama2.c's ``encode()``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kvpilot import envs

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<7i")
# llama2.c's newer export formats (version >= 1) start with this magic ("ak42"); only the legacy
# version-0 layout (header + float32 tensors) is supported.
_LLAMA2C_V1_MAGIC = 0x616B3432
_N_SPECIAL = 3  # <unk>, <s>, </s>
_N_BYTE_TOKENS = 256  # <0x00>..<0xFF>, ids 3..258 (SentencePiece byte fallback)
_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
_STORIES_FILES = ("stories260K.bin", "tok512.bin")
# llama2.c's documented greedy continuation of stories260K from BOS (../shared/models/stories260K/SOURCE.md):
# what a correct engine generates from the converted model (the tests' and GPU benchmark's golden text).
STORIES260K_GREEDY = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
                      "One day, she saw a big, red ball. She wanted to play with it, but it was too high.")


@dataclass(frozen=True)
class Llama2cConfig:
    """The seven header fields of a llama2.c checkpoint.

    Attributes:
        dim: model width (hidden size).
        hidden_dim: SwiGLU MLP width (intermediate size).
        n_layers: number of transformer blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads (grouped-query attention when < n_heads).
        vocab_size: number of tokens (always positive here).
        seq_len: maximum context length in tokens.
        shared_classifier: True when the output projection is the token-embedding matrix (the
            header's vocab_size was positive).
    """

    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    seq_len: int
    shared_classifier: bool

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def read_llama2c_checkpoint(path: Path) -> tuple[Llama2cConfig, dict[str, torch.Tensor]]:
    """Read a legacy (version 0) llama2.c checkpoint.

    Args:
        path: the ``.bin`` file.

    Returns:
        ``(config, weights)``; ``weights`` maps llama2.c names to float32 tensors in
        ``[out_features, in_features]`` layout, per layer stacked on dim 0:
        ``token_embedding [vocab, dim]``, ``rms_att [L, dim]``, ``wq [L, dim, dim]``,
        ``wk [L, kv_dim, dim]``, ``wv [L, kv_dim, dim]``, ``wo [L, dim, dim]``,
        ``rms_ffn [L, dim]``, ``w1 [L, hidden, dim]``, ``w2 [L, dim, hidden]``,
        ``w3 [L, hidden, dim]``, ``rms_final [dim]`` and, for unshared classifiers,
        ``wcls [vocab, dim]``. The legacy RoPE cos/sin tables are skipped.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the header is invalid or the file size does not match it.
    """
    data = Path(path).read_bytes()
    if len(data) < _HEADER.size:
        raise ValueError(f"{path}: {len(data)} bytes is too short for a llama2.c header ({_HEADER.size} bytes)")
    if struct.unpack_from("<I", data)[0] == _LLAMA2C_V1_MAGIC:
        raise ValueError(f"{path}: llama2.c export format version >= 1 is not supported; export with --version 0")
    dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len = _HEADER.unpack_from(data)
    cfg = Llama2cConfig(dim, hidden_dim, n_layers, n_heads, n_kv_heads, abs(vocab_size), seq_len, vocab_size > 0)
    if min(dim, hidden_dim, n_layers, n_heads, n_kv_heads, cfg.vocab_size, seq_len) <= 0:
        raise ValueError(f"{path}: header fields must be positive, got {cfg}")
    if dim % n_heads or n_heads % n_kv_heads or cfg.head_dim % 2:
        raise ValueError(
            f"{path}: need dim % n_heads == 0, n_heads % n_kv_heads == 0 and an even head_dim, got {cfg}"
        )
    L, d, h, kv, v = n_layers, dim, hidden_dim, cfg.kv_dim, cfg.vocab_size
    rope_table = seq_len * cfg.head_dim // 2
    layout: list[tuple[str, tuple[int, ...]]] = [
        ("token_embedding", (v, d)),
        ("rms_att", (L, d)),
        ("wq", (L, d, d)),
        ("wk", (L, kv, d)),
        ("wv", (L, kv, d)),
        ("wo", (L, d, d)),
        ("rms_ffn", (L, d)),
        ("w1", (L, h, d)),
        ("w2", (L, d, h)),
        ("w3", (L, h, d)),
        ("rms_final", (d,)),
        ("_freq_cis_real", (rope_table,)),
        ("_freq_cis_imag", (rope_table,)),
    ]
    if not cfg.shared_classifier:
        layout.append(("wcls", (v, d)))
    n_floats = sum(int(np.prod(shape)) for _, shape in layout)
    expected = _HEADER.size + 4 * n_floats
    if len(data) != expected:
        raise ValueError(f"{path}: file has {len(data)} bytes but header {cfg} implies {expected}")
    flat = np.frombuffer(data, dtype="<f4", offset=_HEADER.size)
    weights: dict[str, torch.Tensor] = {}
    offset = 0
    for name, shape in layout:
        n = int(np.prod(shape))
        if not name.startswith("_"):
            weights[name] = torch.from_numpy(flat[offset : offset + n].astype(np.float32).reshape(shape))
        offset += n
    return cfg, weights


def read_llama2c_tokenizer(path: Path) -> list[tuple[bytes, float]]:
    """Read a llama2.c ``tokenizer.bin``.

    Returns:
        ``[(piece_bytes, score), ...]`` indexed by token id. Pieces use a plain space (not
        SentencePiece's "▁"), ids 0..2 are <unk>/BOS/EOS and ids 3..258 the byte tokens.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is truncated or its special/byte tokens are not where llama2.c puts them.
    """
    data = Path(path).read_bytes()
    if len(data) < 4:
        raise ValueError(f"{path}: too short for a llama2.c tokenizer")
    pieces: list[tuple[bytes, float]] = []
    offset = 4
    while offset < len(data):
        if offset + 8 > len(data):
            raise ValueError(f"{path}: truncated record header at byte {offset}")
        score, length = struct.unpack_from("<fi", data, offset)
        offset += 8
        if length < 0 or offset + length > len(data):
            raise ValueError(f"{path}: token {len(pieces)} has invalid length {length}")
        pieces.append((data[offset : offset + length], score))
        offset += length
    byte_names = [p for p, _ in pieces[_N_SPECIAL : _N_SPECIAL + _N_BYTE_TOKENS]]
    if byte_names != [f"<0x{i:02X}>".encode() for i in range(_N_BYTE_TOKENS)]:
        raise ValueError(f"{path}: ids 3..258 must be the byte tokens <0x00>..<0xFF> (SentencePiece byte fallback)")
    return pieces


def _bpe_vocab_and_merges(pieces: list[tuple[bytes, float]]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Vocab (piece -> id) and score-ranked merges for a ``tokenizers`` BPE model."""
    vocab: dict[str, int] = {}
    for i, (raw, _) in enumerate(pieces):
        if i < _N_SPECIAL:
            # llama2.c names BOS/EOS "\n<s>\n"/"\n</s>\n" (for its own decode); use the standard names.
            piece = _SPECIAL_TOKENS[i]
        else:
            try:
                piece = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"token {i} ({raw!r}) is not valid UTF-8; cannot express it as a BPE piece") from e
        if piece in vocab:
            raise ValueError(f"duplicate piece {piece!r} at ids {vocab[piece]} and {i}")
        vocab[piece] = i
    first_normal = _N_SPECIAL + _N_BYTE_TOKENS
    normal = {p: i for p, i in vocab.items() if i >= first_normal}
    ranked: list[tuple[float, int, int, str, str]] = []
    for piece, i in normal.items():
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in normal and right in normal:
                ranked.append((-pieces[i][1], i, k, left, right))
    # Distinct merged pieces with equal scores cannot be tied in a ranked merge list; llama2.c would
    # break such ties by position, the BPE model by rank. Warn rather than fail: it is rare.
    scores = [pieces[i][1] for i in {r[1] for r in ranked}]
    if len(set(scores)) != len(scores):
        logger.warning("several merged pieces share a score; encodings may differ from llama2.c on ties")
    ranked.sort()
    return vocab, [(left, right) for _, _, _, left, right in ranked]


def build_tokenizer(pieces: list[tuple[bytes, float]]):
    """Build a ``tokenizers.Tokenizer`` that encodes exactly like llama2.c's ``encode(bos=1, eos=0)``.

    Pipeline: normalizer ``Prepend(" ")`` (llama2.c's dummy prefix, skipped for empty text), no
    pre-tokenizer (llama2.c merges across spaces), BPE with byte fallback over the pieces with
    their literal spaces, and a post-processor adding BOS. Special-token strings in the input are
    split like any text (``encode_special_tokens``), as llama2.c has no notion of them. The decoder
    (byte fallback, fuse, strip one leading space) inverts encoding: for every string ``s``,
    ``decode(encode(s).ids, skip_special_tokens=True) == s``.

    Args:
        pieces: ``read_llama2c_tokenizer`` output.

    Returns:
        A ``tokenizers.Tokenizer``.

    Raises:
        ValueError: a piece is not valid UTF-8 or appears twice.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    vocab, merges = _bpe_vocab_and_merges(pieces)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Prepend(" ")
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in _SPECIAL_TOKENS])
    tok.encode_special_tokens = True
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return tok


def _permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Reorder a q/k projection's output rows from interleaved RoPE pairs to half-split.

    ``w`` is ``[n_heads * head_dim, in]``; within each head, row ``2i`` moves to ``i`` and row
    ``2i+1`` to ``i + head_dim/2`` (transformers' ``convert_llama_weights_to_hf.permute``).
    """
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def hf_state_dict(cfg: Llama2cConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map llama2.c tensors to Hugging Face ``LlamaForCausalLM`` names (float32, contiguous).

    ``lm_head.weight`` is omitted when the classifier is shared (``tie_word_embeddings``).
    """
    sd = {"model.embed_tokens.weight": weights["token_embedding"], "model.norm.weight": weights["rms_final"]}
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        sd[p + "input_layernorm.weight"] = weights["rms_att"][i]
        sd[p + "self_attn.q_proj.weight"] = _permute_rope_rows(weights["wq"][i], cfg.n_heads)
        sd[p + "self_attn.k_proj.weight"] = _permute_rope_rows(weights["wk"][i], cfg.n_kv_heads)
        sd[p + "self_attn.v_proj.weight"] = weights["wv"][i]
        sd[p + "self_attn.o_proj.weight"] = weights["wo"][i]
        sd[p + "post_attention_layernorm.weight"] = weights["rms_ffn"][i]
        sd[p + "mlp.gate_proj.weight"] = weights["w1"][i]
        sd[p + "mlp.down_proj.weight"] = weights["w2"][i]
        sd[p + "mlp.up_proj.weight"] = weights["w3"][i]
    if not cfg.shared_classifier:
        sd["lm_head.weight"] = weights["wcls"]
    return {k: v.contiguous().clone() for k, v in sd.items()}


def hf_config(cfg: Llama2cConfig) -> dict:
    """``config.json`` contents. RoPE theta 10000 and RMSNorm eps 1e-5 are llama2.c's fixed values."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg.dim,
        "intermediate_size": cfg.hidden_dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.seq_len,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": cfg.shared_classifier,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _tokenizer_config(model_max_length: int) -> dict:
    # tokenizer_class: the generic fast class loads tokenizer.json verbatim. Naming LlamaTokenizer(Fast)
    # would make transformers v5 rebuild the pipeline with its own Metaspace pre-tokenizer, which
    # drops llama2.c's dummy prefix for text that already starts with a space.
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "model_input_names": ["input_ids", "attention_mask"],
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_llama2c(checkpoint: Path, tokenizer: Path, output: Path) -> Path:
    """Write a Hugging Face Llama checkpoint directory from llama2.c files.

    Args:
        checkpoint: llama2.c model ``.bin`` (legacy version-0 format).
        tokenizer: llama2.c ``tokenizer.bin``.
        output: directory to create or fill; existing files of the same names are overwritten.

    Returns:
        ``output``.

    Raises:
        FileNotFoundError: an input file is missing.
        ValueError: an input file is malformed, or the tokenizer's size differs from the model's vocab.
    """
    from safetensors.torch import save_file

    checkpoint, tokenizer, output = Path(checkpoint), Path(tokenizer), Path(output)
    for f in (checkpoint, tokenizer):
        if not f.is_file():
            raise FileNotFoundError(f"llama2.c input file not found: {f}")
    cfg, weights = read_llama2c_checkpoint(checkpoint)
    pieces = read_llama2c_tokenizer(tokenizer)
    if len(pieces) != cfg.vocab_size:
        raise ValueError(f"{tokenizer} has {len(pieces)} tokens but {checkpoint} has vocab_size {cfg.vocab_size}")
    output.mkdir(parents=True, exist_ok=True)
    save_file(hf_state_dict(cfg, weights), str(output / "model.safetensors"), metadata={"format": "pt"})
    _write_json(output / "config.json", hf_config(cfg))
    build_tokenizer(pieces).save(str(output / "tokenizer.json"))
    _write_json(output / "tokenizer_config.json", _tokenizer_config(cfg.seq_len))
    # The model ends a story by emitting BOS, which llama2.c's generate loop treats as the stop token.
    _write_json(output / "generation_config.json", {"bos_token_id": 1, "eos_token_id": [1, 2]})
    logger.info("converted %s + %s -> %s (%s)", checkpoint, tokenizer, output, cfg)
    return output


def stories260k_source_dir() -> Path:
    """Folder holding llama2.c's stories260K files: ``$KVPILOT_STORIES260K_DIR`` if set, else
    ``<repo>/../shared/models/stories260K`` (<repo> found from this file's real location)."""
    env = envs.stories260k_dir()
    if env is not None:
        return env
    repo = Path(__file__).resolve().parents[2]  # this file is <repo>/engine/tools/convert_llama2c.py
    return repo.parent / "shared" / "models" / "stories260K"


def ensure_stories260k(cache_dir: Path | None = None) -> Path:
    """Return a converted Hugging Face directory of the stories260K model, converting it once.

    The source is ``$KVPILOT_STORIES260K_DIR`` (default ``<repo>/../shared/models/stories260K``)
    holding ``stories260K.bin`` and ``tok512.bin``. The result lives in ``cache_dir`` (default
    ``$KVPILOT_CACHE_DIR`` or ``~/.cache/kvpilot``) under a name keyed by a hash of the source files
    and of this converter, and is written to a temporary directory then renamed, so concurrent
    processes never see a partial copy.

    Raises:
        FileNotFoundError: the source directory or one of its files is missing.
    """
    src = stories260k_source_dir()
    missing = [name for name in _STORIES_FILES if not (src / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"stories260K source files {missing} not found in {src}; set KVPILOT_STORIES260K_DIR to the folder "
            f"holding {' and '.join(_STORIES_FILES)} (llama2.c's stories260K model and tok512 tokenizer)"
        )
    digest = hashlib.sha256()
    for f in (src / _STORIES_FILES[0], src / _STORIES_FILES[1], Path(__file__).resolve()):
        digest.update(f.read_bytes())
    root = Path(cache_dir or envs.cache_dir())
    target = root / f"stories260K-{digest.hexdigest()[:16]}"
    if target.is_dir():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".stories260K-", dir=root))
    try:
        convert_llama2c(src / _STORIES_FILES[0], src / _STORIES_FILES[1], tmp)
        tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache may be shared
        os.rename(tmp, target)
    except OSError:
        if not target.is_dir():  # not a lost race with another process: a real failure
            raise
        logger.debug("another process converted stories260K first; using %s", target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``kvpilot convert llama2c`` flags."""
    parser.add_argument("--checkpoint", type=Path, required=True, help="llama2.c model .bin (version 0 export)")
    parser.add_argument("--tokenizer", type=Path, required=True, help="llama2.c tokenizer .bin")
    parser.add_argument("--output", type=Path, required=True, help="Hugging Face checkpoint directory to write")


def run(args: argparse.Namespace) -> int:
    """Run the conversion; returns the process exit status (0 on success, 1 on bad input)."""
    try:
        out = convert_llama2c(args.checkpoint, args.tokenizer, args.output)
    except (FileNotFoundError, ValueError) as e:
        logger.error("%s", e)
        return 1
    logger.info("wrote %s", out)
    return 0
