"""The KV link handshake's proofs: each end shows the other an HMAC under the cluster secret over both nonces.

A link opens with (`transfer/transport_socket.py`):

    receiver -> Challenge(nonce_r)                     16 fresh random bytes
    sender   -> Hello(worker_id, layout, nonce_s, proof)   proof = HMAC(k, "hello", nonce_r, nonce_s, worker_id, layout)
    receiver -> Welcome(worker_id, num_blocks, shm_path, proof) | Rejected
                                                       proof = HMAC(k, "welcome", nonce_r, nonce_s, worker_id, ...)

with k = the cluster secret's "kv-link" key. The receiver checks the Hello's proof before anything else, so a
peer without the secret is refused (and closed) before it can name a block, and it never learns where a
shared-memory region lives; the sender checks the Welcome's, so it streams KV only to a real decode worker.
Fresh nonces on both sides make a recorded handshake worthless for another link. Every field is covered, so
none can be changed in flight; the parts are packed with msgpack, whose encoding is unambiguous.
Comparisons are constant-time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Sequence

import msgpack

from kvbaton.core.cluster_secret import ClusterSecret

NONCE_BYTES = 16
PROOF_BYTES = 32
_PURPOSE = "kv-link"


class LinkKey:
    """The KV links' key, derived once from the cluster secret (another `purpose`, another key: the KV store's
    TCP links use their own, `kvbaton.transfer.store_tcp`)."""

    __slots__ = ("_key",)

    def __init__(self, secret: ClusterSecret, purpose: str = _PURPOSE) -> None:
        self._key = secret.derive(purpose)

    def __repr__(self) -> str:
        return "LinkKey(...)"

    def proof(self, step: str, nonce_r: bytes, nonce_s: bytes, fields: Sequence[object]) -> bytes:
        """The HMAC one end sends at `step` ("hello" | "welcome") of the link with these nonces."""
        message = msgpack.packb([step, nonce_r, nonce_s, list(fields)], use_bin_type=True)
        return hmac.new(self._key, message, hashlib.sha256).digest()

    def verify(self, proof: bytes, step: str, nonce_r: bytes, nonce_s: bytes, fields: Sequence[object]) -> bool:
        return hmac.compare_digest(proof, self.proof(step, nonce_r, nonce_s, fields))


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)
