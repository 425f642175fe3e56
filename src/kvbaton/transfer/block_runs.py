"""Which contiguous token-slot runs a layer chunk touches, so transports copy each run with one memcpy.

For one (layer, K-or-V) pair, storage `[blocks, block_size, ...]` is contiguous: a token slot has
the flat index `block_id * block_size + slot`. A chunk's positions map through its block table
onto flat slots; consecutive block ids merge into one run. Source and destination runs differ
when the two block tables are fragmented differently; `paired_runs` splits them so each piece is
contiguous on both sides.
"""

from __future__ import annotations


def flat_runs(block_ids: tuple[int, ...], first_position: int, num_tokens: int,
              block_size: int) -> list[tuple[int, int]]:
    """(first flat slot, num_tokens) runs covering positions [first_position, first_position + num_tokens).

    `block_ids` are the blocks holding those positions, the first one holding `first_position`.
    One pass over the block ids (this runs per chunk on the transfer's hot path).
    """
    end_position = first_position + num_tokens
    base_position = first_position - first_position % block_size  # position of block_ids[0]'s slot 0
    if block_ids and block_ids == tuple(range(block_ids[0], block_ids[0] + len(block_ids))):
        # One run (a fresh pool's table): found at C speed, not with a Python step per block.
        run_end = min(end_position, base_position + len(block_ids) * block_size)
        if run_end <= first_position:
            return []
        return [(block_ids[0] * block_size + first_position - base_position, run_end - first_position)]
    runs: list[tuple[int, int]] = []
    run_start = 0
    for index in range(1, len(block_ids) + 1):
        if index < len(block_ids) and block_ids[index] == block_ids[index - 1] + 1:
            continue
        # block_ids[run_start:index] are consecutive: one contiguous run of slots
        run_first = max(first_position, base_position + run_start * block_size)
        run_end = min(end_position, base_position + index * block_size)
        if run_end > run_first:
            slot = run_first - base_position - run_start * block_size
            runs.append((block_ids[run_start] * block_size + slot, run_end - run_first))
        run_start = index
    return runs


def paired_runs(src_runs: list[tuple[int, int]], dst_runs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src flat slot, dst flat slot, num_tokens) pieces, contiguous on both sides, in position order."""
    pieces: list[tuple[int, int, int]] = []
    src_index = dst_index = src_offset = dst_offset = 0
    while src_index < len(src_runs) and dst_index < len(dst_runs):
        src_start, src_num = src_runs[src_index]
        dst_start, dst_num = dst_runs[dst_index]
        num = min(src_num - src_offset, dst_num - dst_offset)
        pieces.append((src_start + src_offset, dst_start + dst_offset, num))
        src_offset += num
        dst_offset += num
        if src_offset == src_num:
            src_index, src_offset = src_index + 1, 0
        if dst_offset == dst_num:
            dst_index, dst_offset = dst_index + 1, 0
    assert src_index == len(src_runs) and dst_index == len(dst_runs), "runs cover different token counts"
    return pieces
