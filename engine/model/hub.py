"""Where a model's files come from: a local directory, or a Hugging Face Hub id fetched into the
Hub cache through `huggingface_hub`.

`resolve_model(model, revision)` returns a local directory holding ``config.json``, the
safetensors weights and the tokenizer files:

- an existing directory is used as it is (a ``revision`` is then an error: it names a Hub commit);
- anything else is a Hub repo id (``org/name``), downloaded with ``snapshot_download`` at
  ``revision`` (branch, tag or commit; default ``main``), restricted to `ALLOW_PATTERNS`: weights as
  safetensors, configs, tokenizer and chat-template files. Pickled weights (``*.bin``, ``*.pt``,
  ``*.pth``) are never fetched, and kvpilot never loads them.

`huggingface_hub` owns its settings: the cache (``HF_HUB_CACHE`` / ``HF_HOME``), the token
(``HF_TOKEN`` or ``huggingface-cli login``), offline mode (``HF_HUB_OFFLINE=1``: only what the
cache holds) and the download progress bars. Errors name the repo and revision: an unknown repo,
a revision the Hub (or, offline, the cache) lacks, a gated repo without a token, a snapshot without
``config.json`` or without safetensors weights.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Optional

logger = logging.getLogger(__name__)

#: the files a snapshot download fetches (fnmatch patterns, as huggingface_hub takes them)
ALLOW_PATTERNS = [
    "*.safetensors", "*.safetensors.index.json",
    "config.json", "generation_config.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "*.tiktoken", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "spiece.model",
    "chat_template.jinja", "chat_template.json",
]

_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")


class ModelNotFoundError(FileNotFoundError):
    """The model is neither a local checkpoint directory nor a Hub repo (at that revision) that
    could be fetched."""


def resolve_model(model: str, revision: Optional[str] = None, cache_dir: Optional[str] = None) -> Path:
    """A local checkpoint directory for ``model`` (module docstring).

    Args:
        model: a directory, or a Hub repo id such as ``Qwen/Qwen2.5-0.5B-Instruct``.
        revision: Hub branch, tag or commit hash (None: ``main``). Only for Hub ids.
        cache_dir: a Hub cache directory other than huggingface_hub's default.

    Raises:
        ValueError: a ``revision`` given with a local directory.
        ModelNotFoundError: not a directory and not a valid, reachable repo id / revision, or the
            snapshot lacks ``config.json`` or safetensors weights.
        PermissionError: a gated or private repo the token (``HF_TOKEN``) cannot read.
    """
    path = Path(model).expanduser()
    if path.is_dir():
        if revision:
            raise ValueError(f"revision={revision!r} applies to Hugging Face Hub ids, but {model!r} is a local "
                             f"directory; drop the revision or pass the Hub id")
        return path
    if not _REPO_ID.match(model) or model.count("/") > 1:
        raise ModelNotFoundError(f"model {model!r} is neither a local directory nor a Hugging Face Hub repo id "
                                 f"(org/name)")
    local = _download(model, revision, cache_dir)
    check_checkpoint_dir(local, f"{model}@{revision or 'main'}")
    return local


def _download(repo_id: str, revision: Optional[str], cache_dir: Optional[str]) -> Path:
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    where = f"{repo_id} (revision {revision or 'main'})"
    offline = constants.is_offline_mode()
    logger.info("fetching %s from the Hugging Face Hub%s", where, " cache (offline)" if offline else "")
    try:
        return Path(snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                      allow_patterns=ALLOW_PATTERNS, local_files_only=offline))
    except GatedRepoError as exc:
        raise PermissionError(f"{where} is gated: accept its license on huggingface.co and set HF_TOKEN "
                              f"({exc})") from None
    except RevisionNotFoundError:
        raise ModelNotFoundError(f"{where}: the revision does not exist on the Hub") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"{repo_id}: no such model on the Hugging Face Hub (or it is private: set "
                                 f"HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        state = "HF_HUB_OFFLINE is set" if offline else "the Hub could not be reached"
        raise ModelNotFoundError(f"{where} is not in the Hugging Face Hub cache and {state}; download it "
                                 f"first (kvpilot serve {repo_id} with network access) or pass a local "
                                 f"directory") from None


def check_checkpoint_dir(path: Path, name: str) -> None:
    """Raise `ModelNotFoundError` unless ``path`` holds ``config.json`` and safetensors weights."""
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{name}: the snapshot at {path} has no config.json")
    if not any(path.glob("*.safetensors")):
        raise ModelNotFoundError(f"{name}: the snapshot at {path} has no *.safetensors weights (kvpilot loads "
                                 f"safetensors only; pickled .bin/.pt weights are never downloaded)")
