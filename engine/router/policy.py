"""How ``kvpilot router`` picks a replica for one request: prefix affinity within a load bound.

Pure (no I/O, no clock): the router passes the prompt's chained block hashes
(:func:`kvpilot.router.prefix.block_hashes`, the engine's own hash), the replicas with their
loads, and the :class:`PrefixIndex` of where earlier prompts went.

The rule:

1. Only healthy replicas (scraped recently, not failing) are candidates.
2. **Prefix affinity.** The index remembers, for every block hash it routed, the replicas it sent
   that prefix to. The candidates are the replicas holding the *deepest* matching block (the
   longest prefix their engine's cache most likely still holds), the one it went to last first.
3. **Bounded imbalance.** That replica is taken only while its load is at most
   ``least_load * (1 + imbalance) + slack`` (``least_load``: the least-loaded healthy replica's);
   otherwise the next replica holding that prefix within the bound, or else the least-loaded
   replica, which then also holds the prefix and is tried first from then on: a prefix whose
   replica is overloaded moves, and a hot prefix spreads over as many replicas as its load
   needs and no further.
4. Without a match: the least-loaded replica; ties are broken by rendezvous hashing of the first
   block, so one new prefix goes to one replica even when all are idle.

Load is ``max(requests this router has in flight there, running + waiting that the engine last
reported)``: immediate for this router's own requests, and still right when other clients share
the engine.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

REASON_PREFIX = "prefix"
REASON_OVERLOADED = "prefix-overloaded"
REASON_LEAST_LOAD = "least-load"


class NoReplicaError(RuntimeError):
    """No healthy replica to send a request to."""


@dataclass
class Replica:
    """One engine endpoint as the router sees it.

    Attributes:
        name: a stable name (pod name, or the URL).
        url: base URL of the engine's HTTP API, e.g. ``http://10.0.0.5:8000``.
        in_flight: requests this router has sent there and not finished (count).
        running, waiting: the engine's ``num_requests_running`` / ``num_requests_waiting`` from
            its last ``/metrics`` (counts).
        kv_usage: its KV-cache utilisation, 0..1, or None before the first scrape.
        prefix_hits, prefix_queries: its cumulative prefix-cache counters (tokens).
        failures: scrapes failed in a row; a replica with failures >= the router's limit is out
            of rotation.
        healthy: in rotation.
    """

    name: str
    url: str
    in_flight: int = 0
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float | None = None
    prefix_hits: float = 0.0
    prefix_queries: float = 0.0
    failures: int = 0
    healthy: bool = True

    @property
    def load(self) -> float:
        """Requests on the replica: ``max(in_flight, running + waiting)``."""
        return max(float(self.in_flight), self.running + self.waiting)


@dataclass
class PrefixIndex:
    """Block hash -> the replicas a prompt with that prefix went to (most recent last).

    Bounded: at most ``capacity`` hashes (least recently used dropped first) and
    ``max_replicas_per_block`` replicas per hash.
    """

    capacity: int = 200_000
    max_replicas_per_block: int = 4
    _entries: OrderedDict[bytes, list[str]] = field(default_factory=OrderedDict)

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, hashes: Sequence[bytes], allowed: Iterable[str]) -> tuple[list[str], int]:
        """(replicas holding the deepest matching block among ``allowed``, matched blocks)."""
        allowed = set(allowed)
        for depth in range(len(hashes), 0, -1):
            names = [n for n in self._entries.get(hashes[depth - 1], ()) if n in allowed]
            if names:
                return names, depth
        return [], 0

    def record(self, hashes: Sequence[bytes], replica: str) -> None:
        """Remember that ``replica`` now holds every block of ``hashes``."""
        for h in hashes:
            names = self._entries.pop(h, [])
            if replica in names:
                names.remove(replica)
            names.append(replica)
            self._entries[h] = names[-self.max_replicas_per_block:]
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def forget(self, replica: str) -> None:
        """Drop ``replica`` everywhere (it left the deployment)."""
        for h in list(self._entries):
            names = [n for n in self._entries[h] if n != replica]
            if names:
                self._entries[h] = names
            else:
                del self._entries[h]


@dataclass(frozen=True)
class Decision:
    """The chosen replica and why.

    Attributes:
        replica: the chosen replica's name.
        reason: ``prefix`` (affinity), ``prefix-overloaded`` (the affine replica was over the
            bound; the least-loaded one was taken) or ``least-load`` (no prefix match).
        matched_blocks: leading blocks of the prompt the chosen replica is predicted to hold.
        prompt_blocks: full blocks of the prompt that were hashed.
        affine: the replica prefix affinity wanted (None without a match).
        loads: every healthy replica's load at decision time.
        bound: the load bound the affine replica had to meet.
    """

    replica: str
    reason: str
    matched_blocks: int
    prompt_blocks: int
    affine: str | None
    loads: dict[str, float]
    bound: float

    def header(self) -> str:
        """The ``x-kvpilot-route`` response header: ``replica=...; reason=...; matched=3/5; ...``."""
        load = self.loads.get(self.replica, 0.0)
        parts = [f"replica={self.replica}", f"reason={self.reason}",
                 f"matched-blocks={self.matched_blocks}/{self.prompt_blocks}", f"load={load:g}",
                 f"bound={self.bound:g}"]
        if self.affine and self.affine != self.replica:
            parts.append(f"affine={self.affine}")
        return "; ".join(parts)


def _rendezvous(key: bytes, name: str) -> bytes:
    return hashlib.blake2b(key + name.encode(), digest_size=8).digest()


def pick(replicas: Sequence[Replica], hashes: Sequence[bytes], index: PrefixIndex,
         imbalance: float = 0.5, slack: float = 8.0) -> Decision:
    """Choose a replica for a prompt with block hashes ``hashes`` (see the module doc).

    Args:
        imbalance: relative load bound over the least-loaded replica (0.5: 50% more).
        slack: absolute requests allowed on top of that bound, so that lightly loaded replicas
            keep affinity (an engine batches many requests: a few more in its batch cost less
            than recomputing a long prefix elsewhere).

    Raises:
        NoReplicaError: no replica is healthy.
        ValueError: ``imbalance`` or ``slack`` is negative.
    """
    if imbalance < 0 or slack < 0:
        raise ValueError(f"imbalance and slack must be >= 0, got {imbalance}, {slack}")
    healthy = [r for r in replicas if r.healthy]
    if not healthy:
        raise NoReplicaError(f"none of {len(replicas)} replicas is healthy")
    by_name = {r.name: r for r in healthy}
    loads = {r.name: r.load for r in healthy}
    first = hashes[0] if hashes else b""
    least = min(healthy, key=lambda r: (r.load, _rendezvous(first, r.name)))
    bound = least.load * (1.0 + imbalance) + slack
    names, matched = index.lookup(hashes, by_name)
    if names:
        for name in reversed(names):  # the replica the prefix went to last first: it stays put
            if by_name[name].load <= bound:
                return Decision(name, REASON_PREFIX, matched, len(hashes), name, loads, bound)
        return Decision(least.name, REASON_OVERLOADED, 0, len(hashes), names[-1], loads, bound)
    return Decision(least.name, REASON_LEAST_LOAD, 0, len(hashes), None, loads, bound)
