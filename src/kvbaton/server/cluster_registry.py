"""The router's records of its live workers and routed calls, who may join the pool, and how a worker shows in /cluster."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kvbaton.router.state import RouterState
from kvbaton.server import rpc
from kvbaton.server.base import DeltaSink, GenerateCall
from kvbaton.server.identity import ClusterIdentity, incompatibility


class ProcessHandle(Protocol):
    """The part of `subprocess.Popen` the monitor needs: None while running, else the exit code."""

    def poll(self) -> int | None: ...


@dataclass(slots=True)
class WorkerRecord:
    register: rpc.Register  # identity and pid as the worker announced them
    last_heard_at: float  # router clock of the latest message from this worker
    stats: rpc.Stats | None = None  # latest heartbeat
    in_flight: set[str] = field(default_factory=set)  # request ids routed here and not finished
    snapshot_pending: bool = False  # KV events are ignored until the requested snapshot arrives
    # When a call routed here ended before its first token (aborted while queued, refused by the engine): the prefix
    # index's optimistic entries for it may never be stored, so its entries for this worker are resynced from a
    # snapshot once the worker is idle, or INDEX_RESYNC_S later at the latest. None: nothing to resync.
    index_dirty_at: float | None = None
    last_pinged_at: float = float("-inf")


@dataclass(slots=True)
class CallRecord:
    call: GenerateCall
    worker_id: str
    sink: DeltaSink  # gets every delta of the call, the finished one last
    num_tokens_seen: int = 0
    finished: bool = False
    prefill_worker: str = ""  # a disaggregated call: the worker that prefills and hands the KV to worker_id
    # Every token streamed so far, over all the workers it ran on (num_tokens_seen counts the current placement's):
    # what a migration resumes after.
    output_token_ids: list[int] = field(default_factory=list)
    num_migrations: int = 0  # times it moved to another worker after losing one
    aborted: bool = False  # an abort was sent for it (the client left or cancelled): it never migrates


def identity_of(message: rpc.Register) -> ClusterIdentity:
    return ClusterIdentity(message.model_revision, message.kv_layout, message.block_size, message.tokenizer_probe_hash)


def registration_refusal(message: rpc.Register, model_name: str, expected: ClusterIdentity) -> str:
    """Why this worker may not join a pool serving `model_name` with identity `expected`; "" when it may."""
    if message.role not in ("mixed", "prefill", "decode"):
        return f"role {message.role!r} is not served by this router (mixed, prefill or decode)"
    if min(message.tensor_parallel_size, message.pipeline_parallel_size) < 1:
        return (f"tensor and pipeline parallel sizes must be >= 1, got {message.tensor_parallel_size} x "
                f"{message.pipeline_parallel_size}")
    if message.role == "decode" and not message.kv_address:
        return "a decode worker must offer a KV address for prefill workers to link to"
    if message.model_name != model_name:
        return f"model {message.model_name!r} differs from the router's {model_name!r}"
    return incompatibility(expected, identity_of(message))


def worker_info(record: WorkerRecord, state: RouterState, now: float) -> dict[str, object]:
    """One worker as JSON: identity, liveness, load and cache occupancy (engine counters as reported)."""
    reg, stats = record.register, record.stats
    info: dict[str, object] = {
        "worker_id": reg.worker_id,
        "role": reg.role,
        "pid": reg.pid,
        "host": reg.host,
        "model": reg.model_name,
        "kv_layout": reg.kv_layout,
        "tensor_parallel_size": reg.tensor_parallel_size,
        "pipeline_parallel_size": reg.pipeline_parallel_size,
        "num_blocks": reg.num_blocks,
        "kv_address": reg.kv_address,
        "last_heartbeat_age_s": round(now - record.last_heard_at, 3),
        "num_in_flight": len(record.in_flight),
        "load_tokens": state.load.load_tokens(reg.worker_id),
        "window_load_s": round(state.load.window_load_s(reg.worker_id), 6),
        "indexed_blocks": state.index.num_worker_blocks(reg.worker_id),
    }
    if stats is not None:
        info.update({
            "num_waiting": stats.num_waiting,
            "num_running": stats.num_running,
            "num_queued_prefill_tokens": stats.num_queued_prefill_tokens,
            "num_used_blocks": stats.num_used_blocks,
            "num_free_blocks": stats.num_free_blocks,
            "num_cached_blocks": stats.num_cached_blocks,
            "num_evictable_blocks": stats.num_evictable_blocks,
            "prefix_cache_queries_tokens": stats.prefix_cache_queries_tokens,
            "prefix_cache_hits_tokens": stats.prefix_cache_hits_tokens,
            "num_preemptions": stats.num_preemptions,
            "num_steps": stats.num_steps,
            "invariant_error": stats.invariant_error,
            "transfers": transfer_info(stats),
            "spec_decode": {"num_draft_tokens": stats.num_draft_tokens,
                            "num_accepted_tokens": stats.num_accepted_tokens},
            "kv_store": {"num_loaded_blocks": stats.num_store_loaded_blocks,
                         "num_saved_blocks": stats.num_store_saved_blocks},
        })
    return info


def transfer_info(stats: rpc.Stats) -> dict[str, float]:
    """A worker's KV handoff counters as JSON (all zero on mixed workers)."""
    return {
        "num_started": stats.num_transfers_started,
        "num_completed": stats.num_transfers_completed,
        "num_failed": stats.num_transfers_failed,
        "num_refused": stats.num_transfer_refusals,
        "num_cancelled": stats.num_transfers_cancelled,
        "num_recomputed": stats.num_transfer_recomputes,
        "bytes": stats.transfer_bytes,
        "time_s": round(stats.transfer_time_s, 6),
        "queue_s": round(stats.transfer_queue_s, 6),
        "num_live": stats.num_live_transfers,
        "num_held_blocks": stats.num_transfer_held_blocks,
    }
