"""The identity of a KV cache layout: two workers exchange KV blocks only when their layouts are equal.

Storage shape (shared with `kvbaton.engine.kv_storage`): `[layers, 2, blocks, block_size, kv_heads,
head_dim]`. For one (layer, K-or-V) pair the `[blocks, block_size]` axes are contiguous, so a token
slot is addressed by the flat index `block_id * block_size + slot` — the transports rely on that.

The identity carries the worker's parallelism (tensor and pipeline parallel sizes). A parallel worker's storage
is still every layer and KV head in that shape (`kvbaton.engine.rank_group`): tensor rank t of a worker of degree
N computes and reads KV heads [t * kvh/N, (t+1) * kvh/N) of each token slot, stage s its layers. A layer chunk
moves every KV head of its tokens, so between different degrees each head's bytes land in the head slot the rank
that owns it on the other side reads: the conversion is exact, and parallelism alone is never a mismatch. What
changes the bytes themselves (revision, dtype, block size, layers, heads, head dim) is, and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

DTYPE_NUM_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
_CONVERTIBLE = ("tensor_parallel_size", "pipeline_parallel_size")


@dataclass(frozen=True, slots=True)
class KVLayout:
    model_revision: str
    dtype: str  # a key of DTYPE_NUM_BYTES
    block_size: int  # tokens per block
    num_layers: int
    num_kv_heads: int
    head_dim: int
    tensor_parallel_size: int = 1  # the worker's: its ranks each hold num_kv_heads / tensor_parallel_size heads
    pipeline_parallel_size: int = 1  # the worker's: its stages each hold a run of the layers

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_NUM_BYTES:
            raise ValueError(f"KV dtype must be one of {sorted(DTYPE_NUM_BYTES)}, got {self.dtype!r}")
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tensor_parallel_size",
                     "pipeline_parallel_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_heads % self.tensor_parallel_size or self.pipeline_parallel_size > self.num_layers:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must divide num_kv_heads="
                             f"{self.num_kv_heads}, pipeline_parallel_size={self.pipeline_parallel_size} at most "
                             f"num_layers={self.num_layers}")

    @property
    def layout_id(self) -> str:
        return (f"{self.model_revision}|{self.dtype}|bs{self.block_size}|L{self.num_layers}"
                f"|kvh{self.num_kv_heads}|hd{self.head_dim}|tp{self.tensor_parallel_size}"
                f"|pp{self.pipeline_parallel_size}")

    def kv_heads_of_rank(self, tp_rank: int) -> range:
        """The KV heads tensor rank `tp_rank` of a worker of this layout computes and reads."""
        per_rank = self.num_kv_heads // self.tensor_parallel_size
        return range(tp_rank * per_rank, (tp_rank + 1) * per_rank)

    @property
    def dtype_num_bytes(self) -> int:
        return DTYPE_NUM_BYTES[self.dtype]

    @property
    def token_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * self.dtype_num_bytes

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers, K and V."""
        return self.num_layers * 2 * self.block_size * self.token_bytes

    def storage_shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_range(self, first_position: int, num_tokens: int) -> range:
        """Indexes (into a request's block table) of the blocks holding positions [first, first+num)."""
        return range(first_position // self.block_size, self.num_blocks_for(first_position + num_tokens))

    def chunk_bytes(self, num_tokens: int) -> int:
        """Bytes of `num_tokens` tokens of one layer, K and V: what one layer chunk moves."""
        return 2 * num_tokens * self.token_bytes

    def mismatch(self, other: KVLayout) -> str:
        """Why KV in `other` cannot be read as this layout; "" when the layouts are equal or differ only in
        parallelism, which the handoff converts exactly (see the module docstring)."""
        if other == self:
            return ""  # every chunk checks its layout: the equal case costs one tuple comparison
        for field in fields(self):
            if field.name in _CONVERTIBLE:
                continue
            mine, theirs = getattr(self, field.name), getattr(other, field.name)
            if mine != theirs:
                return f"KV layout mismatch: {field.name} {theirs!r} != expected {mine!r}"
        return ""
