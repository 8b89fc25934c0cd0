"""The environment variables kvpilot reads: the only module that reads ``os.environ``.

Operational settings only (where files are, the API key, the CPU KV pool, the distributed
timeout); everything a user tunes per engine is an `LLM` argument / ``kvpilot serve`` flag, and the
performance switches are fields of `kvpilot.tuning.Tuning`, set for benchmarks through
``KVPILOT_TUNING`` (below, read once by `LLM`) or ``LLM(tuning=...)``. The README's table of
variables is `markdown_table`.

Every variable is read when its accessor is called (never at import), so a process may set it
before creating an engine. An empty value counts as unset. A value that does not parse raises
`ValueError` naming the variable.

Variables that other software defines (``TRITON_INTERPRET``, ``KUBECONFIG``, LeaderWorkerSet's
``LWS_*``, ``OMP_NUM_THREADS``) are read through `external` / `external_environ`, and the ones
PyTorch reads at set-up are written through `set_external`, so that this module stays the one
place that touches the process environment.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_bool(name: str, raw: str) -> bool:
    """``raw`` as a boolean: 1/true/yes/on or 0/false/no/off, case-insensitive, spaces ignored.

    Raises:
        ValueError: any other value; the message names the variable ``name``.
    """
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of 1/0, true/false, yes/no, on/off")


def _parse_float(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a number") from None


def _parse_positive_float(name: str, raw: str) -> float:
    value = _parse_float(name, raw)
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected a number > 0")
    return value


@dataclass(frozen=True)
class EnvVar:
    """One registered variable: its ``name``, the type its value parses to (``kind``), the value
    used when it is unset or empty (``default``) and what it means (``doc``)."""

    name: str
    kind: str
    default: Any
    doc: str
    parse: Callable[[str, str], Any]

    def get(self) -> Any:
        """The parsed value, or ``default`` when unset or empty. Raises `ValueError` (named)."""
        raw = os.environ.get(self.name)
        if raw is None or raw.strip() == "":
            return self.default
        return self.parse(self.name, raw)


def _path(_name: str, raw: str) -> Path:
    return Path(raw).expanduser()


def _str(_name: str, raw: str) -> str:
    return raw


REGISTRY: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("KVPILOT_API_KEY", "str", None,
           "Default of `kvpilot serve --api-key`: requests to /v1/* must send 'Authorization: Bearer KEY'.",
           _str),
    EnvVar("KVPILOT_CACHE_DIR", "path", None,
           "Folder for converted checkpoints (the stories260K model); default ~/.cache/kvpilot.", _path),
    EnvVar("KVPILOT_CPU_KVCACHE_GB", "float", 4.0,
           "GiB the CPU backend gives its KV pool (scaled by KvCacheConfig.free_gpu_memory_fraction).",
           _parse_positive_float),
    EnvVar("KVPILOT_STORIES260K_DIR", "path", None,
           "Folder holding llama2.c's stories260K.bin and tok512.bin; default <repo>/../shared/models/stories260K.",
           _path),
    EnvVar("KVPILOT_MODEL", "path", None,
           "Model directory the examples/ scripts load; default stories260K, converted into the cache.", _path),
    EnvVar("KVPILOT_CRD", "path", None,
           "The LLMDeployment CRD YAML the operator validates against; default crds/ next to the package.",
           _path),
    EnvVar("KVPILOT_DIST_TIMEOUT_S", "float", 600.0,
           "Seconds a tensor/pipeline-parallel worker waits for its peers (torch.distributed timeout); a "
           "front-end step times out 60 s later.", _parse_positive_float),
    EnvVar("KVPILOT_TUNING", "json", None,
           "Benchmarks only: a JSON object of kvpilot.tuning.Tuning fields overriding their defaults, e.g. "
           "'{\"fused_gemv\": false}'. Unknown fields and wrong types are errors.", _str),
)}
"""Every ``KVPILOT_*`` variable kvpilot reads, by name."""


def markdown_table() -> str:
    """`REGISTRY` as the Markdown table of the README's "Environment variables" section: one row
    per variable (name, type, default, meaning), in registry order."""
    rows = ["| variable | type | default | meaning |", "|---|---|---|---|"]
    for var in REGISTRY.values():
        default = "unset" if var.default is None else f"`{var.default}`"
        rows.append(f"| `{var.name}` | {var.kind} | {default} | {var.doc} |")
    return "\n".join(rows)


def get(name: str) -> Any:
    """The parsed value of the registered variable ``name``.

    Raises:
        KeyError: ``name`` is not registered.
        ValueError: its value does not parse (the message names it).
    """
    return REGISTRY[name].get()


def api_key() -> Optional[str]:
    return get("KVPILOT_API_KEY")


def cache_dir() -> Path:
    """``KVPILOT_CACHE_DIR``, else ``~/.cache/kvpilot``."""
    return get("KVPILOT_CACHE_DIR") or Path.home() / ".cache" / "kvpilot"


def cpu_kv_cache_bytes() -> int:
    """Bytes of ``KVPILOT_CPU_KVCACHE_GB`` (default 4 GiB)."""
    return int(get("KVPILOT_CPU_KVCACHE_GB") * (1 << 30))


def stories260k_dir() -> Optional[Path]:
    return get("KVPILOT_STORIES260K_DIR")


def examples_model() -> Optional[Path]:
    return get("KVPILOT_MODEL")


def crd_path() -> Optional[Path]:
    return get("KVPILOT_CRD")


def dist_timeout_s() -> float:
    return get("KVPILOT_DIST_TIMEOUT_S")


def tuning_json() -> Optional[str]:
    """The raw ``KVPILOT_TUNING`` text (parsed and validated by `kvpilot.tuning.Tuning.from_json`)."""
    return get("KVPILOT_TUNING")


# ---- variables other software defines ----------------------------------------------------------
EXTERNAL = frozenset({"TRITON_INTERPRET", "KUBECONFIG", "OMP_NUM_THREADS", "LWS_GROUP_SIZE",
                      "LWS_LEADER_ADDRESS", "LWS_WORKER_INDEX", "MASTER_PORT",
                      "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"})
"""Variables of Triton, the Kubernetes client, LeaderWorkerSet, OpenMP and PyTorch that kvpilot
reads or sets with their owners' meaning."""


def external(name: str) -> Optional[str]:
    """The raw value of another tool's variable ``name`` (one of `EXTERNAL`), or None.

    Raises:
        KeyError: ``name`` is not in `EXTERNAL` (kvpilot's own variables go through `REGISTRY`).
    """
    if name not in EXTERNAL:
        raise KeyError(f"{name} is not a registered external variable")
    return os.environ.get(name)


def external_environ() -> Mapping[str, str]:
    """The external variables that are set, as a mapping (LeaderWorkerSet's group description)."""
    return {k: os.environ[k] for k in EXTERNAL if k in os.environ}


def set_external(name: str, value: str, overwrite: bool = True) -> None:
    """Set another tool's variable ``name`` (one of `EXTERNAL`) for this process and its children."""
    if name not in EXTERNAL:
        raise KeyError(f"{name} is not a registered external variable")
    if overwrite or name not in os.environ:
        os.environ[name] = value


def triton_interpret() -> bool:
    """Whether Triton runs kernels in its interpreter (``TRITON_INTERPRET=1``, Triton's own test)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
