"""`mooncake`: replay of a Mooncake trace (JSONL), with token ids synthesised from the block hash ids.

Trace format (shared/data/README.md; Mooncake FAST'25 release): one object per line with
`timestamp` (ms from the start), `input_length`, `output_length` and `hash_ids`, one id per
512-token block, equal ids at equal positions meaning the same prefix. Each id becomes a fixed
512-token span (`keyed_token_blocks`: equal ids give equal tokens, different ids differ in the
first token), the last block truncated to `input_length`. So two requests that share k leading
hash ids share exactly k*512 leading tokens, and a prefix cache sees the trace's reuse.

Arrivals replay the timestamps divided by `speed`; `rate` instead picks the speed that makes the
mean rate equal `rate`. The bundled synthetic trace has 3,993 requests, mean input 15,325 and
mean output 149 tokens.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np

from kvbaton.bench.arrivals import trace_arrivals
from kvbaton.bench.tokens import keyed_token_blocks
from kvbaton.bench.workloads.base import Draft
from kvbaton.core.errors import InvalidRequestError

MOONCAKE_BLOCK_TOKENS = 512
# The checkout keeps shared data next to the repository: <repo>/../shared/data/...
DEFAULT_MOONCAKE_TRACE = Path(__file__).resolve().parents[4].parent / "shared/data/mooncake/synthetic_trace.jsonl"


def read_mooncake_trace(path: str | Path, num_requests: int | None = None) -> list[dict]:
    """The first `num_requests` rows of the trace (all when None), validated and with their fields normalised
    (int lengths and hash ids, a float timestamp)."""
    trace_path = Path(path)
    if not trace_path.is_file():
        raise InvalidRequestError(f"Mooncake trace not found: {trace_path} (pass --trace FILE)")
    rows = []
    try:
        with trace_path.open(encoding="utf-8") as f:
            for line_no, line in enumerate(f, 1):
                if num_requests is not None and len(rows) >= num_requests:
                    break
                if line.strip():
                    rows.append(_parse_row(line, f"{trace_path}:{line_no}"))
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read Mooncake trace {trace_path}: {exc}") from None
    if not rows:
        raise InvalidRequestError(f"Mooncake trace {trace_path} has no rows")
    return rows


def _parse_row(line: str, where: str) -> dict:
    try:
        row = json.loads(line)
        ids = row["hash_ids"]
        if not isinstance(ids, list):
            raise TypeError(f"hash_ids must be a list, got {ids!r}")
        parsed = {"timestamp": float(row["timestamp"]), "input_length": int(row["input_length"]),
                  "output_length": int(row["output_length"]), "hash_ids": [int(h) for h in ids]}
    except (ValueError, KeyError, TypeError, OverflowError) as exc:  # OverflowError: int(1e400)
        raise InvalidRequestError(f"{where}: not a Mooncake trace row ({exc})") from None
    if not math.isfinite(parsed["timestamp"]):
        raise InvalidRequestError(f"{where}: timestamp must be a finite number, got {parsed['timestamp']}")
    input_len, num_blocks = parsed["input_length"], len(parsed["hash_ids"])
    if input_len < 1:
        raise InvalidRequestError(f"{where}: input_length must be at least 1, got {input_len}")
    if not (num_blocks - 1) * MOONCAKE_BLOCK_TOKENS < input_len <= num_blocks * MOONCAKE_BLOCK_TOKENS:
        raise InvalidRequestError(f"{where}: input_length {input_len} does not fit "
                                  f"{num_blocks} blocks of {MOONCAKE_BLOCK_TOKENS}")
    return parsed


def generate_mooncake(*, num_requests: int | None, vocab_size: int, rng: np.random.Generator,
                      arrival_rng: random.Random, rate: float | None, trace: str | Path | None = None,
                      speed: float = 1.0, salt: int = 0) -> list[Draft]:
    rows = read_mooncake_trace(trace or DEFAULT_MOONCAKE_TRACE, num_requests)
    times_s = [float(r["timestamp"]) / 1000.0 for r in rows]
    if rate is not None and len(rows) > 1 and times_s[-1] > times_s[0]:
        speed = rate / ((len(rows) - 1) / (times_s[-1] - times_s[0]))
    arrivals_s = trace_arrivals(times_s, speed)
    blocks = keyed_token_blocks((h for r in rows for h in r["hash_ids"]), MOONCAKE_BLOCK_TOKENS, vocab_size, salt)
    drafts = []
    for row, arrival_s in zip(rows, arrivals_s):
        ids = row["hash_ids"]
        tail_tokens = int(row["input_length"]) - (len(ids) - 1) * MOONCAKE_BLOCK_TOKENS
        last = blocks[ids[-1]]
        parts = tuple(blocks[h] for h in ids[:-1]) + (last if tail_tokens == len(last) else last[:tail_tokens],)
        drafts.append(Draft(prompt_parts=parts, output_tokens=max(1, int(row["output_length"])),
                            group=f"h{ids[0]}", arrival_s=arrival_s))
    return drafts
