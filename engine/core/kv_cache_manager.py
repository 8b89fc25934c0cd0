"""Paged KV-cache bookkeeping: a pool of fixed-size blocks, per-sequence block tables, prefix reuse.

The pool holds ``num_blocks`` blocks of ``tokens_per_block`` token slots each; a token at position
``p`` of a sequence lives in slot ``block_table[p // B] * B + p % B``. Blocks are reference-counted.

Block reuse (TensorRT-LLM's ``enable_block_reuse``, vLLM's automatic prefix caching): every *full*
block is identified by a hash chained over its tokens and its parent block's hash, so equal hashes
mean equal prefixes. A freed block keeps its hash and sits in an LRU free queue; a new sequence whose
prompt begins with cached blocks takes them back instead of recomputing them. A hit is confirmed by
comparing the block's tokens, so a hash collision can never return wrong KV. Free blocks are
evicted oldest-first when new blocks are needed.

A request with a LoRA adapter hashes its blocks with the adapter's key as extra bytes
(`kvpilot.lora.adapter.LoRAAdapter.cache_key`): the same tokens under two adapters (or an adapter
and the base model) have different K/V, so they never share a block.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

from kvpilot.core.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: Optional[bytes] = None
    token_ids: tuple[int, ...] = ()


_NO_PARENT = b"\0" * 16


@functools.lru_cache(maxsize=None)
def _packer(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}q")


def hash_block(parent: Optional[bytes], token_ids: tuple[int, ...], extra: bytes = b"") -> bytes:
    """Chained block hash: blake2b(parent hash, token ids as little-endian int64, extra keys such as a
    LoRA adapter id); 16 bytes."""
    h = hashlib.blake2b(parent or _NO_PARENT, digest_size=16)
    h.update(_packer(len(token_ids)).pack(*token_ids))
    if extra:
        h.update(extra)
    return h.digest()


def _extra_key(seq: Sequence) -> bytes:
    """The extra hash bytes of ``seq``'s blocks: its request's LoRA adapter key, or none."""
    lora = seq.request.lora
    return b"" if lora is None else lora.cache_key


@dataclass
class PrefixCacheStats:
    """Cumulative counters: tokens queried/hit at admission, and blocks reused/missed."""

    queries: int = 0
    hits: int = 0
    reused_blocks: int = 0
    missed_blocks: int = 0
    alloc_new_blocks: int = 0


class KVCacheManager:
    """Allocates blocks to sequences and tracks which full blocks can be reused.

    Args:
        num_blocks: blocks in the pool.
        tokens_per_block: token slots per block (B).
        enable_block_reuse: keep full blocks' hashes and reuse matching prompt prefixes.
    """

    def __init__(self, num_blocks: int, tokens_per_block: int, enable_block_reuse: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = tokens_per_block
        self.enable_block_reuse = enable_block_reuse
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in eviction order (oldest first); cached ones keep their hash until evicted.
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[bytes, int] = {}
        self.stats = PrefixCacheStats()

    # ---- queries ---------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by live sequences (0..1)."""
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hashes(self, seq: Sequence, num_full_blocks: int) -> list[bytes]:
        hashes, parent = [], None
        B = self.block_size
        extra = _extra_key(seq)
        for i in range(num_full_blocks):
            parent = hash_block(parent, tuple(seq.token_ids[i * B:(i + 1) * B]), extra)
            hashes.append(parent)
        return hashes

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of ``seq``'s tokens (at most ``num_tokens - 1`` tokens, so
        that at least one token is computed and yields logits)."""
        if (not self.enable_block_reuse or seq.params.prompt_logprobs is not None
                or seq.params.return_context_logits):
            return []  # prompt log-probabilities and context logits need every prompt position's logits
        B = self.block_size
        hits = []
        for i, h in enumerate(self._block_hashes(seq, (seq.num_tokens - 1) // B)):
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != tuple(seq.token_ids[i * B:(i + 1) * B]):
                break
            hits.append(bid)
        return hits

    def common_full_blocks(self, a: list[int], b: list[int]) -> int:
        """How many leading full blocks two token lists have in common: the largest ``k`` with
        ``a[:k*B] == b[:k*B]``, at most ``(min(len(a), len(b)) - 1) // B`` (as `match_prefix`, so that
        each sequence keeps at least one token of its own to compute)."""
        B = self.block_size
        lo, hi = 0, (min(len(a), len(b)) - 1) // B
        while lo < hi:  # binary search; a[:lo*B] == b[:lo*B] is known, so only the rest is compared
            mid = (lo + hi + 1) // 2
            if a[lo * B:mid * B] == b[lo * B:mid * B]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def can_allocate(self, seq: Sequence, num_new_tokens: int, cached: list[int] = ()) -> bool:
        """Whether ``seq`` can grow to ``num_computed_tokens (+ cached) + num_new_tokens`` tokens."""
        computed = max(seq.num_computed_tokens, len(cached) * self.block_size)
        need = self.blocks_needed(computed + num_new_tokens) - max(len(seq.block_table), len(cached))
        # Cached blocks sitting in the free queue stop being free once taken.
        taken_from_free = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        return need + taken_from_free <= len(self.free_blocks)

    # ---- changes ---------------------------------------------------------------------------
    def ref_blocks(self, block_ids: list[int]) -> None:
        """Take one more reference to each block (a free one, cached, leaves the free queue)."""
        blocks, free = self.blocks, self.free_blocks
        for bid in block_ids:
            block = blocks[bid]
            if block.ref_count == 0:
                del free[bid]
            block.ref_count += 1

    def admit(self, seq: Sequence, cached: list[int]) -> None:
        """Give a new (or preempted) sequence its cached prefix blocks; counts hits in tokens."""
        assert not seq.block_table
        B = self.block_size
        self.ref_blocks(cached)
        seq.block_table.extend(cached)
        seq.num_computed_tokens = len(cached) * B
        seq.num_cached_blocks = len(cached)
        if self.enable_block_reuse:
            self.stats.queries += seq.num_tokens
            self.stats.hits += len(cached) * B
            self.stats.reused_blocks += len(cached)
            self.stats.missed_blocks += self.blocks_needed(seq.num_tokens) - len(cached)

    def share_prefix(self, seq: Sequence, source: Sequence, num_blocks: int) -> None:
        """Extend ``seq``'s table to ``source``'s first ``num_blocks`` blocks, by reference.

        For the sequences of one request admitted together (a preempted beam request): ``seq``
        holds only a prefix of those blocks (its cached ones, or none), and both sequences' first
        ``num_blocks`` full blocks hold the same tokens (`common_full_blocks`). ``seq``'s computed
        tokens are left as they are: the caller decides who computes the shared blocks.
        """
        have = len(seq.block_table)
        assert seq.block_table == source.block_table[:have], "seq's blocks are not a prefix of source's"
        shared = source.block_table[have:num_blocks]
        self.ref_blocks(shared)
        seq.block_table.extend(shared)

    def allocate(self, seq: Sequence, num_new_tokens: int) -> None:
        """Append blocks so that ``seq`` has slots for ``num_computed_tokens + num_new_tokens``."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            bid, _ = self.free_blocks.popitem(last=False)
            block = self.blocks[bid]
            if block.block_hash is not None:  # evict the cached content
                if self.hash_to_block.get(block.block_hash) == bid:
                    del self.hash_to_block[block.block_hash]
                block.block_hash, block.token_ids = None, ()
            block.ref_count = 1
            seq.block_table.append(bid)
            self.stats.alloc_new_blocks += 1

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full (all tokens computed) so later requests can reuse them."""
        if not self.enable_block_reuse:
            return
        B = self.block_size
        num_full = seq.num_computed_tokens // B
        if num_full <= seq.num_cached_blocks:
            return
        parent = self.blocks[seq.block_table[seq.num_cached_blocks - 1]].block_hash if seq.num_cached_blocks else None
        extra = _extra_key(seq)
        for i in range(seq.num_cached_blocks, num_full):
            tokens = tuple(seq.token_ids[i * B:(i + 1) * B])
            h = hash_block(parent, tokens, extra)
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is None:
                block.block_hash, block.token_ids = h, tokens
                self.hash_to_block.setdefault(h, block.block_id)
            parent = h
        seq.num_cached_blocks = num_full

    def trim(self, seq: Sequence, num_tokens: int) -> None:
        """Release ``seq``'s blocks past the first ``blocks_needed(num_tokens)`` (speculative decoding:
        slots of rejected drafts). The released blocks hold no computed full block, so they carry no
        prefix-cache hash; ``seq.block_table`` becomes a new list (the runner's mirror rewrites it)."""
        keep = self.blocks_needed(num_tokens)
        table = seq.block_table
        if len(table) <= keep:
            return
        for bid in reversed(table[keep:]):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[bid] = None
                if block.block_hash is None:
                    block.token_ids = ()
                    self.free_blocks.move_to_end(bid, last=False)
        seq.block_table = table[:keep]

    def free(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks (tail first, so a prefix's tail is evicted before its head); its
        wait for blocks shared with another sequence (``Sequence.shared_prefix``) ends with them."""
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_blocks[bid] = None
                if block.block_hash is None:  # nothing to reuse: evict it first
                    block.token_ids = ()
                    self.free_blocks.move_to_end(bid, last=False)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
        seq.shared_prefix = None

    def hit_rate(self) -> float:
        return self.stats.hits / self.stats.queries if self.stats.queries else 0.0
