"""What a parallel worker's front process and its rank processes say to each other, over inherited pipes.

Each rank has two pipes of its own (created by the front process and passed to the child by fd, so no other
process can reach them: nothing listens). A frame is `u32 length | msgpack`, never pickle. The front sends
every rank the step's plan; every rank answers when its part is done, the result rank (the last stage's tensor
rank 0) with the sampling logits as float32 bytes.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Collection, Mapping
from typing import Any

import msgpack

from kvbaton.core.step import SampledToken, ScheduledChunk, StepPlan
from kvbaton.engine.model_runner import PromptLogprobsWanted

_LENGTH = struct.Struct("<I")


class RankPipeClosed(EOFError):
    """The other end of a rank pipe closed (its process ended)."""


def write_frame(fd: int, message: Mapping[str, Any]) -> None:
    payload = msgpack.packb(message, use_bin_type=True)
    view = memoryview(_LENGTH.pack(len(payload)) + payload)
    while view:
        view = view[os.write(fd, view):]


def read_frame(fd: int) -> dict[str, Any]:
    (length,) = _LENGTH.unpack(_read_exactly(fd, _LENGTH.size))
    message = msgpack.unpackb(_read_exactly(fd, length), raw=False, strict_map_key=False)
    if not isinstance(message, dict):
        raise ValueError("a rank frame must be a msgpack map")
    return message


def _read_exactly(fd: int, num_bytes: int) -> bytes:
    parts: list[bytes] = []
    while num_bytes:
        part = os.read(fd, num_bytes)
        if not part:
            raise RankPipeClosed("rank pipe closed")
        parts.append(part)
        num_bytes -= len(part)
    return b"".join(parts)


def encode_step(plan: StepPlan, prompt_logprobs: Mapping[str, PromptLogprobsWanted] | None,
                speculative: Collection[str]) -> dict[str, Any]:
    return {
        "op": "step",
        "step_id": plan.step_id,
        "chunks": [[c.request_id, c.start_pos, list(c.token_ids), list(c.block_ids), c.samples] for c in plan.chunks],
        "prompt_logprobs": {rid: [w.num_top, list(w.prompt_token_ids), w.first_position]
                            for rid, w in (prompt_logprobs or {}).items()},
        "speculative": list(speculative),
    }


def decode_step(message: Mapping[str, Any]) -> tuple[StepPlan, dict[str, PromptLogprobsWanted], set[str]]:
    chunks = tuple(ScheduledChunk(str(rid), int(start), tuple(tokens), tuple(blocks), bool(samples))
                   for rid, start, tokens, blocks, samples in message["chunks"])
    plan = StepPlan(int(message["step_id"]), chunks, sum(c.num_tokens for c in chunks))
    wanted = {str(rid): PromptLogprobsWanted(int(top), tuple(ids), int(first))
              for rid, (top, ids, first) in message["prompt_logprobs"].items()}
    return plan, wanted, set(message["speculative"])


def encode_prompt_logprobs(prompt_out: Mapping[str, list[SampledToken]]) -> dict[str, list[list[Any]]]:
    return {rid: [[t.token_id, t.logprob, [list(pair) for pair in t.top_logprobs], t.rank] for t in tokens]
            for rid, tokens in prompt_out.items()}


def decode_prompt_logprobs(wire: Mapping[str, list[list[Any]]]) -> dict[str, list[SampledToken]]:
    return {str(rid): [SampledToken(int(t), float(lp), tuple((int(i), float(v)) for i, v in top), int(rank))
                       for t, lp, top, rank in tokens]
            for rid, tokens in wire.items()}
