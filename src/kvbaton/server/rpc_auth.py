"""CurveZMQ on the router <-> worker RPC: only a process holding the cluster secret connects, either way.

Both key pairs are derived from the cluster secret (`kvbaton.core.cluster_secret`): the router's (a CURVE
server) and the workers' (one pair for all of them). A worker's DEALER must know the router's public key to
complete the handshake, so it talks to no router without the secret; the router's ZAP handler (pyzmq's
`ThreadAuthenticator`, a thread of the router socket's context) accepts only the workers' public key, so a
peer without the secret is dropped during the handshake, before zmq gives its connection a routing identity.
That is what makes ROUTER_HANDOVER (a restarted worker takes its id back) safe: an id can only be taken over
by a process holding the secret. Every frame after the handshake is encrypted and authenticated.
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from kvbaton.core.cluster_secret import ClusterSecret

log = logging.getLogger("kvbaton.cluster")

ZAP_DOMAIN = "kvbaton"


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """The RPC's two CURVE key pairs (z85), derived from the cluster secret."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    def __repr__(self) -> str:
        return "CurveKeys(...)"


def curve_keys(secret: ClusterSecret, channel: str = "rpc") -> CurveKeys:
    """Any 32 bytes are a Curve25519 secret key (libsodium clamps them), so a derived key is one. `channel`: each
    zmq channel ("rpc", the KV store's "store") derives its own pairs."""
    server_secret = z85.encode(secret.derive(f"{channel}-curve-server"))
    client_secret = z85.encode(secret.derive(f"{channel}-curve-client"))
    return CurveKeys(zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret)


class _WorkerKeyCheck:
    """The ZAP handler's test of a connecting peer: its public key must be the workers'."""

    def __init__(self, client_public: bytes) -> None:
        self._client_public = client_public
        self.num_refused = 0

    def callback(self, domain: str, client_public: bytes) -> bool:
        allowed = hmac.compare_digest(client_public, self._client_public)
        if not allowed:
            self.num_refused += 1  # zmq peers reconnect every 0.1 s: say it once, then every 1,000th time
            if self.num_refused == 1 or self.num_refused % 1000 == 0:
                log.warning("refused an RPC connection that does not hold the cluster secret (%d so far)",
                            self.num_refused)
        return allowed


def secure_router(socket: zmq.Socket, context: zmq.Context, secret: ClusterSecret,
                  channel: str = "rpc") -> ThreadAuthenticator:
    """Make `socket` (not yet bound) a CURVE server that admits only holders of `secret`; returns the running
    authenticator, which the caller stops after closing the socket."""
    keys = curve_keys(secret, channel)
    authenticator = ThreadAuthenticator(context, log=logging.getLogger("kvbaton.cluster.zap"))
    authenticator.start()
    authenticator.configure_curve_callback(domain=ZAP_DOMAIN, credentials_provider=_WorkerKeyCheck(keys.client_public))
    socket.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    socket.setsockopt(zmq.CURVE_SERVER, 1)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    return authenticator


def secure_dealer(socket: zmq.Socket, secret: ClusterSecret, channel: str = "rpc") -> None:
    """Make `socket` (not yet connected) a CURVE client of the router that holds `secret`."""
    keys = curve_keys(secret, channel)
    socket.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    socket.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    socket.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
