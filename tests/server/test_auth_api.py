"""API keys at the HTTP layer, attack by attack: no key, a wrong key, a malformed header, a user key on an admin
route, each on every route (the four answered straight from `RouterApp.__call__` included); what stays open;
and that no key ever reaches a log line or a response."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from kvbaton.core.errors import KvbatonError
from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from kvbaton.server.auth import ADMIN, USER, ApiAuth, ApiKeys, Principal, check_exposure, is_loopback
from tests.server.api_fakes import FakeCluster

MODEL = "tiny-random"
USER_KEY = "sk-user-0123456789abcdef"
ADMIN_KEY = "sk-admin-fedcba9876543210"
COMPLETION = {"prompt": "Hello there", "max_tokens": 3}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
# Every route that needs a key: (method, path, JSON body or None). The first four are the direct routes.
KEYED_ROUTES = [
    ("POST", "/v1/completions", COMPLETION),
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/tokenize", {"prompt": "Hello"}),
    ("POST", "/detokenize", {"tokens": [72, 105]}),
    ("GET", "/v1/models", None),
    ("GET", "/cluster", None),
    ("POST", "/reset_prefix_cache", None),
    ("GET", "/no/such/path", None),  # a key first, then the 404: nobody probes the server's paths without one
]
ADMIN_ROUTES = [("GET", "/cluster", None), ("POST", "/reset_prefix_cache", None)]


def keys() -> ApiKeys:
    return ApiKeys([(USER_KEY, Principal("acme", USER)), (ADMIN_KEY, Principal("ops", ADMIN))])


@pytest.fixture()
def client(cluster: FakeCluster, tokenizer: Tokenizer) -> Iterator[TestClient]:
    app = create_app(cluster, tokenizer, MODEL, max_model_len=256, auth=ApiAuth(keys()))
    with TestClient(app) as test_client:
        yield test_client


def _send(client: TestClient, method: str, path: str, body: object,  # type: ignore[no-untyped-def]
          headers: dict[str, str] | None = None):
    return client.request(method, path, json=body, headers=headers or {})


def _assert_openai_error(response, status: int, code: str) -> None:  # type: ignore[no-untyped-def]
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code
    assert isinstance(error["message"], str) and error["type"] == "invalid_request_error"


def _nothing_reached_the_cluster(cluster: FakeCluster) -> None:
    assert cluster.calls == [] and cluster.num_resets == 0


@pytest.mark.parametrize(("method", "path", "body"), KEYED_ROUTES)
def test_a_request_without_a_key_is_refused_with_401_before_anything_runs(
        client: TestClient, cluster: FakeCluster, method: str, path: str, body: object) -> None:
    response = _send(client, method, path, body)
    _assert_openai_error(response, 401, "invalid_api_key")
    assert response.headers["www-authenticate"] == "Bearer"
    _nothing_reached_the_cluster(cluster)


@pytest.mark.parametrize(("method", "path", "body"), KEYED_ROUTES)
@pytest.mark.parametrize("authorization", [f"Bearer {USER_KEY}x", f"Bearer {USER_KEY[:-1]}", "Bearer ",
                                           f"Basic {USER_KEY}", USER_KEY, f"Bearer {USER_KEY.upper()}"])
def test_a_wrong_or_malformed_key_is_refused_with_401(client: TestClient, cluster: FakeCluster, method: str,
                                                      path: str, body: object, authorization: str) -> None:
    response = _send(client, method, path, body, {"Authorization": authorization})
    _assert_openai_error(response, 401, "invalid_api_key")
    assert USER_KEY[:12] not in response.text  # the presented key is not echoed back
    _nothing_reached_the_cluster(cluster)


@pytest.mark.parametrize(("method", "path", "body"), ADMIN_ROUTES)
def test_a_user_key_on_an_admin_route_is_refused_with_403(client: TestClient, cluster: FakeCluster, method: str,
                                                          path: str, body: object) -> None:
    response = _send(client, method, path, body, {"Authorization": f"Bearer {USER_KEY}"})
    _assert_openai_error(response, 403, "insufficient_permissions")
    _nothing_reached_the_cluster(cluster)
    admin = _send(client, method, path, body, {"Authorization": f"Bearer {ADMIN_KEY}"})
    assert admin.status_code == 200, admin.text
    assert cluster.num_resets == (1 if path == "/reset_prefix_cache" else 0)


@pytest.mark.parametrize("key", [USER_KEY, ADMIN_KEY])
@pytest.mark.parametrize(("method", "path", "body"), [r for r in KEYED_ROUTES if r not in ADMIN_ROUTES][:5])
def test_either_role_may_generate_and_read_the_model(client: TestClient, cluster: FakeCluster, key: str,
                                                     method: str, path: str, body: object) -> None:
    # The scheme is case-insensitive (RFC 6750); the key is not.
    response = _send(client, method, path, body, {"Authorization": f"bearer {key}"})
    assert response.status_code == 200, response.text


def test_streamed_generation_with_a_key_and_without(client: TestClient, cluster: FakeCluster) -> None:
    with client.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True},
                       headers={"Authorization": f"Bearer {USER_KEY}"}) as response:
        assert response.status_code == 200 and "data: [DONE]" in response.read().decode()
    refused = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    _assert_openai_error(refused, 401, "invalid_api_key")
    assert len(cluster.calls) == 1


def test_health_ready_metrics_and_the_openapi_document_stay_open(client: TestClient, cluster: FakeCluster) -> None:
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert client.get(path).status_code == 200, path
    # /ready says why only to an admin: the reason names workers and lost processes.
    assert client.get("/ready").json() == {"ready": True, "reason": "ready"}
    assert client.get("/ready", headers={"Authorization": f"Bearer {USER_KEY}"}).json()["reason"] == "ready"
    assert client.get("/ready", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()["reason"] == \
        "1 fake worker live"
    assert client.get("/health", headers={"Authorization": "Bearer wrong"}).status_code == 200  # open is open


def test_metrics_need_a_key_with_metrics_require_key(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    app = create_app(cluster, tokenizer, MODEL, max_model_len=256, auth=ApiAuth(keys(), metrics_require_key=True))
    with TestClient(app) as client:
        _assert_openai_error(client.get("/metrics"), 401, "invalid_api_key")
        assert client.get("/metrics", headers={"Authorization": f"Bearer {USER_KEY}"}).status_code == 200
        assert client.get("/health").status_code == 200


def test_without_keys_every_route_is_open_as_before(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    with TestClient(create_app(cluster, tokenizer, MODEL, max_model_len=256)) as client:
        for method, path, body in KEYED_ROUTES[:-1]:
            assert _send(client, method, path, body).status_code == 200, path
        assert client.get("/ready").json()["reason"] == "1 fake worker live"


def test_keys_never_reach_a_log_line_a_repr_or_a_response(client: TestClient, caplog: pytest.LogCaptureFixture
                                                          ) -> None:
    caplog.set_level(logging.DEBUG)
    responses = [_send(client, method, path, body, {"Authorization": f"Bearer {key}"})
                 for key in (USER_KEY, ADMIN_KEY, "sk-guess-00000000") for method, path, body in KEYED_ROUTES]
    texts = [caplog.text, repr(keys()), repr(ApiAuth(keys()).keys), *(r.text for r in responses)]
    for key in (USER_KEY, ADMIN_KEY, "sk-guess-00000000"):
        assert not any(key in text for text in texts)
    assert repr(keys()) == "ApiKeys(2 keys)"


def test_key_lookup_keeps_digests_only_and_confirms_with_compare_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    from kvbaton.server import auth

    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    api_keys = keys()
    assert USER_KEY.encode() not in repr(vars(api_keys)).encode()  # no plaintext key kept
    assert api_keys.principal_of(USER_KEY.encode()) == Principal("acme", USER)
    assert compared and all(len(a) == len(b) == 32 for a, b in compared)  # whole SHA-256 digests, equal lengths
    assert api_keys.principal_of(b"sk-user-0123456789abcdeX") is None


@pytest.mark.parametrize("bad", [[("", Principal("", USER))], [(" k", Principal("", USER))],
                                 [("k", Principal("", "root"))],
                                 [("k", Principal("a", USER)), ("k", Principal("b", USER))]])
def test_bad_key_configurations_are_refused(bad: list[tuple[str, Principal]]) -> None:
    with pytest.raises(KvbatonError):
        ApiKeys(bad)


def test_deny_by_default_off_loopback() -> None:
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert is_loopback(host)
        check_exposure(host, None, False)
    for host in ("0.0.0.0", "::", "", "10.1.2.3"):
        assert not is_loopback(host)
        with pytest.raises(KvbatonError, match="refusing to serve on .* without an API key"):
            check_exposure(host, ApiKeys(), False)
        check_exposure(host, keys(), False)  # a key: allowed
        check_exposure(host, None, True)  # --allow-unauthenticated: allowed, explicitly
