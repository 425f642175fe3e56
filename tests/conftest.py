"""Fixtures any test module may ask for by name (none applies by itself)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Torch on one thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`): tiny tensors run as
    fast, and immune to OpenMP spin-waits on a shared, oversubscribed CPU."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def store_node() -> Iterator[Callable[..., object]]:
    """Start live KV store nodes on 127.0.0.1 (`store_node(state, secret, host_id="", port=0)`, see
    tests/store_nodes.py); every one still running is stopped when the test ends."""
    from tests.store_nodes import RunningNode  # here: only tests of the store pay for importing it

    nodes: list[RunningNode] = []

    def start(*args: object, **kwargs: object) -> RunningNode:
        nodes.append(RunningNode(*args, **kwargs))  # type: ignore[arg-type]
        return nodes[-1]
    yield start
    for node in nodes:
        if node.thread.is_alive():
            node.stop()
