"""The request a workload produces, the draft a generator returns, and shared sampling helpers.

A generator builds prompts from *parts*: the shared ones (a system prompt, a tool schema, a
document) are one tuple object reused by every request that contains them, so a workload with
100,000 requests over one 2,048-token system prompt holds that prompt once. The sharing is real
at the token level: concatenating the parts gives equal leading token ids, which is all a
prefix cache looks at.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kvbaton.bench.tokens import TokenIds
from kvbaton.core.errors import InvalidRequestError


@dataclass(frozen=True, slots=True, eq=False)
class WorkloadRequest:
    """One request of a workload. Compared by identity (its parts are arrays); compare
    `prompt_token_ids` and the other fields when checking that two generations agree."""

    index: int  # position in arrival order, 0-based; request ids are derived from it
    arrival_s: float  # seconds after the workload starts (the first request may arrive after 0)
    prompt_parts: tuple[TokenIds, ...]  # the prompt as consecutive read-only int32 spans, often shared
    output_tokens: int  # exact number of tokens to generate (sent as max_tokens = min_tokens)
    slo_class: str = "default"  # latency class: metrics are reported per class
    tenant: str = ""  # tenant (also the prefix-cache salt: tenants never share cached KV)
    group: str = ""  # prefix group (tool, document, episode, trace session) for analysis only

    @property
    def request_id(self) -> str:
        return f"req-{self.index}"

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(part) for part in self.prompt_parts)

    @property
    def prompt_array(self) -> np.ndarray:
        """The whole prompt as one int32 array (a copy unless the prompt is a single part)."""
        return self.prompt_parts[0] if len(self.prompt_parts) == 1 else np.concatenate(self.prompt_parts)

    @property
    def prompt_token_ids(self) -> tuple[int, ...]:
        """The whole prompt as Python ints; built on each access (O(prompt length)), so keep it if reused."""
        return tuple(self.prompt_array.tolist())


@dataclass(frozen=True, slots=True)
class Draft:
    """A request before arrival times are assigned; generators return these in arrival order."""

    prompt_parts: tuple[TokenIds, ...]
    output_tokens: int
    slo_class: str = "default"
    tenant: str = ""
    group: str = ""
    arrival_s: float | None = None  # set only by generators that time requests themselves


# A generator is called as generate(num_requests=, vocab_size=, rng=np.random.Generator,
# arrival_rng=random.Random, rate=float|None, **its_own_params) and returns drafts in arrival
# order. `rng` draws content; `arrival_rng` is only for generators that time requests themselves.
Generator = Callable[..., list[Draft]]


@dataclass(frozen=True, slots=True)
class WorkloadFamily:
    name: str
    generate: Generator
    default_rate: float | None  # requests/s when --rate is not given; None: the generator times requests
    default_num_requests: int | None  # None: the generator decides (a trace: all of it)
    summary: str  # one line for --help and --describe


def lognormal_lengths(rng: np.random.Generator, num: int, mean: float, std: float, low: int = 1,
                      high: int | None = None) -> list[int]:
    """`num` integer lengths from a log-normal with the given mean and standard deviation, clipped.

    Log-normal because measured prompt/output lengths are positive and right-skewed; matching
    the first two moments is what papers report (Preble Table 1 gives mean ± std).
    """
    if not (mean > 0 and std >= 0) or not math.isfinite(mean + std):
        raise InvalidRequestError(f"length distribution needs finite mean > 0 and std >= 0, got {mean}, {std}")
    if high is not None and high < low:
        raise InvalidRequestError(f"length distribution needs a maximum >= {low}, got {high}")
    if std == 0:
        values = np.full(num, mean)
    else:
        sigma2 = np.log1p((std / mean) ** 2)
        values = rng.lognormal(np.log(mean) - sigma2 / 2, np.sqrt(sigma2), size=num)
    clipped = np.clip(np.rint(values), low, high if high is not None else np.inf)
    return [int(v) for v in clipped]


def zipf_weights(num_items: int, exponent: float) -> np.ndarray:
    """Normalised Zipf popularity: item i (0-based) has weight 1/(i+1)**exponent; 0 means uniform."""
    if num_items <= 0:
        raise InvalidRequestError(f"need at least one item, got {num_items}")
    weights = 1.0 / np.arange(1, num_items + 1, dtype=np.float64) ** exponent
    return weights / weights.sum()


def choose_indices(rng: np.random.Generator, num: int, weights: np.ndarray) -> list[int]:
    return [int(i) for i in rng.choice(len(weights), size=num, p=weights)]


def check_positive(**values: float) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value > 0:
            raise InvalidRequestError(f"{name} must be positive, got {value}")



def interleave_sessions(rng: np.random.Generator, sessions: list[list[Draft]], num_active: int,
                        num_requests: int) -> list[Draft]:
    """Merges sessions (episodes, videos, documents) into one arrival order.

    `num_active` sessions are open at a time; each next request comes from an open session picked
    uniformly, in that session's own order (so an agent's turn t always follows turn t-1); a
    finished session is replaced by the next unopened one. Stops after `num_requests` drafts.
    """
    check_positive(num_active=num_active)
    pending = iter(sessions)
    active: list[list[Draft]] = []
    positions: list[int] = []
    out: list[Draft] = []
    while len(out) < num_requests:
        while len(active) < num_active:
            nxt = next(pending, None)
            if nxt is None:
                break
            if nxt:
                active.append(nxt)
                positions.append(0)
        if not active:
            break
        slot = int(rng.integers(len(active)))
        out.append(active[slot][positions[slot]])
        positions[slot] += 1
        if positions[slot] == len(active[slot]):
            del active[slot], positions[slot]
    return out


def scaled(num_tokens: int, length_scale: float) -> int:
    """A prompt-part length scaled for a small-context model (e.g. 0.25 fits long-doc-qa in 8k); at least 1."""
    return max(1, round(num_tokens * length_scale))


def split_rng(rng: np.random.Generator) -> tuple[np.random.Generator, np.random.Generator]:
    """(structure rng, token rng): lengths and choices never depend on how many tokens were drawn,
    so `length_scale` or a changed span length leaves the rest of the workload as it was."""
    structure_rng, token_rng = rng.spawn(2)
    return structure_rng, token_rng
