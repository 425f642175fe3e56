"""Paged attention: per-step index metadata and the attention call that reads/writes the block KV cache.

The KV cache of one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]`; token `p` of a sequence
lives in slot `block_ids[p // block_size] * block_size + p % block_size`. Each step, the new tokens' K/V are
written into their slots, then every sequence attends over its whole context read through its block table.

All index tensors are built once per step by `AttentionMetadata.build`, so the per-layer work is a few
tensor ops: one scatter, one padded SDPA call for all decodes, one SDPA call per prefill chunk.

Shapes are bucketed. torch's CPU flash attention JIT-compiles (oneDNN brgemm) and keeps a kernel for every
query and key length tail it meets, and the linears' oneDNN primitives are kept per row count: a server whose
steps take every length grew by hundreds of MB. A prefill chunk's queries are therefore zero-padded to
`bucket_rows(q_len)` (at most 16 lengths per doubling, at most 6.25 % more rows) and its cached keys to a
multiple of `KEY_PAD`; padded keys are masked (or, causal, after every real query) and padded rows dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

KEY_PAD = 64  # a prefill chunk over cached context attends over a multiple of this many keys (masked beyond)


def bucket_rows(rows: int) -> int:
    """`rows` rounded up to keep its top 5 bits: exact to 32, then 34, 36, .., 64, 68, 72, .., 128, 136, ..

    16 lengths per doubling, at most 6.25 % more rows (padded rows cost their share of a prefill's linears)."""
    step = 1 << max(rows.bit_length() - 5, 0)
    return -(-rows // step) * step


@dataclass(frozen=True, slots=True)
class SequenceSlice:
    """One sequence's part of a step."""

    start_pos: int  # tokens already in its KV cache (prefix hit or earlier chunks)
    num_new_tokens: int  # tokens computed this step (1 for a decode)
    block_ids: Sequence[int]  # its block table; covers start_pos + num_new_tokens tokens


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """All q_len-1 sequences of a step, attended in one padded SDPA call.

    `token_index` is None when the decode tokens are the contiguous range `token_range` of the step
    (the usual case: decodes first), which lets the model slice instead of gather.
    """

    token_range: tuple[int, int]  # [first, last) token rows when contiguous, else (0, 0)
    token_index: Tensor | None  # [D] int64 rows of the step's tokens, when not contiguous
    block_table: Tensor  # [D, max_blocks] int64, padded with block 0 (masked out)
    attend_mask: Tensor  # [D, 1, 1, max_blocks * block_size] bool, True where key pos < context length


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """One sequence computing more than one token this step."""

    token_start: int  # first row of this chunk in the step's tokens
    token_end: int  # one past its last row
    context_len: int  # start_pos + num_new_tokens: keys it attends over
    block_table: Tensor | None  # [num_blocks] int64 — None when start_pos == 0 (attend fresh K/V, no gather)
    # [bucket_rows(q_len), context_len rounded up to KEY_PAD] bool causal-with-offset mask (padding: False for
    # real queries), None when start_pos == 0
    attend_mask: Tensor | None


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Index tensors for one forward step, shared by every layer."""

    block_size: int
    num_tokens: int
    slot_mapping: Tensor  # [T] int64 cache slot of each new token
    decode: DecodeBatch | None
    prefills: tuple[PrefillChunk, ...]

    @staticmethod
    def build(
        seqs: Sequence[SequenceSlice], block_size: int, device: str | torch.device = "cpu"
    ) -> AttentionMetadata:
        """Index tensors for `seqs`, whose new tokens are concatenated in this order in the step's input."""
        slots: list[int] = []
        decode_rows: list[int] = []
        decode_tables: list[Sequence[int]] = []
        decode_context_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        row = 0
        for seq in seqs:
            context_len = seq.start_pos + seq.num_new_tokens
            num_blocks = -(-context_len // block_size)
            if seq.num_new_tokens < 1:
                raise ValueError(f"a sequence slice must compute at least one token, got {seq.num_new_tokens}")
            if len(seq.block_ids) < num_blocks:
                raise ValueError(f"block table of {len(seq.block_ids)} blocks cannot hold {context_len} tokens")
            block_ids = seq.block_ids
            for pos in range(seq.start_pos, context_len):
                slots.append(block_ids[pos // block_size] * block_size + pos % block_size)
            if seq.num_new_tokens == 1:
                decode_rows.append(row)
                decode_tables.append(block_ids[:num_blocks])
                decode_context_lens.append(context_len)
            else:
                prefills.append(_prefill_chunk(seq, row, block_size, device))
            row += seq.num_new_tokens
        return AttentionMetadata(
            block_size=block_size,
            num_tokens=row,
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            decode=_decode_batch(decode_rows, decode_tables, decode_context_lens, block_size, device)
            if decode_rows
            else None,
            prefills=tuple(prefills),
        )


def _prefill_chunk(seq: SequenceSlice, row: int, block_size: int, device: str | torch.device) -> PrefillChunk:
    context_len = seq.start_pos + seq.num_new_tokens
    if seq.start_pos == 0:
        return PrefillChunk(row, row + seq.num_new_tokens, context_len, None, None)
    num_blocks = -(-context_len // block_size)
    # Query i sits at position start_pos + i and sees keys 0 ..= start_pos + i: never a padded key (>= context_len),
    # and a padded query (dropped) sees key 0 at least, so no row is all masked.
    query_pos = torch.arange(seq.start_pos, seq.start_pos + bucket_rows(seq.num_new_tokens), device=device)
    key_pos = torch.arange(-(-context_len // KEY_PAD) * KEY_PAD, device=device)
    return PrefillChunk(
        token_start=row,
        token_end=row + seq.num_new_tokens,
        context_len=context_len,
        block_table=torch.tensor(list(seq.block_ids[:num_blocks]), dtype=torch.int64, device=device),
        attend_mask=key_pos[None, :] <= query_pos[:, None],
    )


def _decode_batch(
    rows: list[int],
    tables: list[Sequence[int]],
    context_lens: list[int],
    block_size: int,
    device: str | torch.device,
) -> DecodeBatch:
    max_blocks = max(len(table) for table in tables)
    padded = [list(table) + [0] * (max_blocks - len(table)) for table in tables]
    key_pos = torch.arange(max_blocks * block_size, device=device)
    lens = torch.tensor(context_lens, dtype=torch.int64, device=device)
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return DecodeBatch(
        token_range=(rows[0], rows[0] + len(rows)) if contiguous else (0, 0),
        token_index=None if contiguous else torch.tensor(rows, dtype=torch.int64, device=device),
        block_table=torch.tensor(padded, dtype=torch.int64, device=device),
        attend_mask=(key_pos[None, :] < lens[:, None])[:, None, None, :],
    )


def paged_attention(q: Tensor, k: Tensor, v: Tensor, layer_cache: Tensor, meta: AttentionMetadata) -> Tensor:
    """Write `k`/`v` into the cache, then attend; returns `[T, num_heads * head_dim]`.

    q: [T, H, D]; k, v: [T, KVH, D] (RoPE already applied); layer_cache: [2, blocks, block_size, KVH, D].
    The cache must hold finite values everywhere (allocate it with zeros): padded decode keys are
    masked, and a NaN there would still poison the softmax.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    cache_k, cache_v = layer_cache[0], layer_cache[1]
    cache_k.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    cache_v.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

    decode = meta.decode
    if decode is not None and not meta.prefills:
        return _decode_attention(q, decode, cache_k, cache_v, group).reshape(num_tokens, num_heads * head_dim)

    out = torch.empty_like(q)
    if decode is not None:
        if decode.token_index is None:
            first, last = decode.token_range
            out[first:last] = _decode_attention(q[first:last], decode, cache_k, cache_v, group)
        else:
            out.index_copy_(
                0, decode.token_index, _decode_attention(q[decode.token_index], decode, cache_k, cache_v, group)
            )
    for chunk in meta.prefills:
        out[chunk.token_start : chunk.token_end] = _prefill_attention(q, k, v, chunk, cache_k, cache_v)
    return out.view(num_tokens, num_heads * head_dim)


def _decode_attention(q: Tensor, decode: DecodeBatch, cache_k: Tensor, cache_v: Tensor, group: int) -> Tensor:
    """[D, H, Dh] queries of length 1 -> [D, H, Dh], one SDPA call over the padded block tables."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = num_heads // group
    # [D, max_blocks * block_size, KVH, Dh] -> [D, KVH, L, Dh]
    keys = _gather_blocks(cache_k, decode.block_table).transpose(1, 2)
    values = _gather_blocks(cache_v, decode.block_table).transpose(1, 2)
    # Fold the query heads sharing a KV head into the query-length axis: [D, KVH, group, Dh]
    # (head h reads KV head h // group), so GQA needs neither K/V expansion nor enable_gqa.
    queries = q.view(num_seqs, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=decode.attend_mask)
    return out.reshape(num_seqs, num_heads, head_dim)


def _prefill_attention(
    q: Tensor, k: Tensor, v: Tensor, chunk: PrefillChunk, cache_k: Tensor, cache_v: Tensor
) -> Tensor:
    """One chunk's [q_len, H, Dh] output: causal over fresh K/V, or over its cached context when start_pos > 0."""
    rows = slice(chunk.token_start, chunk.token_end)
    q_len = chunk.token_end - chunk.token_start
    num_rows = bucket_rows(q_len)
    queries = _pad_rows(q[rows], num_rows).transpose(0, 1).unsqueeze(0)  # [1, H, num_rows, Dh]
    if chunk.block_table is None:
        # Causal: the padded keys come after every real query, which therefore never sees them.
        keys = _pad_rows(k[rows], num_rows).transpose(0, 1).unsqueeze(0)
        values = _pad_rows(v[rows], num_rows).transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, enable_gqa=True)
    else:
        assert chunk.attend_mask is not None
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        num_keys = chunk.attend_mask.shape[1]
        keys = _pad_rows(_gather_blocks(cache_k, chunk.block_table).view(-1, num_kv_heads, head_dim), num_keys)
        values = _pad_rows(_gather_blocks(cache_v, chunk.block_table).view(-1, num_kv_heads, head_dim), num_keys)
        out = F.scaled_dot_product_attention(
            queries,
            keys[:num_keys].transpose(0, 1).unsqueeze(0),
            values[:num_keys].transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.attend_mask,
            enable_gqa=True,
        )
    return out.squeeze(0).transpose(0, 1)[:q_len]


def _pad_rows(x: Tensor, num_rows: int) -> Tensor:
    """x [n, ...] with zero rows appended up to num_rows (x itself when n >= num_rows)."""
    missing = num_rows - x.shape[0]
    return F.pad(x, (0, 0) * (x.dim() - 1) + (0, missing)) if missing > 0 else x


def _gather_blocks(cache: Tensor, block_table: Tensor) -> Tensor:
    """cache [blocks, block_size, KVH, Dh], table [..., n] -> [..., n * block_size, KVH, Dh].

    index_select over whole flattened blocks copies one contiguous run per block; advanced indexing
    (`cache[table]`) was measured 2.5-4.6x slower on CPU for this copy, which dominates large decode batches.
    """
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    # A tensor-parallel rank's cache is its KV heads' slice of a worker's shared storage: not contiguous, so its
    # blocks are selected whole along the block axis instead (the same rows, one strided copy each).
    flat = cache.view(num_blocks, -1) if cache.is_contiguous() else cache
    rows = torch.index_select(flat, 0, block_table.reshape(-1))
    return rows.view(*block_table.shape[:-1], block_table.shape[-1] * block_size, num_kv_heads, head_dim)
