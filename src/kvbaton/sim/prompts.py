"""A simulated request's prompt as token ids and hashed blocks, with the parts requests share converted once.

Workload prompts are lists of parts (`WorkloadRequest.prompt_parts`: a system prompt, a tool schema, a
document, then the request's own text), and many requests share their leading parts. Converting and
hashing those again for every arrival is most of an arrival's cost in the simulator; `SimPrompts`
keeps each shared part's ids once it is seen twice, and each shared head's full blocks and chained
hashes once per cache key. The results are exactly `wr.prompt_array.tolist()` and `hash_prompt`'s
(`test_sim_fast_paths`).

The hashed heads are kept least recently used first, up to `MEMO_TOKENS` tokens in all: a trace whose
heads rarely repeat (Mooncake's, where a request's head is its whole prompt but the last part) would
otherwise keep every prompt's blocks for the whole run (~0.4 MB a request there, 1.8 GB at the end of its
synthetic trace, and the page faults of touching it all).

A prompt whose parts but the last each fill whole blocks (a Mooncake trace's: one part per 512-token block of
its `hash_ids`) goes part by part instead (`prompt`): each such part is kept with its ids, block tuples and
chained hashes under the hash of the block before it, so the same part after the same prefix is neither converted
nor hashed again, whatever follows it. 64 % of the synthetic trace's parts repeat so; reuse distances are long
(8,192 parts kept catch 40 % of them), so these are kept up to `CHAIN_MEMO_TOKENS` tokens, least recently used
first, their tuples shared with the requests and radix caches that hold the same blocks (the whole run's peak
memory grows ~4 %). A part is kept from its second sighting on (the keys of parts seen once are remembered, up to
twice as many tokens): as many hits on that trace, and a trace of parts that never repeat keeps none.
"""

from __future__ import annotations

from collections import OrderedDict

from kvbaton.bench.workloads.base import WorkloadRequest
from kvbaton.cache.hashing import CacheKey, HashedBlocks, chain_hashes, hash_prompt, split_blocks

MEMO_TOKENS = 1 << 20  # tokens of hashed heads kept (~40 MB of token tuples and hashes)
CHAIN_MEMO_TOKENS = 1 << 23  # tokens of block-aligned parts kept hashed under their prefix


class SimPrompts:
    def __init__(self, cache_key: CacheKey, block_size: int, memo_tokens: int = MEMO_TOKENS,
                 chain_memo_tokens: int = CHAIN_MEMO_TOKENS) -> None:
        self.cache_key = cache_key
        self.block_size = block_size
        # id(part) -> (the part, its ids as Python ints once it has been seen twice): shared prompt parts are
        # converted once. The entry holds the part, so its id cannot be reused by another array.
        self._part_ids: dict[int, tuple[object, list[int] | None]] = {}
        # (ids of leading prompt parts, cache key) -> (those parts, their full blocks' token tuples, chained hashes),
        # least recently used first, `memo_tokens` tokens at most in all (`_memo_tokens` of them now).
        self._part_hashes: OrderedDict[tuple[tuple[int, ...], CacheKey],
                                       tuple[object, tuple[tuple[int, ...], ...], tuple[int, ...]]] = OrderedDict()
        self.memo_tokens = memo_tokens
        self._memo_tokens = 0
        # (hash of the block before a block-aligned part, id of the part) -> (the part, its ids, its full blocks'
        # token tuples, their chained hashes), least recently used first, `chain_memo_tokens` tokens at most.
        self._chain: OrderedDict[tuple[int, int], tuple[object, list[int], tuple[tuple[int, ...], ...],
                                                        tuple[int, ...]]] = OrderedDict()
        self.chain_memo_tokens = chain_memo_tokens
        self._chain_tokens = 0
        self._seen: OrderedDict[tuple[int, int], int] = OrderedDict()  # keys of parts seen once, and their lengths
        self._seen_tokens = 0

    def prompt(self, wr: WorkloadRequest) -> tuple[list[int], HashedBlocks]:
        """`ids(wr)` and `hashed` of them; part by part, from the memo of block-aligned parts, when every part but
        the last fills whole blocks (the module docstring)."""
        parts = wr.prompt_parts
        block_size = self.block_size
        if len(parts) < 2 or any(not len(part) or len(part) % block_size for part in parts[:-1]):
            ids = self.ids(wr)
            return ids, self.hashed(wr, ids)
        key = self.cache_key.with_tenant(wr.tenant)
        memo = self._chain
        prompt: list[int] = []
        token_blocks: list[tuple[int, ...]] = []
        block_hashes: list[int] = []
        parent_hash = key.root_hash
        for part in parts[:-1]:
            memo_key = (parent_hash, id(part))
            entry = memo.get(memo_key)
            if entry is None:
                ids = part.tolist()
                blocks = tuple(split_blocks(ids, block_size))
                entry = (part, ids, blocks, tuple(chain_hashes(parent_hash, blocks)))
                seen = self._seen
                seen_tokens = seen.pop(memo_key, None)
                if seen_tokens is None:  # first seen (or not for long): remembered, not kept
                    seen[memo_key] = len(part)
                    self._seen_tokens += len(part)
                    while self._seen_tokens > 2 * self.chain_memo_tokens:
                        self._seen_tokens -= seen.popitem(last=False)[1]
                else:  # (a key's id may be a dead part's: then this one is kept at once, harmlessly)
                    self._seen_tokens -= seen_tokens
                    if len(part) <= self.chain_memo_tokens:  # the entry keeps its part: its id is not reused
                        memo[memo_key] = entry
                        self._chain_tokens += len(part)
                        while self._chain_tokens > self.chain_memo_tokens:
                            _, (dropped, _, _, _) = memo.popitem(last=False)
                            self._chain_tokens -= len(dropped)  # type: ignore[arg-type]
            else:
                memo.move_to_end(memo_key)
            prompt += entry[1]
            token_blocks += entry[2]
            block_hashes += entry[3]
            parent_hash = entry[3][-1]
        prompt += self._ids_of(parts[-1])
        rest = split_blocks(prompt[len(token_blocks) * block_size:], block_size)
        token_blocks += rest
        block_hashes += chain_hashes(parent_hash, rest)
        return prompt, HashedBlocks(key, block_size, tuple(token_blocks), tuple(block_hashes))

    def ids(self, wr: WorkloadRequest) -> list[int]:
        """`wr.prompt_array.tolist()`, the ids of a part that requests share (a tool schema, a document)
        converted to Python ints once: from its second use on they are copied from the kept list."""
        parts = wr.prompt_parts
        if len(parts) == 1:
            return parts[0].tolist()
        prompt: list[int] = []
        for part in parts:
            prompt += self._ids_of(part)
        return prompt

    def _ids_of(self, part: object) -> list[int]:
        """`part.tolist()`, kept from its second use on."""
        key = id(part)
        entry = self._part_ids.get(key)
        if entry is None:
            self._part_ids[key] = (part, None)
            return part.tolist()  # type: ignore[attr-defined]
        ids = entry[1]
        if ids is None:
            ids = part.tolist()  # type: ignore[attr-defined]
            self._part_ids[key] = (part, ids)
        return ids

    def hashed(self, wr: WorkloadRequest, prompt: list[int]) -> HashedBlocks:
        """`hash_prompt` of `prompt` under the request's key, with the full blocks of leading parts that requests
        share (all parts but the last, else the first: a system prompt, a tool schema, a document) split and
        hashed once per key; the rest of the chain continues from their last hash, as hash_prompt would."""
        key = self.cache_key.with_tenant(wr.tenant)
        block_size = self.block_size
        parts = wr.prompt_parts
        if len(parts) == 1:
            return hash_prompt(key, prompt, block_size)
        heads = (parts[:-1], parts[:1]) if len(parts) > 2 else (parts[:1],)
        memo = self._part_hashes
        missed = []
        for head in heads:  # longest first
            memo_key = (tuple(map(id, head)), key)
            entry = memo.get(memo_key)
            if entry is not None:
                memo.move_to_end(memo_key)
                _, token_blocks, block_hashes = entry
                rest_blocks = split_blocks(prompt[len(token_blocks) * block_size:], block_size)
                blocks = HashedBlocks(key, block_size, token_blocks + tuple(rest_blocks),
                                      block_hashes + tuple(chain_hashes(block_hashes[-1], rest_blocks)))
                break
            missed.append((memo_key, head))
        else:
            blocks = hash_prompt(key, prompt, block_size)
        for memo_key, head in missed:  # each entry keeps its parts alive, so their ids cannot be reused
            num_blocks = sum(map(len, head)) // block_size
            if num_blocks and num_blocks * block_size <= self.memo_tokens:
                memo[memo_key] = (head, blocks.token_blocks[:num_blocks], blocks.block_hashes[:num_blocks])
                self._memo_tokens += num_blocks * block_size
                while self._memo_tokens > self.memo_tokens:
                    _, (_, dropped, _) = memo.popitem(last=False)
                    self._memo_tokens -= len(dropped) * block_size
        return blocks
