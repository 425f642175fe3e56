"""The router <-> worker message schema and its msgpack framing (never pickle).

Every message is a frozen dataclass; on the wire it is a msgpack array whose first element is
the message tag and whose other elements are the fields in declaration order (nested values —
sampling params, deltas, KV events — are arrays too). `encode`/`decode` are the only way
messages cross a socket, so an unknown tag or a wrong field count is rejected in one place.

A prompt's token ids travel as little-endian uint32 bytes (a msgpack bin): packing them is one C-level
conversion instead of msgpack's per-integer encoding, on both ends. Ids outside uint32 fall back to an
array of integers, which `from_wire` accepts too.

Socket roles: the router binds a zmq ROUTER socket; each worker connects a DEALER whose
identity is its worker id. A DEALER sends one frame (the payload); the ROUTER sees
[identity, payload].
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections.abc import Sequence
from dataclasses import astuple, dataclass, fields
from typing import ClassVar

import msgpack

from kvbaton.core.step import SampledToken
from kvbaton.core.sampling import SamplingParams
from kvbaton.server.base import TokenDelta


class ProtocolError(ValueError):
    """A frame that is not a well-formed kvbaton RPC message. `request_id`: the id of an AddRequest whose other fields
    could not be read ("" otherwise), so its receiver can fail that one request."""

    def __init__(self, message: str, request_id: str = "") -> None:
        super().__init__(message)
        self.request_id = request_id


# -- worker -> router --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Register:
    """First message of a worker: who it is and what KV it holds (its layout identity)."""

    TAG: ClassVar[str] = "register"
    worker_id: str
    role: str  # mixed | prefill | decode
    model_name: str
    model_revision: str
    kv_layout: str  # ModelConfig.kv_layout_id(dtype, block_size)
    block_size: int
    num_blocks: int
    tokenizer_probe_hash: str  # kvbaton.server.identity.tokenizer_probe_hash
    pid: int
    kv_address: str = ""  # decode workers: "shm://host:port" or "tcp://host:port" where prefill workers link
    host: str = ""  # the worker's host name (its pid is only unique on it)
    # Its rank processes (kvbaton.engine.rank_group): heads split over tensor_parallel_size, layers over
    # pipeline_parallel_size; 1 x 1 is a worker that runs its model itself.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Its host's KV store node (tcp://host:port), which it writes through to and reads as its own; "" = none. The
    # router reads every node its workers name into its store directory.
    store_node: str = ""


@dataclass(frozen=True, slots=True)
class TokenDeltas:
    """All request outputs of one engine step (or failed adds), batched into one frame."""

    TAG: ClassVar[str] = "deltas"
    worker_id: str
    deltas: tuple[TokenDelta, ...]


@dataclass(frozen=True, slots=True)
class Stats:
    """Heartbeat: the engine's load and cache occupancy; `num_steps` growing means progress."""

    TAG: ClassVar[str] = "stats"
    worker_id: str
    num_waiting: int
    num_running: int
    num_queued_prefill_tokens: int
    num_used_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    prefix_cache_queries_tokens: int
    prefix_cache_hits_tokens: int
    num_preemptions: int
    num_steps: int
    monotonic_s: float  # worker clock when sampled
    invariant_error: str = ""  # "" when engine.check_invariants() passed (checked while idle)
    # KV handoffs, cumulative (kvbaton.engine.handoff.TransferCounters), then the current ones.
    num_transfers_started: int = 0
    num_transfers_completed: int = 0
    num_transfers_failed: int = 0
    num_transfer_refusals: int = 0
    num_transfers_cancelled: int = 0
    num_transfer_recomputes: int = 0
    transfer_bytes: int = 0
    transfer_time_s: float = 0.0
    transfer_queue_s: float = 0.0
    num_live_transfers: int = 0
    num_transfer_held_blocks: int = 0  # blocks held by transfer legs (source refs or destination reservations)
    # Speculative decoding, cumulative: draft tokens proposed, and those the model accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # The worker's blocks loaded from and written to the KV store so far (0 without one).
    num_store_loaded_blocks: int = 0
    num_store_saved_blocks: int = 0
    num_evictable_blocks: int = 0  # of num_used_blocks, those only the prefix cache holds (no request)
    # Loads from the cluster KV store, cumulative (kvbaton.engine.store_io `load_totals`): bytes brought into the
    # KV pool and seconds they took (acquire + copy), over the transport the worker reaches its node by ("shm" |
    # "tcp"; "" without a store), and the loads and the seconds of their round trips (of store_load_s: the acquire's
    # answer, or the TCP header). The router prices a load's fixed round trip and its bytes' speed from their
    # deltas. A worker that sends none of them (older) reads as no loads; one without the last two, as loads whose
    # round trip is not told apart.
    store_load_bytes: int = 0
    store_load_s: float = 0.0
    store_transport: str = ""
    store_load_count: int = 0
    store_load_round_trip_s: float = 0.0


@dataclass(frozen=True, slots=True)
class KVEvents:
    """Prefix-cache events since the last batch, in seq order (KVEvent.to_wire() each)."""

    TAG: ClassVar[str] = "kv_events"
    worker_id: str
    events: tuple[list[object], ...]


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """A heartbeat with the prefix-cache events since the last one, in one frame (a worker sends plain `Stats` when
    there are none). The router applies the events, then the stats. One frame where there were two: what a router
    pays per frame (its socket's wakeup, the read, the decode) is most of what the other routers' KV events cost it."""

    TAG: ClassVar[str] = "heartbeat"
    events: KVEvents
    stats: Stats


@dataclass(frozen=True, slots=True)
class SnapshotResponse:
    """The whole prefix cache as STORED events; events with seq <= `seq` are already included."""

    TAG: ClassVar[str] = "snapshot"
    worker_id: str
    seq: int
    events: tuple[list[object], ...]


@dataclass(frozen=True, slots=True)
class HandoffEnded:
    """A prefill worker's handoff leg ended without its KV reaching the decode worker (refused, failed, ...)."""

    TAG: ClassVar[str] = "handoff_ended"
    worker_id: str
    request_id: str
    decode_worker: str
    outcome: str  # refused | failed | expired | cancelled
    reason: str


@dataclass(frozen=True, slots=True)
class Alive:
    """The worker process lives: sent every ALIVE_INTERVAL_S by a thread of its own, on a socket of its own (routing
    id `alive_identity(worker_id)`), so that a step longer than the router's worker timeout does not read as death."""

    TAG: ClassVar[str] = "alive"
    worker_id: str


ALIVE_INTERVAL_S = 1.0


def alive_identity(worker_id: str) -> str:
    """The routing id of a worker's liveness socket (its main socket's is the worker id)."""
    return f"{worker_id}#alive"


@dataclass(frozen=True, slots=True)
class Goodbye:
    """The worker is exiting (after a shutdown or on its own); its requests have been answered."""

    TAG: ClassVar[str] = "goodbye"
    worker_id: str
    reason: str


# -- router -> worker --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RegisterAck:
    TAG: ClassVar[str] = "register_ack"
    worker_id: str
    queue_policy: str  # the worker's local waiting-queue policy (preble when the router policy is preble)
    heartbeat_interval_s: float


@dataclass(frozen=True, slots=True)
class RegisterRefuse:
    TAG: ClassVar[str] = "register_refuse"
    worker_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class RegisterAgain:
    """A router heard from a worker it does not know (it restarted at its address, or dropped the worker): the
    worker's requests there are gone with it, and the worker registers again."""

    TAG: ClassVar[str] = "register_again"
    worker_id: str


@dataclass(frozen=True, slots=True)
class AddRequest:
    TAG: ClassVar[str] = "add"
    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    tenant: str = ""
    slo_class: str = "default"
    # Disaggregation: a prefill worker gets decode_worker + decode_address (prefill, then hand the KV over);
    # the decode worker gets prefill_worker (expect the handoff). Both empty: run the whole request here.
    prefill_worker: str = ""
    decode_worker: str = ""
    decode_address: str = ""
    kv_load_failure_policy: str = "recompute"  # recompute | fail, when the KV does not arrive
    # A migrated call (its worker was lost mid-request): the tokens it already streamed, which it resumes after as
    # its output so far (prompt + these are recomputed here). Only for a whole request (no handoff fields).
    output_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class HandoffFailed:
    """Router -> decode worker: the prefill leg of this request ended without the KV (relayed HandoffEnded)."""

    TAG: ClassVar[str] = "handoff_failed"
    request_id: str
    reason: str
    refused: bool  # backpressure: run the prompt locally whatever the failure policy


@dataclass(frozen=True, slots=True)
class Abort:
    TAG: ClassVar[str] = "abort"
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SnapshotRequest:
    TAG: ClassVar[str] = "snapshot_request"
    reason: str


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """The worker drops every cached block no request holds (vLLM's reset_prefix_cache); KV events follow."""

    TAG: ClassVar[str] = "reset_prefix_cache"
    reason: str


@dataclass(frozen=True, slots=True)
class Ping:
    """Router liveness: a worker exits when it has heard nothing from the router for too long."""

    TAG: ClassVar[str] = "ping"
    monotonic_s: float


@dataclass(frozen=True, slots=True)
class AddRouter:
    """Another router serves this cluster at `address` (a zmq address): router -> worker, connect and register there
    too; a router -> another router of the cluster (`kvbaton router --join`, and the routers' gossip: each passes on
    an address it hears of the first time), tell your workers (and the workers that register later) about it."""

    TAG: ClassVar[str] = "add_router"
    address: str


@dataclass(frozen=True, slots=True)
class StoreNodesKnown:
    """Every KV store node a router reads (the nodes its workers named as their hosts'): router -> worker, after its
    acknowledgement and whenever a worker names a new one; the worker's loads read on from them over TCP for what
    its own node lacks."""

    TAG: ClassVar[str] = "store_nodes"
    addresses: str  # comma-separated tcp:// addresses


@dataclass(frozen=True, slots=True)
class Shutdown:
    TAG: ClassVar[str] = "shutdown"
    reason: str


Message = (Register | TokenDeltas | Stats | KVEvents | Heartbeat | SnapshotResponse | HandoffEnded | Alive | Goodbye
           | RegisterAck | RegisterRefuse | RegisterAgain | AddRequest | HandoffFailed | Abort | SnapshotRequest
           | ResetPrefixCache | Ping | AddRouter | StoreNodesKnown | Shutdown)

_PLAIN = (Register, Stats, HandoffEnded, Alive, Goodbye, RegisterAck, RegisterRefuse, HandoffFailed,
          SnapshotRequest, ResetPrefixCache, Ping, AddRouter, Shutdown, RegisterAgain, StoreNodesKnown)
_BY_TAG: dict[str, type] = {cls.TAG: cls for cls in (*_PLAIN, TokenDeltas, KVEvents, Heartbeat, SnapshotResponse,
                                                       AddRequest, Abort)}
# What each field of a plain message must be on the wire (a float field takes an int too): a dataclass does not
# check its fields, so a wrong type read here would reach the router's state and fail later, far from the frame.
_WIRE_TYPES: dict[str, tuple[type, ...]] = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}
_FIELD_TYPES: dict[type, tuple[tuple[str, tuple[type, ...]], ...]] = {
    cls: tuple((f.name, _WIRE_TYPES[str(f.type)]) for f in fields(cls)) for cls in _PLAIN}
# The same types alone, for one `map(isinstance, ...)` over a message's fields (in C: a heartbeat's 30 fields cost a
# router ~1 µs instead of ~8 through a Python loop); the loop runs only to name the field of a frame that fails it.
_TYPES_OF: dict[type, tuple[tuple[type, ...], ...]] = {
    cls: tuple(types for _, types in spec) for cls, spec in _FIELD_TYPES.items()}
# Trailing fields a sender may leave out (it predates them): they take their defaults.
_OPTIONAL_TAIL: dict[type, int] = {Stats: 5}


# -- nested values ------------------------------------------------------------------------------


def token_ids_to_wire(token_ids: Sequence[int]) -> bytes | Sequence[int]:
    """Little-endian uint32 bytes, or the ids themselves (a msgpack array) when some id does not fit."""
    try:
        packed = array("I", token_ids)  # "I" (unsigned) converts several times faster than "i"
    except (OverflowError, TypeError):
        return token_ids
    if packed.itemsize != 4:  # a platform whose C unsigned int is not 32 bits: stay portable
        return token_ids
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def token_ids_from_wire(raw: object) -> tuple[int, ...]:
    if isinstance(raw, bytes):
        if len(raw) % 4:
            raise ProtocolError(f"token id bytes must be a multiple of 4 long, got {len(raw)}")
        unpacked = array("I")
        if unpacked.itemsize != 4:
            return tuple(int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4))
        unpacked.frombytes(raw)
        if sys.byteorder == "big":
            unpacked.byteswap()
        return tuple(unpacked)
    if not isinstance(raw, list) or not all(type(t) is int for t in raw):
        raise ProtocolError("token ids must be uint32 bytes or an array of integers")
    return tuple(raw)


def _events_from_wire(raw: object) -> tuple[list[object], ...]:
    """KV events as they travel (KVEvent.to_wire() each); their fields are read where they are applied."""
    if not isinstance(raw, list) or not all(isinstance(event, list) for event in raw):
        raise ProtocolError("kv events must be an array of arrays")
    return tuple(raw)


def sampling_to_wire(params: SamplingParams) -> list[object]:
    return [params.max_tokens, params.temperature, params.top_p, params.top_k, params.seed, list(params.stop),
            list(params.stop_token_ids), params.ignore_eos, params.logprobs, params.n, params.presence_penalty,
            params.frequency_penalty, params.repetition_penalty, [list(pair) for pair in params.logit_bias],
            params.min_p, params.min_tokens, params.grammar, params.prompt_logprobs,
            params.include_stop_str_in_output, params.skip_special_tokens, params.priority]


def sampling_from_wire(raw: list[object]) -> SamplingParams:
    (max_tokens, temperature, top_p, top_k, seed, stop, stop_token_ids, ignore_eos, logprobs, n, presence_penalty,
     frequency_penalty, repetition_penalty, logit_bias, min_p, min_tokens, grammar, prompt_logprobs,
     include_stop_str_in_output, skip_special_tokens, priority) = raw
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,  # type: ignore[arg-type]
                          seed=seed, stop=tuple(stop), stop_token_ids=tuple(stop_token_ids),  # type: ignore[arg-type]
                          ignore_eos=bool(ignore_eos), logprobs=logprobs, n=n,  # type: ignore[arg-type]
                          presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,  # type: ignore[arg-type]
                          repetition_penalty=repetition_penalty, min_p=min_p, min_tokens=min_tokens,  # type: ignore[arg-type]
                          grammar=grammar, prompt_logprobs=prompt_logprobs,  # type: ignore[arg-type]
                          include_stop_str_in_output=bool(include_stop_str_in_output),
                          skip_special_tokens=bool(skip_special_tokens), priority=priority,  # type: ignore[arg-type]
                          logit_bias=tuple((token_id, bias) for token_id, bias in logit_bias))  # type: ignore[union-attr]


def _logprobs_to_wire(logprobs: Sequence[SampledToken]) -> list[object]:
    return [[lp.token_id, lp.logprob, [list(pair) for pair in lp.top_logprobs], lp.rank] for lp in logprobs]


def _logprobs_from_wire(raw: object) -> tuple[SampledToken, ...]:
    return tuple(SampledToken(int(t), float(lp), tuple((int(a), float(b)) for a, b in top), int(rank))
                 for t, lp, top, rank in raw)  # type: ignore[union-attr]


def delta_to_wire(delta: TokenDelta) -> list[object]:
    # Empty logprobs (the usual case) skip the call; same value.
    return [delta.request_id, list(delta.new_token_ids), delta.new_text, delta.finished, delta.finish_reason,
            delta.num_prompt_tokens, delta.num_cached_tokens,
            _logprobs_to_wire(delta.logprobs) if delta.logprobs else [], delta.error, delta.worker_id,
            dict(delta.extra), _logprobs_to_wire(delta.prompt_logprobs) if delta.prompt_logprobs else []]


def delta_from_wire(raw: list[object]) -> TokenDelta:
    (request_id, token_ids, text, finished, finish_reason, num_prompt, num_cached, logprobs, error, worker_id,
     extra, prompt_logprobs) = raw
    if finish_reason is not None and not isinstance(finish_reason, str):
        raise ProtocolError(f"finish_reason must be a string or nil, got {type(finish_reason).__name__}")
    return TokenDelta(str(request_id), tuple(map(int, token_ids)), str(text), bool(finished),  # type: ignore[arg-type]
                      finish_reason, int(num_prompt), int(num_cached),  # type: ignore[arg-type]
                      () if logprobs == [] else _logprobs_from_wire(logprobs), str(error), str(worker_id),
                      {} if extra == {} else {str(k): float(v) for k, v in extra.items()},  # type: ignore[union-attr]
                      () if prompt_logprobs == [] else _logprobs_from_wire(prompt_logprobs))


# -- framing ------------------------------------------------------------------------------------


def to_wire(message: Message) -> list[object]:
    if isinstance(message, TokenDeltas):
        return [message.TAG, message.worker_id, [delta_to_wire(d) for d in message.deltas]]
    if isinstance(message, Heartbeat):
        return [message.TAG, message.events.worker_id, [list(e) for e in message.events.events],
                list(astuple(message.stats))]
    if isinstance(message, (KVEvents, SnapshotResponse)):
        head = [message.TAG, message.worker_id] + ([message.seq] if isinstance(message, SnapshotResponse) else [])
        return [*head, [list(e) for e in message.events]]
    if isinstance(message, AddRequest):
        return [message.TAG, message.request_id, token_ids_to_wire(message.prompt_token_ids),
                sampling_to_wire(message.sampling),
                message.tenant, message.slo_class, message.prefill_worker, message.decode_worker,
                message.decode_address, message.kv_load_failure_policy, token_ids_to_wire(message.output_token_ids)]
    if isinstance(message, Abort):
        return [message.TAG, list(message.request_ids)]
    return [message.TAG, *astuple(message)]


def from_wire(raw: object) -> Message:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise ProtocolError("a message is a non-empty array starting with its tag")
    cls = _BY_TAG.get(raw[0])
    if cls is None:
        raise ProtocolError(f"unknown message tag {raw[0]!r}")
    body = raw[1:]
    # An AddRequest whose id reads but whose other fields do not fails that request, not the frame alone.
    add_id = body[0] if cls is AddRequest and body and isinstance(body[0], str) else ""
    try:
        if cls is TokenDeltas:
            worker_id, deltas = body
            return TokenDeltas(worker_id, tuple(delta_from_wire(d) for d in deltas))
        if cls is KVEvents:
            worker_id, events = body
            return KVEvents(worker_id, _events_from_wire(events))
        if cls is Heartbeat:
            worker_id, events, stats = body
            if not isinstance(stats, list):
                raise ProtocolError("heartbeat: stats must be an array")
            decoded = from_wire([Stats.TAG, *stats])
            assert isinstance(decoded, Stats)
            return Heartbeat(KVEvents(worker_id, _events_from_wire(events)), decoded)
        if cls is SnapshotResponse:
            worker_id, seq, events = body
            return SnapshotResponse(worker_id, int(seq), _events_from_wire(events))
        if cls is AddRequest:
            request_id, token_ids, sampling, *rest, output_token_ids = body
            if not all(isinstance(value, str) for value in (request_id, *rest)):
                raise ProtocolError("add: request id, tenant, slo class and handoff fields must be strings", add_id)
            return AddRequest(request_id, token_ids_from_wire(token_ids), sampling_from_wire(sampling), *rest,
                              output_token_ids=token_ids_from_wire(output_token_ids))
        if cls is Abort:
            (request_ids,) = body
            if not isinstance(request_ids, list) or not all(isinstance(r, str) for r in request_ids):
                raise ProtocolError("abort: request ids must be an array of strings")
            return Abort(tuple(request_ids))
        types_of = _TYPES_OF[cls]
        if len(types_of) - _OPTIONAL_TAIL.get(cls, 0) <= len(body) < len(types_of):
            types_of = types_of[: len(body)]  # fields added since, left out by an older sender: their defaults
        if len(body) != len(types_of):
            raise ProtocolError(f"{raw[0]} has {len(body)} fields, expected {len(types_of)}")
        if not all(map(isinstance, body, types_of)):
            for value, (name, types) in zip(body, _FIELD_TYPES[cls]):
                if not isinstance(value, types):
                    raise ProtocolError(f"{raw[0]}.{name} must be {types[-1].__name__}, got {type(value).__name__}")
        return cls(*body)
    except ProtocolError as exc:
        if add_id and not exc.request_id:
            raise ProtocolError(str(exc), add_id) from exc
        raise
    except (TypeError, ValueError, AttributeError, OverflowError) as exc:  # OverflowError: int() of an inf float
        raise ProtocolError(f"malformed {raw[0]} message: {exc}", add_id) from exc


_packers = threading.local()  # one reusable Packer per thread (packb builds and frees one, buffer included, per call)


def encode(message: Message) -> bytes:
    packer = getattr(_packers, "packer", None)
    if packer is None:
        packer = _packers.packer = msgpack.Packer(use_bin_type=True)
    return packer.pack(to_wire(message))


def decode(payload: bytes) -> Message:
    try:
        raw = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=True)
    except (msgpack.UnpackException, ValueError) as exc:
        raise ProtocolError(f"frame is not msgpack: {exc}") from exc
    return from_wire(raw)
