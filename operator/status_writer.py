"""Read-modify-write of an LLMDeployment's ``/status``, one writer at a time.

Three writers share a CR's status: the reconcile, the child-workload watch and the autoscaler.
A JSON merge patch replaces ``conditions`` (a list) whole, so a writer that computed its list
from an older read would erase a condition another writer has just set. Every write therefore
goes through :func:`update_status`: under a per-CR lock it reads the CR fresh, computes the patch
from that read, and sends it only when something differs. When the read carries a
``resourceVersion`` the patch carries it too, so a real API server refuses (409) a patch based
on a stale read; the update is then retried from a new read.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Callable

from . import apply as kube
from .crd import KIND

_locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
_locks_guard = threading.Lock()
ATTEMPTS = 4


def _lock(namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks[(namespace, name)]


def update_status(client: kube.KubeClient, namespace: str, name: str,
                  compute: Callable[[dict[str, Any]], dict[str, Any] | None]) -> dict[str, Any] | None:
    """Patch ``/status`` with ``compute(fresh_cr)`` (keys of ``status``), if it returns anything.

    Returns the patch sent, or None when the CR is gone or nothing differed.

    Raises:
        ApiError: the API server refused the patch (after retrying conflicts).
    """
    with _lock(namespace, name):
        for attempt in range(ATTEMPTS):
            fresh = client.get(KIND, namespace, name)
            if fresh is None:
                return None
            patch = compute(fresh)
            if not patch:
                return None
            body: dict[str, Any] = {"status": patch}
            version = (fresh.get("metadata") or {}).get("resourceVersion")
            if version:
                body["metadata"] = {"resourceVersion": version}
            try:
                client.merge_patch(KIND, namespace, name, body, subresource="status")
                return patch
            except kube.ApiError as exc:
                if exc.status != 409 or attempt == ATTEMPTS - 1:
                    raise
    return None
