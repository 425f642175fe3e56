"""Text <-> token ids for a model: byte-level BPE (from GGUF metadata, a Hugging Face directory or built in),
the chat template, and incremental detokenization for streaming."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

import jinja2
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as BackendTokenizer

from kvbaton.core.errors import InvalidRequestError, UnsupportedModelError
from kvbaton.model.chat_template import compile_chat_template, unused_sentinel, validated_messages
from kvbaton.model.token_cache import DEFAULT_MAX_CACHED_CHARS, TokenizationCache

# llama.cpp's token types (tokenizer.ggml.token_type).
_GGUF_TOKEN_CONTROL = 3
_GGUF_TOKEN_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies are spelled in."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def _pre_tokenizer_for(pre_name: str) -> pre_tokenizers.PreTokenizer:
    """The split a vocabulary's merges were learned with, by llama.cpp's `tokenizer.ggml.pre` name."""
    if pre_name == "smollm":
        # Digits one by one first, then the GPT-2 pattern (SmolLM's own tokenizer.json does the same).
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre_name in ("gpt2", "default"):
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    split = {"llama3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}.get(pre_name)
    if split is None:
        raise UnsupportedModelError(
            f"GGUF pre-tokenizer {pre_name!r} is not supported (supported: smollm, gpt2, default, llama-bpe, "
            "llama3, qwen2)"
        )
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


class Tokenizer:
    """A `tokenizers` tokenizer plus what a server needs around it: BOS policy, EOS, specials, chat template."""

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos_token: bool,
        chat_template: str | None,
        byte_level_words: bool = False,
    ) -> None:
        """`byte_level_words`: the pre-tokenizer is one of the byte-level BPE patterns (GPT-2, Llama-3,
        Qwen2), which always cut before " word" after a letter (see `TokenizationCache`)."""
        self._backend = backend
        self._byte_level_words = byte_level_words
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos_token = add_bos_token
        self.chat_template = chat_template
        added = backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, token in added.items() if token.special)
        self._cache: TokenizationCache | None = None

    @property
    def vocab_size(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def backend_json(self) -> str:
        """The `tokenizers` tokenizer serialized (tokenizer.json's content)."""
        return self._backend.to_str()

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of a raw prompt; BOS is prepended only when the model's tokenizer says `add_bos_token`.
        A chat template's output passes `add_bos=False`: the template writes its own `bos_token` (as
        transformers and vLLM tokenize it, without special tokens).

        Special tokens written in the text (`<|im_start|>`) are recognised, as chat templates rely on it.
        """
        ids = self._cache.encode(text) if self._cache is not None else self._backend.encode(
            text, add_special_tokens=False).ids
        if add_bos and self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return list(ids)

    def enable_cache(self, max_cached_chars: int = DEFAULT_MAX_CACHED_CHARS) -> TokenizationCache:
        """From now on `encode` reuses earlier results (`TokenizationCache`): whole texts, and prefixes cut
        after an added token that leaves its neighbours alone (`_split_tokens`) or, for byte-level BPE, between
        words."""
        added = self._backend.get_added_tokens_decoder()

        def encode_with_offsets(text: str) -> tuple[list[int], list[tuple[int, int]]]:
            encoding = self._backend.encode(text, add_special_tokens=False)
            return encoding.ids, encoding.offsets

        # An added token holding or stripping whitespace could swallow the space a word split cuts at.
        words = self._byte_level_words and not any(
            token.lstrip or token.rstrip or any(c.isspace() for c in token.content) for token in added.values())
        self._cache = TokenizationCache(encode_with_offsets, _split_tokens(self._backend), split_at_words=words,
                                        max_cached_chars=max_cached_chars)
        return self._cache

    @property
    def cache(self) -> TokenizationCache | None:
        return self._cache

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, object]] = (), continue_final_message: bool = False,
                            template_kwargs: Mapping[str, object] | None = None) -> str:
        """The prompt text for a conversation; InvalidRequestError for a malformed message list. `tools` (OpenAI's
        function list) are given to the template as transformers gives them; a template may ignore them.
        `continue_final_message` leaves the last message open (the text ends where its content ends, as
        transformers cuts it), so the model continues it; `template_kwargs` are extra template variables."""
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt cannot both be true")
        if self.chat_template is None:
            raise InvalidRequestError("this model has no chat template; use a completion request instead")
        validated = validated_messages(messages)
        if not continue_final_message:
            return self._render(validated, add_generation_prompt, tools, template_kwargs)
        final = str(validated[-1]["content"])
        if not final:
            raise InvalidRequestError("continue_final_message: the final message's content is empty")
        # As transformers does: mark where the final message's content ends, render, and cut at the mark.
        # Searching the rendering for the content itself could match template text after the message.
        sentinel = unused_sentinel(repr((validated, tools, template_kwargs)) + self.chat_template)
        validated[-1] = {**validated[-1], "content": final + sentinel}
        rendered = self._render(validated, add_generation_prompt, tools, template_kwargs)
        mark = sentinel.rstrip()
        if rendered.count(mark) != 1:
            raise InvalidRequestError("continue_final_message: the chat template does not render the final message's "
                                      "content exactly once")
        cut = rendered.index(mark)
        prompt, content_end = rendered[:cut], final
        if not rendered.startswith(sentinel, cut):
            # The template trimmed the content, and with it the mark's trailing space: trim before the mark too.
            prompt, content_end = prompt.rstrip(), final.strip()
        if not prompt.endswith(content_end):
            raise InvalidRequestError("continue_final_message: the chat template changes the end of the final "
                                      "message's content")
        return prompt

    def _render(self, messages: list[dict[str, object]], add_generation_prompt: bool,
                tools: Sequence[Mapping[str, object]], template_kwargs: Mapping[str, object] | None) -> str:
        bos = self.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""
        eos = self.id_to_token(self.eos_token_id) if self.eos_token_id is not None else ""
        try:
            extra = {**(template_kwargs or {}), **({"tools": list(tools)} if tools else {})}
            return compile_chat_template(self.chat_template).render(  # type: ignore[arg-type]
                **{**extra, "messages": messages, "add_generation_prompt": add_generation_prompt, "bos_token": bos,
                   "eos_token": eos})
        except (jinja2.TemplateError, TypeError, ValueError) as exc:  # a template may also trip over odd values
            raise InvalidRequestError(f"chat template failed on these messages: {exc}") from exc

    def save_pretrained(self, directory: str | Path) -> None:
        """Write tokenizer.json + tokenizer_config.json, the files `from_hf_dir` reads back."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"))
        config: dict[str, object] = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos_token}
        if self.bos_token_id is not None:
            config["bos_token"] = self.id_to_token(self.bos_token_id)
        if self.eos_token_id is not None:
            config["eos_token"] = self.id_to_token(self.eos_token_id)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, object]) -> Tokenizer:
        """Byte-level BPE from GGUF `tokenizer.*` keys (plain Python values, e.g. from `field.contents()`)."""
        kind = metadata.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise UnsupportedModelError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')"
            )
        tokens = list(metadata["tokenizer.ggml.tokens"])  # type: ignore[call-overload]
        merges = [tuple(merge.split(" ", 1)) for merge in metadata.get("tokenizer.ggml.merges", [])]  # type: ignore[attr-defined]
        token_types = list(metadata.get("tokenizer.ggml.token_type", []))  # type: ignore[call-overload]
        alphabet = set(bytes_to_unicode().values())
        spelling = bytes_to_unicode()
        # Tokens outside the byte alphabet are stored as text; BPE needs them spelled in bytes.
        vocab = {
            token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
            for index, token in enumerate(tokens)
        }
        backend = BackendTokenizer(
            models.BPE(vocab=vocab, merges=merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
        )
        backend.pre_tokenizer = _pre_tokenizer_for(str(metadata.get("tokenizer.ggml.pre", "default")))
        backend.decoder = decoders.ByteLevel()
        # Control tokens are matched whole and skipped on decode; a "control" token spelled outside the
        # byte alphabet is a llama.cpp mislabel and would not round-trip, so it stays ordinary.
        control = [
            AddedToken(token, special=True, normalized=False)
            for token, kind_id in zip(tokens, token_types)
            if kind_id == _GGUF_TOKEN_CONTROL and set(token) <= alphabet
        ]
        user_defined = [
            AddedToken(token, special=False, normalized=False)
            for token, kind_id in zip(tokens, token_types)
            if kind_id == _GGUF_TOKEN_USER_DEFINED and token in vocab
        ]
        backend.add_special_tokens(control)
        backend.add_tokens(user_defined)
        bos = metadata.get("tokenizer.ggml.bos_token_id")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            bos_token_id=int(bos) if bos is not None else None,  # type: ignore[call-overload]
            eos_token_id=int(eos) if eos is not None else None,  # type: ignore[call-overload]
            add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=metadata.get("tokenizer.chat_template"),  # type: ignore[arg-type]
            byte_level_words=True,  # every pattern _pre_tokenizer_for builds
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) of a Hugging Face model directory."""
        directory = Path(path)
        tokenizer_file = directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise UnsupportedModelError(f"{directory} has no tokenizer.json (only fast tokenizers are supported)")
        try:
            backend = BackendTokenizer.from_file(str(tokenizer_file))
            config_file = directory / "tokenizer_config.json"
            config = json.loads(config_file.read_text()) if config_file.is_file() else {}
        except Exception as exc:  # tokenizers raises a bare Exception on bad JSON
            raise UnsupportedModelError(f"cannot read the tokenizer in {directory}: {exc}") from exc
        if not isinstance(config, dict):
            raise UnsupportedModelError(f"{config_file} does not hold a JSON object")
        template = config.get("chat_template")
        template_file = directory / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise UnsupportedModelError(f"{directory}: chat_template must be a string or a list of named templates")
        add_bos = config.get("add_bos_token")
        if add_bos is None:
            # No flag: the tokenizer.json post-processor decides; probe whether it inserts a BOS.
            add_bos = _post_processor_adds_prefix(backend)
        return cls(
            backend,
            bos_token_id=_token_id(backend, config.get("bos_token")),
            eos_token_id=_token_id(backend, config.get("eos_token")),
            add_bos_token=bool(add_bos),
            chat_template=template,
        )

    @classmethod
    def byte_level(cls, vocab_size: int = 384) -> Tokenizer:
        """The tiny-random model's tokenizer: 0-2 specials (bos 1, eos 2), 256 byte tokens, reserved specials."""
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        if vocab_size < len(specials) + 256:
            raise InvalidRequestError(f"byte-level vocab_size must be at least {len(specials) + 256}, got {vocab_size}")
        reserved = [f"<|reserved_{i}|>" for i in range(vocab_size - len(specials) - 256)]
        byte_tokens = [bytes_to_unicode()[b] for b in range(256)]
        vocab = {token: index for index, token in enumerate(specials + byte_tokens + reserved)}
        backend = BackendTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials + reserved])
        return cls(backend, bos_token_id=1, eos_token_id=2, add_bos_token=False, chat_template=TINY_CHAT_TEMPLATE,
                   byte_level_words=True)


def _token_id(backend: BackendTokenizer, token: object) -> int | None:
    """Id of a tokenizer_config special token, given as a string or as an AddedToken dict."""
    if isinstance(token, Mapping):
        token = token.get("content")
    if not isinstance(token, str):
        return None
    return backend.token_to_id(token)


def _split_tokens(backend: BackendTokenizer) -> dict[str, int]:
    """The added tokens after which the tokenizer cuts, whatever follows, and tokenizes the rest as it would alone
    (`TokenizationCache`'s split points), text -> id. It matches all its added tokens in the raw text at once
    (leftmost-longest), then tokenizes the segments between them one by one. A token qualifies unless it changes its
    neighbours (strips whitespace, matches whole words only) or is matched in normalized text; unless a token that
    strips or matches whole words holds it with text after it (whether that one matches is decided past the split);
    unless it may end with a word character while a token matches whole words only (which looks at the character
    before it); and never where the pre-tokenizer treats the text's first segment unlike the others."""
    if _marks_the_first_segment(backend.pre_tokenizer):
        return {}
    added = backend.get_added_tokens_decoder()
    picky = [token for token in added.values() if not token.normalized
             and (token.lstrip or token.rstrip or token.single_word)]
    whole_words = any(token.single_word for token in picky)
    return {token.content: token_id for token_id, token in added.items()
            if not (token.lstrip or token.rstrip or token.single_word or token.normalized)
            and not any(token.content in other.content[:-1] for other in picky)
            and not (whole_words and _may_end_a_word(token.content))}


def _may_end_a_word(text: str) -> bool:
    """Conservatively: only an ASCII punctuation mark or space surely is no word character (alphanumeric, "_")."""
    last = text[-1:]
    return not last.isascii() or last.isalnum() or last == "_"


def _marks_the_first_segment(pre_tokenizer: pre_tokenizers.PreTokenizer | None) -> bool:
    """Whether the pre-tokenizer treats the text's first segment (before any added token) unlike the others:
    Metaspace with prepend_scheme "first" (Llama-2 and Mistral tokenizer.json from recent transformers) prepends its
    "▁" to that segment alone, so the text after an added token is tokenized otherwise than on its own."""
    if pre_tokenizer is None:
        return False

    def marks(node: object) -> bool:
        if isinstance(node, dict):
            first = node.get("type") == "Metaspace" and node.get("prepend_scheme") == "first"
            return first or any(map(marks, node.values()))
        return isinstance(node, list) and any(map(marks, node))

    return marks(json.loads(pre_tokenizer.__getstate__()))


def _post_processor_adds_prefix(backend: BackendTokenizer) -> bool:
    with_specials = backend.encode("a", add_special_tokens=True).ids
    without = backend.encode("a", add_special_tokens=False).ids
    return len(with_specials) > len(without) and with_specials[-len(without):] == without


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, never splitting a multi-byte UTF-8 character.

    vLLM's technique: decode the window `[prefix_offset, read_offset)` already shown and the window
    `[prefix_offset, end)`; the difference is new text, released only once it does not end in U+FFFD
    (an incomplete byte sequence). Both windows start where all earlier text was complete, so decoding
    them in isolation gives the same characters as decoding everything.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Append one generated token; return the text it completes ("" while a character is still partial)."""
        self._ids.append(token_id)
        shown = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset], self._skip_special_tokens)
        full = self._tokenizer.decode(self._ids[self._prefix_offset :], self._skip_special_tokens)
        if len(full) > len(shown) and not full.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full[len(shown) :]
        return ""
