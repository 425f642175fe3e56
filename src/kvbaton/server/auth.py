"""API keys, the tenant and role each stands for, and the check every HTTP request passes before the router reads it.

Keys come from `--api-key KEY` (repeatable) and `KVBATON_API_KEY`, each an admin of tenant "" (vLLM's
`--api-key`: one key for everything), and from `--api-key-file FILE`, a JSON list of
`{"key": ..., "tenant": ..., "role": "user" | "admin"}`. A request presents one as `Authorization: Bearer
KEY`; a missing or unknown key is a 401 in OpenAI's error shape (with `WWW-Authenticate: Bearer`), a user key
on an admin route a 403. `/health`, `/ready`, `/openapi.json` and the dashboard's page `/dashboard` (code, no
data) are open, and so is `/metrics` unless `metrics_require_key`; `/cluster`, `/reset_prefix_cache` and
`/dashboard/data` (what reveals or changes cluster state: pids, hosts, KV addresses, every worker's cache)
need an admin key; every other path, unknown ones included, a
key of either role. With no key configured every request passes (the CLI allows that on loopback only).

Only SHA-256 digests of the keys are kept. A presented key is hashed and looked up by its digest's first
8 bytes, then confirmed with `hmac.compare_digest` on the whole digest: the time taken depends on the
digest, which says nothing about any key, never on how much of a key a guess got right. Neither keys nor
their digests ever reach a log line, a repr or an error message.

The tenant of a request (its prefix-cache namespace, `tenant_of`) is its key's; a client's `user` field or
`x-tenant` header is honoured only with `trust_tenant_header` (a gateway in front sets it) and then joins
the key's tenant, never replacing it.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from starlette.types import Scope

from kvbaton.cache.hashing import tenant_salt
from kvbaton.core.errors import KvbatonError
from kvbaton.server.protocol import ApiError

USER = "user"
ADMIN = "admin"
ROLES = (USER, ADMIN)
PRINCIPAL_SCOPE_KEY = "kvbaton.principal"  # where an authenticated request's Principal sits in its ASGI scope
OPEN_PATHS = frozenset({"/health", "/ready", "/openapi.json", "/dashboard"})  # /dashboard: the page, not its data
ADMIN_PATHS = frozenset({"/cluster", "/reset_prefix_cache", "/dashboard/data"})
_BEARER = b"bearer "
_BUCKET_BYTES = 8


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a key speaks for."""

    tenant: str
    role: str  # user | admin

    @property
    def is_admin(self) -> bool:
        return self.role == ADMIN


OPEN_ACCESS = Principal("", ADMIN)  # every request when no key is configured


class ApiKeys:
    """The configured keys as SHA-256 digests, each with its principal (see the module docstring)."""

    def __init__(self, entries: Iterable[tuple[str, Principal]] = ()) -> None:
        self._buckets: dict[bytes, list[tuple[bytes, Principal]]] = {}
        self._num_keys = 0
        seen: set[bytes] = set()
        for key, principal in entries:
            if not key or key != key.strip():
                raise KvbatonError("an API key must be non-empty, without leading or trailing whitespace")
            if principal.role not in ROLES:
                raise KvbatonError(f"an API key's role must be one of {', '.join(ROLES)}, got {principal.role!r}")
            digest = hashlib.sha256(key.encode()).digest()
            if digest in seen:
                raise KvbatonError("the same API key is given twice")
            seen.add(digest)
            self._buckets.setdefault(digest[:_BUCKET_BYTES], []).append((digest, principal))
            self._num_keys += 1

    def __len__(self) -> int:
        return self._num_keys

    def __repr__(self) -> str:
        return f"ApiKeys({self._num_keys} keys)"

    def principal_of(self, presented: bytes) -> Principal | None:
        digest = hashlib.sha256(presented).digest()
        found = None
        for stored, principal in self._buckets.get(digest[:_BUCKET_BYTES], ()):
            if hmac.compare_digest(stored, digest):
                found = principal
        return found


def read_api_key_file(path: str) -> list[tuple[str, Principal]]:
    """The entries of an `--api-key-file`: a JSON list of {"key", "tenant", "role"} objects."""
    try:
        entries = json.loads(Path(path).read_text())
    except OSError as exc:
        raise KvbatonError(f"cannot read the API key file {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise KvbatonError(f"the API key file {path} is not JSON: {exc}") from None
    if not isinstance(entries, list):
        raise KvbatonError(f"the API key file {path} must hold a JSON list of {{key, tenant, role}} objects")
    keys = []
    for index, entry in enumerate(entries):
        if (not isinstance(entry, dict) or set(entry) - {"key", "tenant", "role"}
                or not all(isinstance(entry.get(name, ""), str) for name in ("key", "tenant", "role"))):
            raise KvbatonError(f"entry {index} of {path} must be an object with string fields key, tenant and role")
        role = entry.get("role", USER)
        if role not in ROLES:
            raise KvbatonError(f"entry {index} of {path}: role must be one of {', '.join(ROLES)}, got {role!r}")
        keys.append((entry.get("key", ""), Principal(entry.get("tenant", ""), role)))
    return keys


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


class ApiAuth:
    """The HTTP layer's gate (`authorize`, once per request) and the tenant of a request (`tenant_of`)."""

    def __init__(self, keys: ApiKeys | None = None, *, trust_tenant_header: bool = False,
                 metrics_require_key: bool = False) -> None:
        self.keys = keys if keys is not None else ApiKeys()
        self.enabled = len(self.keys) > 0
        self.trust_tenant_header = trust_tenant_header
        self.open_paths = OPEN_PATHS if metrics_require_key else OPEN_PATHS | {"/metrics"}

    def authorize(self, scope: Scope) -> ApiError | None:
        """None when the request may go on (its Principal then in scope[PRINCIPAL_SCOPE_KEY]), else the refusal.
        An open path takes a valid key too (it may show more to an admin) but goes on without one."""
        if not self.enabled:
            return None
        path = scope["path"]
        root_path = scope.get("root_path", "")
        if root_path and path.startswith(root_path):
            path = path[len(root_path):]  # as Starlette routes it
        principal, refusal = self._principal(scope)
        if path in self.open_paths:
            if principal is not None:
                scope[PRINCIPAL_SCOPE_KEY] = principal
            return None
        if principal is None:
            return refusal
        if path in ADMIN_PATHS and not principal.is_admin:
            return ApiError(403, f"{path} needs an admin key; this key's role is {principal.role}",
                            code="insufficient_permissions")
        scope[PRINCIPAL_SCOPE_KEY] = principal
        return None

    def _principal(self, scope: Scope) -> tuple[Principal | None, ApiError | None]:
        for name, value in scope["headers"]:
            if name == b"authorization":
                if value[:len(_BEARER)].lower() != _BEARER:
                    return None, _unauthorized("the Authorization header must be 'Bearer YOUR_KEY'")
                principal = self.keys.principal_of(value[len(_BEARER):].strip())
                if principal is None:
                    return None, _unauthorized("Incorrect API key provided.")
                return principal, None
        return None, _unauthorized("You didn't provide an API key. Give it in an Authorization header using "
                                   "Bearer auth (Authorization: Bearer YOUR_KEY).")

    def tenant_of(self, scope: Scope, client_tenant: str, cache_salt: str) -> str:
        """The request's prefix-cache namespace: its key's tenant, the client's tenant (`user` or `x-tenant`) when
        trusted, and its cache salt, encoded so that no two different triples meet (`cache.hashing.tenant_salt`)."""
        principal = scope.get(PRINCIPAL_SCOPE_KEY, OPEN_ACCESS)
        return tenant_salt(principal.tenant, client_tenant if self.trust_tenant_header else "", cache_salt)

    def shows_cluster_state(self, scope: Scope) -> bool:
        """Whether details of the cluster (worker ids, why one was lost) may go to this request."""
        if not self.enabled:
            return True
        principal = scope.get(PRINCIPAL_SCOPE_KEY)
        return principal is not None and principal.is_admin


def is_loopback(host: str) -> bool:
    """Whether binding `host` reaches this machine alone: a loopback address, or a name resolving only to those."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(address.split("%")[0]).is_loopback for address in addresses)


def check_exposure(host: str, keys: ApiKeys | None, allow_unauthenticated: bool) -> None:
    """Deny by default: serving anything but loopback needs an API key, or an explicit `allow_unauthenticated`."""
    if (keys is None or len(keys) == 0) and not allow_unauthenticated and not is_loopback(host):
        raise KvbatonError(f"refusing to serve on {host or 'every address'} without an API key: give --api-key KEY "
                           "(or KVBATON_API_KEY, or --api-key-file FILE), or --allow-unauthenticated to serve it open")
