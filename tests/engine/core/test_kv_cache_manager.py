"""`KVCacheManager` (engine/core/kv_cache_manager.py) on its own: block accounting, allocation order,
prefix-cache registration and hits, LRU eviction of cached blocks, shared blocks, and the
out-of-blocks answer of `can_allocate`. Pure Python, no model."""

from __future__ import annotations

import pytest

from kvpilot import SamplingParams
from kvpilot.core.kv_cache_manager import KVCacheManager, hash_block
from kvpilot.core.sequence import Request, Sequence

B = 4  # tokens per block in every test here


def _seq(tokens: list[int], **params) -> Sequence:
    req = Request(0, list(tokens), SamplingParams(max_tokens=8, **params), output=None)
    seq = Sequence(request=req, index=0, token_ids=list(tokens), seed=0)
    req.seqs.append(seq)
    return seq


def _computed(kv: KVCacheManager, seq: Sequence) -> None:
    """Allocate ``seq``'s missing blocks, mark every token computed and register its full blocks (what
    the engine does over a prefill)."""
    kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    kv.cache_full_blocks(seq)


def test_an_empty_pool_is_refused():
    with pytest.raises(ValueError, match="at least one block, got 0"):
        KVCacheManager(0, B)


def test_a_new_pool_is_all_free():
    kv = KVCacheManager(8, B)
    assert (kv.num_free_blocks, kv.num_used_blocks, kv.usage) == (8, 0, 0.0)
    assert list(kv.free_blocks) == list(range(8))
    assert kv.hit_rate() == 0.0


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (4, 1), (5, 2), (8, 2), (9, 3)])
def test_blocks_needed_rounds_up(tokens, blocks):
    assert KVCacheManager(4, B).blocks_needed(tokens) == blocks


def test_allocate_takes_blocks_from_the_head_of_the_free_queue():
    kv = KVCacheManager(8, B)
    seq = _seq(list(range(1, 11)))  # 10 tokens: 3 blocks
    kv.allocate(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert [kv.blocks[b].ref_count for b in range(4)] == [1, 1, 1, 0]
    assert (kv.num_free_blocks, kv.num_used_blocks, kv.usage) == (5, 3, 3 / 8)
    assert kv.stats.alloc_new_blocks == 3
    # Growing within the last block takes nothing; one token past it takes one block.
    seq.num_computed_tokens = 10
    kv.allocate(seq, 2)
    assert seq.block_table == [0, 1, 2]
    kv.allocate(seq, 3)
    assert seq.block_table == [0, 1, 2, 3] and kv.num_free_blocks == 4


def test_can_allocate_answers_out_of_blocks():
    kv = KVCacheManager(4, B)
    seq = _seq([1])
    assert kv.can_allocate(seq, 16)  # exactly the pool
    assert not kv.can_allocate(seq, 17)  # one token more needs a fifth block
    kv.allocate(seq, 12)
    seq.num_computed_tokens = 12
    assert kv.can_allocate(seq, 4) and not kv.can_allocate(seq, 5)
    other = _seq([2])
    assert kv.can_allocate(other, 4) and not kv.can_allocate(other, 5)


def test_free_returns_every_block_and_resets_the_sequence():
    kv = KVCacheManager(6, B, enable_block_reuse=False)
    seq = _seq(list(range(1, 10)))
    _computed(kv, seq)
    assert seq.block_table == [0, 1, 2] and kv.num_free_blocks == 3
    kv.free(seq)
    assert (seq.block_table, seq.num_computed_tokens, seq.num_cached_blocks) == ([], 0, 0)
    assert kv.num_free_blocks == 6 and all(b.ref_count == 0 for b in kv.blocks)
    # Uncached blocks go to the head of the queue (reused first), in their table's order.
    assert list(kv.free_blocks) == [0, 1, 2, 3, 4, 5]
    assert kv.hash_to_block == {}


def test_full_blocks_are_registered_with_chained_hashes():
    kv = KVCacheManager(8, B)
    tokens = list(range(1, 11))  # 10 tokens: 2 full blocks, 2 tokens in the third
    seq = _seq(tokens)
    _computed(kv, seq)
    h0 = hash_block(None, tuple(tokens[0:4]))
    h1 = hash_block(h0, tuple(tokens[4:8]))
    assert kv.hash_to_block == {h0: 0, h1: 1}
    assert (kv.blocks[0].token_ids, kv.blocks[1].token_ids) == (tuple(tokens[0:4]), tuple(tokens[4:8]))
    assert kv.blocks[2].block_hash is None  # not full
    assert seq.num_cached_blocks == 2


def test_hash_block_is_chained_and_keyed():
    a = hash_block(None, (1, 2, 3, 4))
    assert len(a) == 16 and a == hash_block(None, (1, 2, 3, 4))
    assert hash_block(a, (5, 6, 7, 8)) != hash_block(None, (5, 6, 7, 8))  # the parent is part of it
    assert hash_block(None, (1, 2, 3, 4), extra=b"lora-1") != a


def test_a_prefix_hit_leaves_at_least_one_token_to_compute():
    kv = KVCacheManager(8, B)
    tokens = list(range(1, 13))  # 12 tokens: 3 full blocks
    _computed(kv, _seq(tokens))
    assert kv.match_prefix(_seq(tokens)) == [0, 1]  # at most 11 tokens: 2 full blocks
    assert kv.match_prefix(_seq(tokens[:9])) == [0, 1]
    assert kv.match_prefix(_seq(tokens[:8])) == [0]
    assert kv.match_prefix(_seq(tokens[:4])) == []
    assert kv.match_prefix(_seq(tokens[:8] + [99, 98])) == [0, 1]


def test_a_block_with_other_parents_is_not_a_hit():
    kv = KVCacheManager(8, B)
    _computed(kv, _seq([1, 2, 3, 4, 5, 6, 7, 8, 9]))
    # Same second block, other first block: the chained hash differs, nothing matches.
    assert kv.match_prefix(_seq([9, 9, 9, 9, 5, 6, 7, 8, 9])) == []


def test_a_hash_hit_is_confirmed_by_the_tokens():
    kv = KVCacheManager(8, B)
    tokens = [1, 2, 3, 4, 5]
    _computed(kv, _seq(tokens))
    kv.blocks[0].token_ids = (1, 2, 3, 5)  # what a hash collision would look like
    assert kv.match_prefix(_seq(tokens)) == []


@pytest.mark.parametrize("params", [dict(prompt_logprobs=1), dict(return_context_logits=True)])
def test_requests_that_need_every_prompt_logit_take_no_cached_block(params):
    kv = KVCacheManager(8, B)
    tokens = [1, 2, 3, 4, 5]
    _computed(kv, _seq(tokens))
    assert kv.match_prefix(_seq(tokens)) == [0]
    assert kv.match_prefix(_seq(tokens, **params)) == []


def test_without_block_reuse_nothing_is_registered_or_matched():
    kv = KVCacheManager(8, B, enable_block_reuse=False)
    tokens = [1, 2, 3, 4, 5]
    seq = _seq(tokens)
    _computed(kv, seq)
    assert kv.hash_to_block == {} and seq.num_cached_blocks == 0
    assert kv.match_prefix(_seq(tokens)) == []


def test_admit_takes_cached_blocks_out_of_the_free_queue_and_counts_the_hit():
    kv = KVCacheManager(6, B)
    tokens = list(range(1, 10))  # 9 tokens: blocks 0, 1 full, 2 partial
    first = _seq(tokens)
    _computed(kv, first)
    kv.free(first)
    # The partial block (no hash) goes to the head; the cached ones to the tail, tail block first.
    assert list(kv.free_blocks) == [2, 3, 4, 5, 1, 0]
    again = _seq(tokens + [10])  # 10 tokens: (10 - 1) // 4 = 2 blocks may hit
    cached = kv.match_prefix(again)
    assert cached == [0, 1]
    assert kv.can_allocate(again, 2, cached)
    kv.admit(again, cached)
    assert again.block_table == [0, 1] and again.num_computed_tokens == 8 and again.num_cached_blocks == 2
    assert [kv.blocks[b].ref_count for b in (0, 1)] == [1, 1]
    assert list(kv.free_blocks) == [2, 3, 4, 5]
    assert (kv.stats.queries, kv.stats.hits, kv.stats.reused_blocks, kv.stats.missed_blocks) == (10, 8, 2, 1)
    assert kv.hit_rate() == 0.8
    kv.allocate(again, 2)
    assert again.block_table == [0, 1, 2]


def test_can_allocate_counts_cached_free_blocks_as_taken():
    kv = KVCacheManager(3, B)
    tokens = list(range(1, 10))
    first = _seq(tokens)
    _computed(kv, first)
    kv.free(first)  # all 3 blocks free, 0 and 1 cached
    again = _seq(tokens)
    cached = kv.match_prefix(again)
    assert cached == [0, 1]
    # 9 tokens: 3 blocks, 2 of them the cached ones (which leave the free queue): 1 new block.
    assert kv.can_allocate(again, 1, cached)
    # 13 tokens would need 4 blocks: 2 cached + 2 new, and only 1 stays free once the cached are taken.
    assert not kv.can_allocate(again, 5, cached)


def test_cached_blocks_are_evicted_oldest_first_and_lose_their_hash():
    kv = KVCacheManager(4, B)
    tokens = list(range(1, 10))  # blocks 0, 1 cached after free; 2 uncached
    first = _seq(tokens)
    _computed(kv, first)
    kv.free(first)
    assert list(kv.free_blocks) == [2, 3, 1, 0]
    other = _seq(list(range(50, 62)))  # 12 unrelated tokens: 3 blocks
    kv.allocate(other, 12)
    assert other.block_table == [2, 3, 1]  # uncached first, then the prefix's tail block
    assert kv.blocks[1].block_hash is None and kv.blocks[1].token_ids == ()
    assert list(kv.hash_to_block.values()) == [0]
    assert kv.match_prefix(_seq(tokens)) == [0]  # the head of the prefix survives
    kv.allocate(_seq([7]), 1)
    assert kv.hash_to_block == {} and kv.match_prefix(_seq(tokens)) == []
    assert kv.num_free_blocks == 0


def test_shared_blocks_are_freed_with_their_last_reference():
    kv = KVCacheManager(6, B)
    src = _seq(list(range(1, 10)))
    _computed(kv, src)
    dst = _seq(list(range(1, 9)) + [42])
    assert kv.common_full_blocks(src.token_ids, dst.token_ids) == 2
    kv.share_prefix(dst, src, 2)
    assert dst.block_table == [0, 1] and [kv.blocks[b].ref_count for b in (0, 1, 2)] == [2, 2, 1]
    assert kv.num_used_blocks == 3  # shared blocks count once
    kv.free(src)
    assert [kv.blocks[b].ref_count for b in (0, 1, 2)] == [1, 1, 0] and kv.num_free_blocks == 4
    kv.free(dst)
    assert kv.num_free_blocks == 6 and all(b.ref_count == 0 for b in kv.blocks)


def test_share_prefix_refuses_a_table_that_is_not_a_prefix():
    kv = KVCacheManager(6, B)
    src = _seq(list(range(1, 10)))
    _computed(kv, src)
    dst = _seq(list(range(1, 10)))
    kv.allocate(dst, 4)  # its own first block, not src's
    with pytest.raises(AssertionError, match="not a prefix"):
        kv.share_prefix(dst, src, 2)


@pytest.mark.parametrize("a, b, common", [
    (list(range(12)), list(range(12)), 2),  # equal: one token each stays their own
    (list(range(12)), list(range(8)) + [99] * 4, 2),
    (list(range(12)), list(range(7)) + [99] * 5, 1),
    (list(range(12)), [99] + list(range(1, 12)), 0),
    (list(range(13)), list(range(13)), 3),
    (list(range(5)), list(range(12)), 1),
])
def test_common_full_blocks(a, b, common):
    assert KVCacheManager(4, B).common_full_blocks(a, b) == common
