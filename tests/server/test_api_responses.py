"""/v1/responses with the official `openai` client against a real uvicorn server (fake cluster): plain, streamed
(typed events, and the client's `responses.stream`), multi-turn through `previous_response_id` with the prompt of
each turn extending the last one's ids and the cached tokens growing, a function call round trip, structured
output, retrieve and delete, and the refusals naming their field."""

from __future__ import annotations

import json
from collections.abc import Iterator

import openai
import pydantic
import pytest

from kvbaton.model.tokenizer import Tokenizer
from kvbaton.server.api import create_app
from kvbaton.server.auth import ApiAuth, ApiKeys, Principal
from kvbaton.server.responses_store import ResponseStore
from tests.server.api_fakes import REPLY, FakeCluster, ThreadedServer

MODEL = "tiny-random"
INSTRUCTIONS = "You are a terse assistant who answers in one short sentence, always."
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL_ANSWER = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


@pytest.fixture()
def server(cluster: FakeCluster, tokenizer: Tokenizer) -> Iterator[ThreadedServer]:
    app = create_app(cluster, tokenizer, MODEL, max_model_len=2048, tool_call_parser="hermes")
    running = ThreadedServer(app).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture()
def client(server: ThreadedServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=20.0) as oa:
        yield oa


def test_plain_create_retrieve_and_delete(client: openai.OpenAI, cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    response = client.responses.create(model=MODEL, input="Say hello.", instructions=INSTRUCTIONS,
                                       max_output_tokens=12, temperature=0.5, top_p=0.9, metadata={"run": "1"})
    assert response.id.startswith("resp_") and response.object == "response"
    assert response.output_text == REPLY[:12] and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage.output_tokens == 12 and response.instructions == INSTRUCTIONS
    assert response.temperature == 0.5 and response.top_p == 0.9 and response.metadata == {"run": "1"}
    (call,) = cluster.calls
    prompt = tokenizer.decode(list(call.prompt_token_ids), skip_special_tokens=False)
    assert prompt.startswith(f"<|im_start|>system\n{INSTRUCTIONS}<|im_end|>") and "Say hello." in prompt
    assert response.usage.input_tokens == len(call.prompt_token_ids)
    assert call.sampling.max_tokens == 12 and call.sampling.temperature == 0.5 and call.sampling.top_p == 0.9
    assert client.responses.retrieve(response.id).output_text == response.output_text
    client.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_a_stop_ends_it_completed(client: openai.OpenAI) -> None:
    response = client.responses.create(model=MODEL, input="Hi", extra_body={"stop": ["friendly"]})
    assert response.status == "completed" and response.output_text == REPLY[:REPLY.index("friendly")]


def test_streamed_events_in_order_and_the_clients_stream_helper(client: openai.OpenAI) -> None:
    events = list(client.responses.create(model=MODEL, input="Stream it.", max_output_tokens=10, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == REPLY[:10]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == REPLY[:10] and events[-1].response.usage.output_tokens == 10
    assert events[-1].response.status == "incomplete"
    with client.responses.stream(model=MODEL, input="Again.", max_output_tokens=8) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == REPLY[:8]
    assert client.responses.retrieve(final.id).output_text == REPLY[:8]  # a streamed response is stored too


def test_multi_turn_extends_the_previous_prompt_and_caches_it(client: openai.OpenAI, cluster: FakeCluster) -> None:
    first = client.responses.create(model=MODEL, input="Tell me about the fox. " * 4, instructions=INSTRUCTIONS,
                                    max_output_tokens=20)
    second = client.responses.create(model=MODEL, input="And the dog?", instructions=INSTRUCTIONS,
                                     previous_response_id=first.id, max_output_tokens=20)
    third = client.responses.create(model=MODEL, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Which is faster?"}]}], instructions=INSTRUCTIONS,
                                    previous_response_id=second.id, max_output_tokens=20)
    one, two, three = cluster.calls
    # Each turn's prompt is the previous turn's prompt ids, then the ids it generated, then the new turn.
    for before, after in ((one, two), (two, three)):
        produced = cluster.reply_ids[:20]
        assert after.prompt_token_ids[:len(before.prompt_token_ids) + 20] == before.prompt_token_ids + tuple(produced)
    cached = [r.usage.input_tokens_details.cached_tokens for r in (first, second, third)]
    assert cached[0] == 0 and cached[1] >= first.usage.input_tokens // 16 * 16 > 0 and cached[2] > cached[1]
    assert third.previous_response_id == second.id


def test_a_function_call_round_trip(client: openai.OpenAI, cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    cluster.reply_ids = tokenizer.encode(CALL_ANSWER)
    first = client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER],
                                    max_output_tokens=len(cluster.reply_ids))
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {
        "city": "Oslo"} and call.call_id.startswith("call_") and first.status == "completed"
    cluster.reply_ids = tokenizer.encode("It is sunny in Oslo.")
    second = client.responses.create(model=MODEL, tools=[WEATHER], previous_response_id=first.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}], max_output_tokens=20)
    assert second.output_text == "It is sunny in Oslo."
    prompt = tokenizer.decode(list(cluster.calls[1].prompt_token_ids), skip_special_tokens=False)
    assert prompt.index("Weather in Oslo?") < prompt.index("<|im_start|>tool\nsunny, 21 C<|im_end|>")
    # Streamed, the call arrives as typed function-call events.
    cluster.reply_ids = tokenizer.encode(CALL_ANSWER)
    events = list(client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[WEATHER], stream=True,
                                          max_output_tokens=len(cluster.reply_ids)))
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds
    assert kinds[-5:] == ["response.output_item.added", "response.function_call_arguments.delta",
                          "response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert json.loads(events[-3].arguments) == {"city": "Oslo"} and events[-1].response.output[0].name == "get_weather"


def test_a_forced_call_streams_its_arguments(client: openai.OpenAI, cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    cluster.reply_ids = tokenizer.encode('{"city": "Oslo"}')
    choice = {"type": "function", "name": "get_weather"}
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER], tool_choice=choice,
                                          stream=True, max_output_tokens=len(cluster.reply_ids)))
    assert cluster.calls[0].sampling.grammar  # the call is constrained to the function's parameters
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == '{"city": "Oslo"}'
    final = events[-1].response
    assert final.output[0].call_id == events[2].item.call_id and final.tool_choice.name == "get_weather"


class Verdict(pydantic.BaseModel):
    ok: bool


def test_structured_output_through_text_format(client: openai.OpenAI, cluster: FakeCluster,
                                               tokenizer: Tokenizer) -> None:
    cluster.reply_ids = tokenizer.encode('{"ok": true}')
    parsed = client.responses.parse(model=MODEL, input="Is it ok?", text_format=Verdict,
                                    max_output_tokens=len(cluster.reply_ids))
    assert parsed.output_parsed == Verdict(ok=True)
    assert cluster.calls[0].sampling.grammar and parsed.text.format.type == "json_schema"


def test_store_false_and_unknown_ids(client: openai.OpenAI) -> None:
    unstored = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="Hi", previous_response_id=unstored.id)
    assert missing.value.body["param"] == "previous_response_id"


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ({"input": ""}, "input"),
    ({}, "input"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format.schema"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "store": "yes"}, "store"),
])
def test_bad_input_is_a_400_naming_the_field(client: openai.OpenAI, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.post("/responses", body={"model": MODEL, **body}, cast_to=object)
    assert bad.value.body["param"] == param, bad.value.body


def test_another_tenant_cannot_read_or_continue_a_response(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    keys = ApiKeys([("sk-a", Principal("a", "user")), ("sk-b", Principal("b", "user"))])
    app = create_app(cluster, tokenizer, MODEL, max_model_len=1024, auth=ApiAuth(keys))
    running = ThreadedServer(app).start()
    try:
        with openai.OpenAI(base_url=f"{running.url}/v1", api_key="sk-a", max_retries=0) as a, \
                openai.OpenAI(base_url=f"{running.url}/v1", api_key="sk-b", max_retries=0) as b:
            made = a.responses.create(model=MODEL, input="mine", max_output_tokens=4)
            assert a.responses.retrieve(made.id).id == made.id
            with pytest.raises(openai.NotFoundError):
                b.responses.retrieve(made.id)
            with pytest.raises(openai.NotFoundError):
                b.responses.create(model=MODEL, input="x", previous_response_id=made.id)
            with pytest.raises(openai.NotFoundError):
                b.responses.delete(made.id)
    finally:
        running.stop()


def test_the_store_is_bounded_in_number_tokens_and_time(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    from kvbaton.server.responses_store import StoredResponse

    store = ResponseStore(max_num_responses=2, max_num_tokens=10, ttl_s=5.0)

    def entry(num_tokens: int, at: float) -> StoredResponse:
        return StoredResponse({}, "t", (), "", tuple(range(num_tokens)), (), at)

    store.put("a", entry(3, 0.0), 0.0)
    store.put("b", entry(3, 1.0), 1.0)
    store.put("c", entry(3, 2.0), 2.0)  # over the number bound: the oldest goes
    assert store.get("a", "t", 2.0) is None and store.get("b", "t", 2.0) is not None and len(store) == 2
    store.put("d", entry(8, 3.0), 3.0)  # over the token bound: older ones go until it fits
    assert [k for k in "bcd" if store.get(k, "t", 3.0)] == ["d"] and store.num_tokens == 8
    store.put("e", entry(11, 3.0), 3.0)  # larger than the whole bound: not kept
    assert store.get("e", "t", 3.0) is None
    assert store.get("d", "other", 3.0) is None  # another tenant's reads as missing
    assert store.get("d", "t", 7.9) is not None and store.get("d", "t", 8.0) is None  # the TTL
    assert len(store) == 0 and store.num_tokens == 0


def test_auto_without_a_parser_says_how_to_name_a_function(cluster: FakeCluster, tokenizer: Tokenizer) -> None:
    from fastapi.testclient import TestClient

    with TestClient(create_app(cluster, tokenizer, MODEL, max_model_len=1024)) as plain:
        r = plain.post("/v1/responses", json={"input": "hi", "tools": [WEATHER]})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == "tool_choice"
    assert "{'type': 'function', 'name': ...}" in error["message"]
