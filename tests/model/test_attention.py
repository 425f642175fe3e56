"""AttentionMetadata index tensors and paged_attention against dense per-sequence attention."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.model.attention import AttentionMetadata, SequenceSlice, paged_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 8


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def test_build_maps_slots_and_splits_decodes_from_prefills() -> None:
    meta = AttentionMetadata.build(
        [
            SequenceSlice(start_pos=5, num_new_tokens=1, block_ids=[7, 2]),  # decode at pos 5 -> block 2, offset 1
            SequenceSlice(start_pos=0, num_new_tokens=3, block_ids=[4]),  # fresh prefill
            SequenceSlice(start_pos=3, num_new_tokens=1, block_ids=[9, 1]),  # decode inside its first block
            SequenceSlice(start_pos=4, num_new_tokens=2, block_ids=[3, 6, 8]),  # chunk after cached context
        ],
        block_size=4,
    )
    assert meta.num_tokens == 7
    assert meta.slot_mapping.tolist() == [9, 16, 17, 18, 39, 24, 25]
    decode = meta.decode
    assert decode is not None
    assert decode.token_range == (0, 0)
    assert decode.token_index is not None and decode.token_index.tolist() == [0, 4]
    assert decode.block_table.tolist() == [[7, 2], [9, 0]]  # only blocks covering the context, padded with 0
    assert decode.attend_mask.shape == (2, 1, 1, 8)
    assert decode.attend_mask[:, 0, 0].int().tolist() == [[1] * 6 + [0] * 2, [1] * 4 + [0] * 4]
    fresh, continued = meta.prefills
    assert (fresh.token_start, fresh.token_end, fresh.context_len) == (1, 4, 3)
    assert fresh.block_table is None and fresh.attend_mask is None
    assert (continued.token_start, continued.token_end, continued.context_len) == (5, 7, 6)
    assert continued.block_table is not None and continued.block_table.tolist() == [3, 6]
    assert continued.attend_mask is not None
    assert continued.attend_mask.shape == (2, 64)  # keys padded to KEY_PAD, masked beyond the context
    assert continued.attend_mask.int().tolist() == [[1, 1, 1, 1, 1, 0] + [0] * 58, [1, 1, 1, 1, 1, 1] + [0] * 58]


def test_contiguous_decodes_are_sliced_not_gathered() -> None:
    meta = AttentionMetadata.build(
        [SequenceSlice(0, 2, [0]), SequenceSlice(1, 1, [1]), SequenceSlice(7, 1, [2, 3])], block_size=4
    )
    assert meta.decode is not None
    assert meta.decode.token_range == (2, 4) and meta.decode.token_index is None


def test_short_block_table_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot hold 5 tokens"):
        AttentionMetadata.build([SequenceSlice(4, 1, [0])], block_size=4)


def dense_reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start_pos: int) -> torch.Tensor:
    """Plain attention for one sequence: q [n, H, D] at positions start_pos.., keys/values [ctx, KVH, D]."""
    group = NUM_HEADS // NUM_KV_HEADS
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) / HEAD_DIM**0.5
    query_pos = torch.arange(start_pos, start_pos + q.shape[0])[:, None]
    scores = scores.masked_fill(torch.arange(keys.shape[0])[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(q.shape[0], -1)


def check_against_dense(shapes: list[tuple[int, int]], block_size: int, seed: int) -> None:
    """Each (start_pos, num_new_tokens) sequence gets a random block table and random history in the cache."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(s + n) // block_size) for s, n in shapes) + 2
    free = list(range(num_blocks))
    rng.shuffle(free)
    # Unused slots hold large finite values: padding must be masked, never averaged in.
    layer_cache = torch.full((2, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM), 1e4)
    slices, histories = [], []
    for start_pos, num_new in shapes:
        table = [free.pop() for _ in range(-(-(start_pos + num_new) // block_size))]
        history = torch.randn(2, start_pos + num_new, NUM_KV_HEADS, HEAD_DIM, generator=gen)
        for pos in range(start_pos):
            layer_cache[:, table[pos // block_size], pos % block_size] = history[:, pos]
        slices.append(SequenceSlice(start_pos, num_new, table))
        histories.append(history)
    meta = AttentionMetadata.build(slices, block_size)
    q = torch.randn(meta.num_tokens, NUM_HEADS, HEAD_DIM, generator=gen)
    k = torch.cat([h[0, s:] for h, (s, _) in zip(histories, shapes)])
    v = torch.cat([h[1, s:] for h, (s, _) in zip(histories, shapes)])
    out = paged_attention(q, k, v, layer_cache, meta)
    row = 0
    for history, (start_pos, num_new) in zip(histories, shapes):
        want = dense_reference(q[row : row + num_new], history[0], history[1], start_pos)
        torch.testing.assert_close(out[row : row + num_new], want, atol=1e-5, rtol=1e-5)
        row += num_new
    for table, history, (start_pos, num_new) in zip([s.block_ids for s in slices], histories, shapes):
        for pos in range(start_pos, start_pos + num_new):  # new K/V landed in their slots
            assert torch.equal(layer_cache[:, table[pos // block_size], pos % block_size], history[:, pos])


def test_mixed_step_matches_dense_attention() -> None:
    shapes = [(0, 9), (20, 1), (5, 1), (33, 7), (0, 1), (16, 16)]
    check_against_dense(shapes, block_size=8, seed=0)


@settings(max_examples=25, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 40), st.integers(1, 12)), min_size=1, max_size=6),
    block_size=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_any_mix_matches_dense_attention(shapes: list[tuple[int, int]], block_size: int, seed: int) -> None:
    check_against_dense(shapes, block_size, seed)
