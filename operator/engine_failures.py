"""Why engine pods do not start, read from the pods themselves: the ``ModelLoaded`` condition.

Some shapes only fail once the model's config is known, which is inside the pod: the engine
refuses a tensor-parallel size that does not divide the attention heads (or neither divides nor
is a multiple of the KV heads, or does not divide the MLP width) before loading anything, and
exits. The engine container runs with ``terminationMessagePolicy: FallbackToLogsOnError``, so
the kubelet keeps the tail of its log (the error line last) in the container's ``terminated``
state; the download init containers' failures are kept the same way.

:func:`model_loaded_condition` turns one Pod into the condition:

- ``False``, reason ``TensorParallelMismatch``: the engine's layout error, with the model's
  count and the tensor-parallel sizes that would work;
- ``False``, reason ``LoRAAdapterFailed``: an adapter of ``spec.lora.adapters`` that the engine
  could not load at start (a missing directory, a rank above ``maxLoraRank``, an adapter of another
  model), with the adapter's name and the engine's reason;
- ``False``, reason ``DownloadFailed`` / ``EngineFailed``: another non-zero exit of the download
  or the engine, with the last line it wrote;
- ``True``, reason ``Serving``: the pod is Ready;
- ``None``: nothing to say yet (pending, loading).
"""

from __future__ import annotations

import re
from typing import Any

from .render import ENGINE_CONTAINER

CONDITION = "ModelLoaded"
DOWNLOAD_PREFIX = "download-"  # download-model, download-lora-N

#: The engine's layout errors (kvpilot.parallel.executor.validate_layout, kvpilot.model.linear).
LAYOUT_ERROR = re.compile(
    r"tensor_parallel_size (?P<tp>\d+) must divide(?P<or_multiple>, or be a multiple of,)? "
    r"(?P<what>num_attention_heads|num_key_value_heads|intermediate_size) (?P<n>\d+)")

#: The engine's LoRA adapter errors (kvpilot.lora.adapter.load_adapter: "LoRA adapter 'NAME': WHY").
LORA_ERROR = re.compile(r"LoRA adapter '(?P<name>[^']+)': (?P<why>[^\n]+)")

_WHAT = {"num_attention_heads": "attention heads", "num_key_value_heads": "KV heads",
         "intermediate_size": "MLP channels"}
_POWERS_OF_TWO = tuple(2 ** i for i in range(11))  # the CRD's allowed parallelism.tensor values


def valid_tensor_sizes(n: int, or_multiple: bool) -> list[int]:
    """The tensor-parallel sizes the CRD allows (powers of two up to 1024) that split ``n``:
    divisors of ``n``, or with ``or_multiple`` (KV heads, which are replicated) also multiples."""
    return [tp for tp in _POWERS_OF_TWO if n % tp == 0 or (or_multiple and tp % n == 0)]


def layout_message(text: str) -> str | None:
    """A message a user can act on for the engine's layout error in ``text``, or None."""
    found = list(LAYOUT_ERROR.finditer(text))
    if not found:
        return None
    m = found[-1]
    tp, n, what = int(m["tp"]), int(m["n"]), m["what"]
    sizes = valid_tensor_sizes(n, bool(m["or_multiple"]))
    rule = "divide, or be a multiple of," if m["or_multiple"] else "divide"
    return (f"the model has {n} {_WHAT[what]} ({what}), and parallelism.tensor {tp} does not {rule} it, so the "
            f"engine refuses to start; parallelism.tensor values that work: {', '.join(map(str, sizes))}")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


def _failure(status: dict[str, Any]) -> dict[str, Any] | None:
    """The most recent non-zero ``terminated`` state of a container status, if any."""
    for key in ("state", "lastState"):
        term = (status.get(key) or {}).get("terminated") or {}
        if term and int(term.get("exitCode") or 0) != 0:
            return term
    return None


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or ()
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def model_loaded_condition(pod: dict[str, Any]) -> dict[str, str] | None:
    """The ``ModelLoaded`` condition one engine pod supports (see the module doc), or None."""
    status = pod.get("status") or {}
    name = (pod.get("metadata") or {}).get("name", "")
    if _ready(pod):
        return {"type": CONDITION, "status": "True", "reason": "Serving", "message": f"pod {name} is Ready"}
    for key, reason in (("initContainerStatuses", "DownloadFailed"), ("containerStatuses", "EngineFailed")):
        for cs in status.get(key) or ():
            container = cs.get("name") or ""
            if container != ENGINE_CONTAINER and not container.startswith(DOWNLOAD_PREFIX):
                continue  # a user's sidecar or init container
            term = _failure(cs)
            if term is None:
                continue
            text = term.get("message") or ""
            layout = layout_message(text) if container == ENGINE_CONTAINER else None
            if layout:
                return {"type": CONDITION, "status": "False", "reason": "TensorParallelMismatch",
                        "message": f"{layout} (pod {name})"}
            lora = list(LORA_ERROR.finditer(text)) if container == ENGINE_CONTAINER else []
            if lora:
                m = lora[-1]
                return {"type": CONDITION, "status": "False", "reason": "LoRAAdapterFailed",
                        "message": f"LoRA adapter {m['name']} (spec.lora.adapters) failed to load: "
                                   f"{m['why'].strip()[:400]} (pod {name})"}
            line = _last_line(text) or f"exit code {term.get('exitCode')}, reason {term.get('reason') or 'unknown'}"
            return {"type": CONDITION, "status": "False", "reason": reason,
                    "message": f"the {container} container of pod {name} exited: {line}"}
    return None
