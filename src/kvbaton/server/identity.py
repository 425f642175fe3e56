"""What makes a worker compatible with a router: model, revision, KV layout, block size, tokenizer.

The router tokenizes once at ingress and hashes prompt blocks for its global prefix index; that
only means anything if every worker tokenizes identically and hashes under the same cache key.
A worker whose identity differs is refused at registration, with the reason.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Protocol

# Mixed scripts, digits, whitespace runs, an emoji and chat-template specials: the places tokenizers differ.
PROBE_TEXT = "Hello, world! 12345 naïve café — 你好 🙂\n\n\tThe quick brown fox <|im_start|>user\nhi<|im_end|>"


class _Encoder(Protocol):
    def encode(self, text: str) -> list[int]: ...


def tokenizer_probe_hash(tokenizer: _Encoder) -> str:
    """A short digest of how `tokenizer` encodes PROBE_TEXT; equal digests mean equal token ids."""
    token_ids = tokenizer.encode(PROBE_TEXT)
    material = ",".join(str(t) for t in token_ids).encode()
    return hashlib.blake2b(material, digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class ClusterIdentity:
    """What the router expects of every worker; fixed once the first worker (or the launcher) sets it."""

    model_revision: str
    kv_layout: str
    block_size: int
    tokenizer_probe_hash: str  # "" = not checked (a router started without a tokenizer)


def incompatibility(expected: ClusterIdentity, offered: ClusterIdentity) -> str:
    """Why `offered` cannot join a cluster of `expected`; "" when it can."""
    if offered.model_revision != expected.model_revision:
        return f"model revision {offered.model_revision!r} differs from the cluster's {expected.model_revision!r}"
    if offered.kv_layout != expected.kv_layout:
        return f"KV layout {offered.kv_layout!r} differs from the cluster's {expected.kv_layout!r}"
    if offered.block_size != expected.block_size:
        return f"block size {offered.block_size} differs from the cluster's {expected.block_size}"
    if expected.tokenizer_probe_hash and offered.tokenizer_probe_hash != expected.tokenizer_probe_hash:
        return (f"tokenizer probe hash {offered.tokenizer_probe_hash} differs from the router's "
                f"{expected.tokenizer_probe_hash}: router and worker would tokenize prompts differently")
    return ""
