"""Fixtures the HTTP-layer tests share: the tiny-random tokenizer and a fresh fake cluster per test (each module
builds its own app over them, with its own context length and options)."""

from __future__ import annotations

import pytest

from kvbaton.model.registry import load_model
from kvbaton.model.tokenizer import Tokenizer
from tests.server.api_fakes import FakeCluster


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_model("tiny-random").tokenizer


@pytest.fixture()
def cluster(tokenizer: Tokenizer) -> FakeCluster:
    return FakeCluster(tokenizer)
