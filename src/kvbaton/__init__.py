"""kvbaton: distributed LLM serving with prefix-aware routing and prefill/decode disaggregation.

The heavy entry point (`LLM`, which imports torch) is resolved lazily so that importing a
policy-core module never pulls torch in.
"""

import os as _os

if _os.path.exists(_os.path.join(_os.path.dirname(__file__), "compiled_manifest.json")):  # `make compiled` ran
    from kvbaton.compiled import check_fresh as _check_fresh

    _check_fresh()  # compiled modules older than their sources: ImportError, never stale code

from kvbaton.core.sampling import SamplingParams  # noqa: E402

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> object:
    if name == "LLM":
        from kvbaton.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvbaton' has no attribute {name!r}")
