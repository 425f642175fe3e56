"""Fixtures any test module may ask for by name (none applies by itself)."""

from __future__ import annotations

from collections.abc import Iterator

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
