"""The cluster secret: one random key shared by a router and its workers, and the keys each channel derives from it.

`kvbaton serve` makes a fresh one (`ClusterSecret.generate`) and hands it to every worker it starts in the
environment (`SECRET_ENV`, hex), never on a command line, where `ps` shows it to every user of the host; a
worker started by hand reads it from a private file (`--cluster-secret-file`, mode 0600, which `kvbaton serve
--cluster-secret-file` writes) or from the same variable. Each internal channel derives its own key (`derive`),
so what one channel's handshake exposes is no help against another: the router RPC's CurveZMQ key pairs
(`kvbaton.server.rpc_auth`) and the KV links' HMAC handshake (`kvbaton.transfer.link_auth`). The value never
appears in a repr, a log line or an error message.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from dataclasses import dataclass, field

from kvbaton.core.errors import KvbatonError

SECRET_ENV = "KVBATON_CLUSTER_SECRET"  # hex; how the launcher hands the secret to the workers it starts
API_KEY_ENV = "KVBATON_API_KEY"  # an API key for the router (server/auth.py), as vLLM reads VLLM_API_KEY
SECRET_BYTES = 32
MIN_SECRET_BYTES = 16


@dataclass(frozen=True, slots=True)
class ClusterSecret:
    """A shared key of at least MIN_SECRET_BYTES random bytes; shown as its fingerprint, never as itself."""

    value: bytes = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.value) < MIN_SECRET_BYTES:
            raise KvbatonError(f"a cluster secret needs at least {MIN_SECRET_BYTES} bytes, got {len(self.value)}")

    @classmethod
    def generate(cls) -> ClusterSecret:
        return cls(secrets.token_bytes(SECRET_BYTES))

    @classmethod
    def from_hex(cls, text: str, origin: str = "the cluster secret") -> ClusterSecret:
        try:
            return cls(bytes.fromhex(text.strip()))
        except ValueError:
            raise KvbatonError(f"{origin} is not a hex string") from None

    def to_hex(self) -> str:
        return self.value.hex()

    @property
    def fingerprint(self) -> str:
        """8 hex digits that tell two secrets apart in a log without revealing either."""
        return hashlib.sha256(b"kvbaton/fingerprint/" + self.value).hexdigest()[:8]

    def derive(self, purpose: str) -> bytes:
        """A 32-byte key for one use (HMAC-SHA256 of the purpose under the secret)."""
        return hmac.new(self.value, b"kvbaton/" + purpose.encode(), hashlib.sha256).digest()

    @classmethod
    def read_file(cls, path: str) -> ClusterSecret:
        """The secret in `path` (hex), which only its owner may read or write."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise KvbatonError(f"cannot read the cluster secret file {path}: {exc.strerror}") from None
        try:
            mode = os.fstat(fd).st_mode
            if mode & (stat.S_IRWXG | stat.S_IRWXO):
                raise KvbatonError(f"the cluster secret file {path} is open to other users (mode "
                                   f"{stat.S_IMODE(mode):04o}): chmod 600 {path}")
            text = os.read(fd, 4096).decode("ascii", errors="replace")
        finally:
            os.close(fd)
        return cls.from_hex(text, f"the cluster secret file {path}")

    def write_file(self, path: str) -> None:
        """Write the secret to a new file only its owner can read (mode 0600); an existing file is an error."""
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise KvbatonError(f"cannot create the cluster secret file {path}: {exc.strerror}") from None
        try:
            os.write(fd, (self.to_hex() + "\n").encode())
        finally:
            os.close(fd)


def worker_environment(secret: ClusterSecret, environment: dict[str, str]) -> dict[str, str]:
    """A worker process's environment from its parent's: the cluster secret in, the router's API key out."""
    return {**{name: value for name, value in environment.items() if name != API_KEY_ENV},
            SECRET_ENV: secret.to_hex()}


def load_or_create_secret(path: str) -> ClusterSecret:
    """`kvbaton serve --cluster-secret-file PATH`: the secret in PATH, or a new one written there (0600), so that
    workers started by hand on other hosts can be given the same file."""
    if os.path.exists(path):
        return ClusterSecret.read_file(path)
    secret = ClusterSecret.generate()
    secret.write_file(path)
    return secret
