"""kvbaton: distributed LLM serving with prefix-aware routing and prefill/decode disaggregation.

The heavy entry point (`LLM`, which imports torch) is resolved lazily so that importing a
policy-core module never pulls torch in.
"""

from kvbaton.core.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> object:
    if name == "LLM":
        from kvbaton.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvbaton' has no attribute {name!r}")
