"""The served OpenAPI document describes the real request bodies: every field the hand-written parsers read from a
body is a property of the route that reads it, the direct routes included, and the document lists every route."""

from __future__ import annotations

import ast
from pathlib import Path

from fastapi.testclient import TestClient

from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from kvbaton.server.auth import ADMIN, ApiAuth, ApiKeys, Principal
from tests.server.api_fakes import FakeCluster

SERVER = Path(__file__).resolve().parents[2] / "src" / "kvbaton" / "server"
PARSERS = ("protocol.py", "protocol_structured.py", "tool_calls.py", "responses_protocol.py")
READERS = {"_int", "_float", "_bool", "_str"}


def fields_read_from_a_body() -> set[str]:
    """Every string the parsers look up in a request body: `body.get("x")`, `_int(body, "x", ...)` and the
    field tables they loop over (refused vLLM fields, structured-output fields)."""
    names: set[str] = set()
    for module in PARSERS:
        tree = ast.parse((SERVER / module).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Name) \
                    and node.args[0].id == "body":
                is_reader = isinstance(node.func, ast.Name) and node.func.id in READERS
                if is_reader and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                    names.add(node.args[1].value)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "body" \
                    and node.args and isinstance(node.args[0], ast.Constant):
                names.add(node.args[0].value)
    from kvbaton.server.protocol import _UNSUPPORTED_VLLM_FIELDS
    from kvbaton.server.protocol_structured import STRUCTURED_FIELDS
    from kvbaton.server.responses_protocol import _PASSED_THROUGH, _REFUSED

    return names | set(_UNSUPPORTED_VLLM_FIELDS) | set(STRUCTURED_FIELDS) | set(_PASSED_THROUGH) | set(_REFUSED)


def document(cluster: FakeCluster, tokenizer: Tokenizer, **auth: object) -> dict[str, object]:
    app = create_app(cluster, tokenizer, "tiny-random", max_model_len=256, **auth)  # type: ignore[arg-type]
    with TestClient(app) as client:
        response = client.get("/openapi.json")
        assert response.status_code == 200
        return response.json()  # type: ignore[no-any-return]


def _body_properties(doc: dict[str, object], path: str) -> set[str]:
    operation = doc["paths"][path]["post"]  # type: ignore[index]
    return set(operation["requestBody"]["content"]["application/json"]["schema"]["properties"])


def test_every_field_a_parser_reads_is_in_the_document(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    doc = document(cluster, tokenizer)
    routes = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize")
    described = set().union(*(_body_properties(doc, path) for path in routes))
    read = fields_read_from_a_body()
    assert len(read) > 40
    assert read <= described, f"read by the parsers, missing from /openapi.json: {sorted(read - described)}"
    assert {"prompt", "echo", "logprobs", "n", "cache_salt"} <= _body_properties(doc, "/v1/completions")
    assert {"messages", "tools", "tool_choice", "top_logprobs", "max_completion_tokens"} <= _body_properties(
        doc, "/v1/chat/completions")
    assert {"prompt", "messages", "return_token_strs"} <= _body_properties(doc, "/tokenize")
    from kvbaton.server.responses_protocol import _PASSED_THROUGH, _REFUSED

    assert {"input", "instructions", "previous_response_id", "store", "text", "max_output_tokens",
            *_PASSED_THROUGH, *_REFUSED} <= _body_properties(doc, "/v1/responses")
    assert _body_properties(doc, "/detokenize") == {"model", "tokens"}


def test_every_route_of_the_app_is_in_the_document(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    app = create_app(cluster, tokenizer, "tiny-random", max_model_len=256)
    served = {route.path for route in app.routes  # type: ignore[attr-defined]
              if getattr(route, "include_in_schema", True)}
    assert served == set(document(cluster, tokenizer)["paths"])  # type: ignore[arg-type]


def test_with_keys_the_document_names_the_bearer_scheme_and_the_open_routes(cluster: FakeCluster,
                                                                           tokenizer: Tokenizer) -> None:
    auth = ApiAuth(ApiKeys([("sk-admin-1", Principal("", ADMIN))]))
    doc = document(cluster, tokenizer, auth=auth)
    assert doc["security"] == [{"bearer": []}]
    paths = doc["paths"]
    assert paths["/health"]["get"]["security"] == []  # type: ignore[index]
    assert paths["/metrics"]["get"]["security"] == []  # type: ignore[index]
    assert "security" not in paths["/cluster"]["get"]  # type: ignore[index]
    assert "401" in paths["/v1/completions"]["post"]["responses"]  # type: ignore[index]
    open_doc = document(cluster, tokenizer)
    assert "401" not in open_doc["paths"]["/v1/completions"]["post"]["responses"]  # type: ignore[index]
