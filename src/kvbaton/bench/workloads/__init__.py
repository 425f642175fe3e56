"""Workload registry: `create_workload(name, ...)` turns a named family into timed `WorkloadRequest`s.

One module per family; this module seeds the random streams (content and arrivals separately,
so changing the arrival process never changes the prompts) and assigns arrival times.
"""

from __future__ import annotations

import inspect
import math
import numbers
import random
import types
import typing
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvbaton.bench.arrivals import create_arrivals
from kvbaton.bench.tokens import DEFAULT_VOCAB_SIZE, check_vocab_size
from kvbaton.bench.workloads.agent import generate_agent
from kvbaton.bench.workloads.base import Draft, WorkloadFamily, WorkloadRequest
from kvbaton.bench.workloads.context_qa import generate_long_doc_qa, generate_video_qa
from kvbaton.bench.workloads.conversation import generate_conversation
from kvbaton.bench.workloads.distserve import generate_distserve_sharegpt
from kvbaton.bench.workloads.hot_prefix import generate_hot_prefix_burst
from kvbaton.bench.workloads.mooncake import generate_mooncake
from kvbaton.bench.workloads.prefix_library import generate_programming, generate_tool_use
from kvbaton.bench.workloads.shared_prefix import generate_shared_prefix
from kvbaton.bench.workloads.sharegpt import generate_sharegpt_like, generate_shifting_mix
from kvbaton.core.errors import InvalidRequestError

__all__ = ["WORKLOADS", "PREBLE_WORKLOADS", "WorkloadRequest", "create_workload"]

WORKLOADS: dict[str, WorkloadFamily] = {f.name: f for f in (
    WorkloadFamily("shared-prefix", generate_shared_prefix, 16.0, None,
                   "SGLang generated-shared-prefix: G groups x P prompts, system prompt + question"),
    WorkloadFamily("tool-use", generate_tool_use, 8.0, 1000,
                   "Preble tool use: Zipf-1.1 popular tool schemas + unique query"),
    WorkloadFamily("agent", generate_agent, 4.0, 1000,
                   "Preble embodied agent: multi-turn episodes, context grows each turn"),
    WorkloadFamily("programming", generate_programming, 4.0, 1000,
                   "Preble programming: shared few-shot examples + unique problem"),
    WorkloadFamily("video-qa", generate_video_qa, 2.0, 1000,
                   "Preble video QA: long shared video-token prefix, short questions"),
    WorkloadFamily("long-doc-qa", generate_long_doc_qa, 1.0, 1000,
                   "Preble long-document QA: long documents, several questions each"),
    WorkloadFamily("hot-prefix-burst", generate_hot_prefix_burst, None, 1000,
                   "seed 000 s4: 8k system prompt, classes A/B/C at 100/5/20 req/s, burst of A"),
    WorkloadFamily("mooncake", generate_mooncake, None, None,
                   "Mooncake JSONL trace replay: 512-token hash blocks, timestamp arrivals"),
    WorkloadFamily("conversation", generate_conversation, None, None,
                   "multi-turn chat: shared system prompts, whole history resent, heavy-tailed think times"),
    WorkloadFamily("sharegpt-like", generate_sharegpt_like, 8.0, 1000,
                   "ShareGPT-shaped chat lengths (or a ShareGPT JSON file), no deliberate sharing"),
    WorkloadFamily("distserve-sharegpt", generate_distserve_sharegpt, 4.0, 300,
                   "DistServe's OPT-13B ShareGPT length mix (multi-turn prompts, prompt + output < 2,048)"),
    WorkloadFamily("shifting-mix", generate_shifting_mix, 4.0, 1000,
                   "issue 7: long prompts/short outputs, then halfway short prompts/long outputs"),
)}

PREBLE_WORKLOADS = ("tool-use", "agent", "programming", "video-qa", "long-doc-qa")

# Keyword arguments create_workload passes to every generator itself: a workload parameter may not set them.
RESERVED_PARAMS = ("num_requests", "vocab_size", "rng", "arrival_rng", "rate")


def create_workload(name: str, *, num_requests: int | None = None, seed: int = 0,
                    vocab_size: int = DEFAULT_VOCAB_SIZE, rate: float | None = None, arrival: str | None = None,
                    arrival_cv: float = 2.0, arrival_on_s: float = 5.0, arrival_off_s: float = 5.0,
                    **params: Any) -> list[WorkloadRequest]:
    """The requests of workload `name`, in arrival order, a pure function of the arguments.

    num_requests: None = the family's default (a trace: all rows; shared-prefix: G*P).
    rate: mean requests/s; None = the family's default rate (or the trace's own timing).
    arrival: "poisson" | "gamma" (with arrival_cv) | "on-off" (arrival_on_s/arrival_off_s) |
      "constant" | "trace"; None = "trace" for families that time requests themselves
      (mooncake, hot-prefix-burst), else "poisson". A synthetic process on a trace re-times it.
    params: the family's own keyword parameters (see its generator's signature).
    """
    family = WORKLOADS.get(name)
    if family is None:
        raise InvalidRequestError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    if num_requests is not None and num_requests <= 0:
        raise InvalidRequestError(f"num_requests must be positive, got {num_requests}")
    if seed < 0:
        raise InvalidRequestError(f"seed must be >= 0, got {seed}")
    if rate is not None and not (math.isfinite(rate) and rate > 0):
        raise InvalidRequestError(f"rate must be a positive finite number, got {rate}")
    check_vocab_size(vocab_size)
    _check_params(family, params)
    stream = zlib.crc32(name.encode())
    content_rng = np.random.default_rng([seed, stream, 0])
    arrival_rng = random.Random(seed * 1_000_003 + stream)  # int seeds are stable across processes
    kwargs = dict(num_requests=num_requests if num_requests is not None else family.default_num_requests,
                  vocab_size=vocab_size, rng=content_rng, arrival_rng=arrival_rng, rate=rate, **params)
    try:
        inspect.signature(family.generate).bind(**kwargs)
    except TypeError as exc:
        raise InvalidRequestError(f"workload {name!r}: {exc}") from None
    drafts = family.generate(**kwargs)
    self_timed = all(d.arrival_s is not None for d in drafts)
    kind = arrival or ("trace" if self_timed else "poisson")
    if kind == "trace":
        if not self_timed:
            raise InvalidRequestError(f"workload {name!r} has no recorded arrival times; pick a synthetic process")
        times_s = [float(d.arrival_s) for d in drafts]  # type: ignore[arg-type]
    else:
        mean_rate = rate if rate is not None else family.default_rate
        if mean_rate is None:
            raise InvalidRequestError(f"workload {name!r} with arrival {kind!r} needs --rate")
        times_s = create_arrivals(kind, arrival_rng, len(drafts), mean_rate, cv=arrival_cv, on_s=arrival_on_s,
                                  off_s=arrival_off_s)
    return _finish(name, drafts, times_s)


def _check_params(family: WorkloadFamily, params: dict[str, Any]) -> None:
    """Refuses reserved names and values of the wrong type (a name the generator lacks fails its bind)."""
    hints = typing.get_type_hints(family.generate)
    for key, value in params.items():
        if key in RESERVED_PARAMS:
            raise InvalidRequestError(f"workload {family.name!r}: {key!r} is set by its own option, not a parameter")
        hint = hints.get(key)
        if hint is not None and not _accepts(hint, value):
            raise InvalidRequestError(f"workload {family.name!r}: parameter {key} takes {_type_name(hint)}, "
                                      f"got {value!r}")


def _accepts(hint: Any, value: Any) -> bool:
    """Whether `value` fits the annotation `hint` (types this check does not know are left to the generator)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_accepts(h, value) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if hint is float:
        return (isinstance(value, numbers.Real) and not isinstance(value, bool)
                and math.isfinite(value))
    if hint in (str, Path):
        return isinstance(value, (str, Path))
    if typing.get_origin(hint) is Callable:
        return callable(value)
    return True


def _type_name(hint: Any) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    names = {type(None): "null", bool: "true or false", int: "an integer", float: "a finite number",
             str: "a string", Path: "a path"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def _finish(name: str, drafts: list[Draft], times_s: list[float]) -> list[WorkloadRequest]:
    # Every request asks for at least one token of a non-empty prompt: the engine and the simulator assume so.
    for i, draft in enumerate(drafts):
        if draft.output_tokens < 1:
            raise InvalidRequestError(f"workload {name!r}: request {i} has {draft.output_tokens} output tokens; "
                                      "check the workload's parameters")
        if not any(len(part) for part in draft.prompt_parts):
            raise InvalidRequestError(f"workload {name!r}: request {i} has an empty prompt; "
                                      "check the workload's parameters")
        if not math.isfinite(times_s[i]):
            raise InvalidRequestError(f"workload {name!r}: request {i} has arrival time {times_s[i]}")
    # Stable sort: equal arrival times keep generator order (an agent's turns stay ordered).
    order = sorted(range(len(drafts)), key=lambda i: times_s[i])
    return [WorkloadRequest(index=k, arrival_s=times_s[i], prompt_parts=drafts[i].prompt_parts,
                            output_tokens=drafts[i].output_tokens, slo_class=drafts[i].slo_class,
                            tenant=drafts[i].tenant, group=drafts[i].group)
            for k, i in enumerate(order)]
