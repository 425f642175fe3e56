"""The tenant of a request comes from its API key: a client's `user` or x-tenant is ignored unless the server trusts
a gateway's header (--trust-tenant-header), and then only divides the key's tenant; two tenant/salt pairs that the
old encoding ("{tenant}\\x1fsalt:{salt}") made equal now name two namespaces."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.cache.hashing import CacheKey, tenant_salt
from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from kvbaton.server.auth import USER, ApiAuth, ApiKeys, Principal
from tests.server.api_fakes import FakeCluster

MODEL = "tiny-random"
ALICE, BOB = "sk-alice-000000000000", "sk-bob-1111111111111"
PROMPT = "a long shared system prompt that fills several blocks, " * 2


def _app_client(cluster: FakeCluster, tokenizer: Tokenizer, trust: bool) -> TestClient:
    auth = ApiAuth(ApiKeys([(ALICE, Principal("alice", USER)), (BOB, Principal("bob", USER))]),
                   trust_tenant_header=trust)
    return TestClient(create_app(cluster, tokenizer, MODEL, max_model_len=256, auth=auth))


@pytest.fixture()
def client(cluster: FakeCluster, tokenizer: Tokenizer) -> Iterator[TestClient]:
    with _app_client(cluster, tokenizer, trust=False) as test_client:
        yield test_client


@pytest.fixture()
def trusting(cluster: FakeCluster, tokenizer: Tokenizer) -> Iterator[TestClient]:
    with _app_client(cluster, tokenizer, trust=True) as test_client:
        yield test_client


def cached(client: TestClient, key: str, headers: dict[str, str] | None = None, **fields: object) -> int:
    """The prompt's cached tokens as the answer reports them (the fake cluster shares prefixes within a tenant)."""
    r = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, **fields},
                    headers={"Authorization": f"Bearer {key}", **(headers or {})})
    assert r.status_code == 200, r.text
    return int(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_the_tenant_is_the_keys(client: TestClient, cluster: FakeCluster) -> None:
    assert cached(client, ALICE) == 0
    assert cached(client, BOB) == 0  # bob finds nothing of alice's
    assert cached(client, ALICE) > 0
    assert [call.tenant for call in cluster.calls] == [tenant_salt("alice"), tenant_salt("bob"), tenant_salt("alice")]


def test_a_tenant_header_without_trust_is_ignored(client: TestClient, cluster: FakeCluster) -> None:
    assert cached(client, ALICE) == 0
    # Bob names alice's tenant both ways a client can; without --trust-tenant-header it changes nothing: he finds
    # none of alice's blocks, then his own.
    assert cached(client, BOB, user="alice") == 0
    assert cached(client, BOB, {"x-tenant": "alice"}) > 0
    assert cached(client, BOB, {"x-tenant": tenant_salt("alice")}, user=tenant_salt("alice")) > 0
    assert {call.tenant for call in cluster.calls[1:]} == {tenant_salt("bob")}


def test_a_trusted_tenant_header_divides_the_keys_tenant_and_never_replaces_it(trusting: TestClient,
                                                                               cluster: FakeCluster) -> None:
    assert cached(trusting, ALICE, {"x-tenant": "team-1"}) == 0
    assert cached(trusting, ALICE, {"x-tenant": "team-2"}) == 0  # another team of alice's
    assert cached(trusting, BOB, {"x-tenant": "team-1"}) == 0  # bob's team-1 is not alice's
    assert cached(trusting, BOB, user="alice") == 0  # nor does naming alice make bob alice
    assert cached(trusting, ALICE, {"x-tenant": "team-1"}) > 0
    assert cluster.calls[0].tenant == tenant_salt("alice", "team-1")
    assert cluster.calls[3].tenant == tenant_salt("bob", "alice")


def test_tenant_and_salt_pairs_that_used_to_collide_stay_apart(trusting: TestClient, cluster: FakeCluster) -> None:
    # The old encoding joined them as f"{tenant}\x1fsalt:{salt}": both of these were "a\x1fsalt:b".
    assert cached(trusting, ALICE, user="a", cache_salt="b") == 0
    assert cached(trusting, ALICE, user="a\x1fsalt:b") == 0
    # And length-prefixed parts cannot be shifted from one field into the next either.
    assert cached(trusting, ALICE, user="a1:b", cache_salt="c") == 0
    assert cached(trusting, ALICE, user="a", cache_salt="b1:c") == 0
    assert len({call.tenant for call in cluster.calls}) == 4
    assert cached(trusting, ALICE, user="a", cache_salt="b") > 0  # the same pair again: its own cache


_PART = st.text(alphabet=st.sampled_from("ab:0123\x1f|salt"), max_size=6)


@settings(max_examples=2000, deadline=None, derandomize=True)
@given(first=st.tuples(_PART, _PART, _PART), second=st.tuples(_PART, _PART, _PART))
def test_tenant_salt_is_injective(first: tuple[str, str, str], second: tuple[str, str, str]) -> None:
    """Two different (key tenant, client tenant, cache salt) triples never share a salt, hence never a CacheKey:
    the alphabet is the one an attacker would use (separators, digits that look like length prefixes)."""
    if first != second:
        assert tenant_salt(*first) != tenant_salt(*second)
        key = CacheKey("rev", "layout")
        assert key.with_tenant(tenant_salt(*first)) != key.with_tenant(tenant_salt(*second))
    assert (tenant_salt(*first) == "") == (first == ("", "", ""))
