"""A random paged KV-cache batch and a naive dense attention over it, shared by the attention tests."""

from __future__ import annotations

import torch


def make_paged_batch(
    q_lens, ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype=torch.float32, seed=0
):
    """Random dense per-sequence K/V scattered into a shuffled paged cache.

    Returns (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, dense_k, dense_v) where
    dense_k[i] is [seq_len_i, num_kv_heads, head_dim]. The cache starts full of NaN so reading an
    unwritten slot poisons the output.
    """
    g = torch.Generator().manual_seed(seed)
    seq_lens = [c + ql for c, ql in zip(ctx_lens, q_lens)]
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(blocks_per_seq) + 1
    block_tables = torch.full((len(q_lens), max_blocks), -1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    dense_k, dense_v = [], []
    nxt = 0
    for i, s in enumerate(seq_lens):
        ids = perm[nxt : nxt + blocks_per_seq[i]]
        nxt += blocks_per_seq[i]
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(s, num_kv_heads, head_dim, generator=g).to(dtype)
        dense_k.append(k)
        dense_v.append(v)
        for p in range(s):
            k_cache[ids[p // block_size], p % block_size] = k[p]
            v_cache[ids[p // block_size], p % block_size] = v[p]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    return (
        q,
        k_cache,
        v_cache,
        block_tables,
        torch.tensor(seq_lens, dtype=torch.int32),
        qsl,
        dense_k,
        dense_v,
    )


def naive_attention(q, dense_k, dense_v, seq_lens, qsl, scale):
    """Per-token, per-head dense causal attention in float64 (the slow obvious definition)."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    num_heads = q.shape[1]
    for i in range(len(seq_lens)):
        ql = int(qsl[i + 1] - qsl[i])
        sl = int(seq_lens[i])
        group = num_heads // dense_k[i].shape[1]
        for j in range(ql):
            t = int(qsl[i]) + j
            pos = sl - ql + j
            for h in range(num_heads):
                k = dense_k[i][: pos + 1, h // group].double()
                v = dense_v[i][: pos + 1, h // group].double()
                w = torch.softmax(k @ q[t, h].double() * scale, dim=0)
                out[t, h] = w @ v
    return out
