"""Which torch device a worker runs on: `--device cpu | cuda | cuda:N`, checked once, with a one-line error.

Every entry point (`kvbaton generate`, `worker`, `serve`, `LLM(device=...)`) resolves its device name here,
before anything loads, so a bad name or a CUDA device on a machine without one is a clear refusal instead of a
traceback from deep inside a tensor allocation. Nothing here touches CUDA when the name is `cpu`: CUDA is
queried only for a CUDA name.
"""

from __future__ import annotations

import re

import torch

from kvbaton.core.errors import InvalidRequestError

DEVICE_CHOICES = "cpu, cuda, cuda:N"
_CUDA_NAME = re.compile(r"cuda(?::(\d+))?")


def check_device_name(name: str) -> str:
    """`name` if it is a device kvbaton can be asked for (`cpu`, `cuda`, `cuda:N`), else InvalidRequestError.
    Only the spelling is checked: no CUDA query (the router checks its workers' flags this way)."""
    if name == "cpu" or _CUDA_NAME.fullmatch(name):
        return name
    raise InvalidRequestError(f"unknown device {name!r}; choose {DEVICE_CHOICES}")


def resolve_device(name: str) -> torch.device:
    """The torch device for `name`, present on this machine; InvalidRequestError otherwise."""
    check_device_name(name)
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InvalidRequestError(f"device {name!r} requested but CUDA is not available on this machine "
                                  f"(torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'})")
    match = _CUDA_NAME.fullmatch(name)
    assert match is not None
    index = int(match.group(1) or 0)
    count = torch.cuda.device_count()
    if index >= count:
        raise InvalidRequestError(f"device {name!r} requested but this machine shows {count} CUDA device(s) "
                                  f"(CUDA_VISIBLE_DEVICES narrows them)")
    return torch.device("cuda", index)


def is_accelerator(device: str | torch.device) -> bool:
    """True for a device whose memory the host cannot address directly (KV must be staged through host memory)."""
    return torch.device(device).type != "cpu"
