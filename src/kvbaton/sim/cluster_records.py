"""How a simulated request ends: its one record (completed, failed, rejected), and the policies that hear of it.

`FlightEndings` is a base class of `ClusterSim` (`sim/cluster.py`), which owns the state these methods read
(declared below). Every flight ends through `_emit` exactly once: it leaves the flights in progress, its record is
kept (and passed to `on_record`), and with late KV reservation its prefill worker's waiting handoffs may move on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvbaton.bench.records import RequestRecord
from kvbaton.router.placement import ClusterPlacement
from kvbaton.sim.flight import Flight
from kvbaton.sim.handoff import SimHandoffs


class FlightEndings:
    """The record-keeping half of `ClusterSim`'s request lifecycle (see the module docstring)."""

    handoffs: SimHandoffs | None
    placement: ClusterPlacement
    _flights: dict[str, Flight]
    _records: list[RequestRecord]
    _on_record: Callable[[RequestRecord], None] | None
    _forget_tokens: Callable[[str], None] | None
    _unreserved: dict[str, deque[Flight]]
    _reserve_in_turn: Callable[[str, float], None]

    def _finish_policies(self, flight: Flight, now: float) -> None:
        if self.handoffs is not None:
            self.handoffs.cancel(flight.workload.request_id, now)
            self.handoffs.bytes_of.pop(flight.workload.request_id, None)
        self.placement.on_finished(flight.workload.request_id, now)

    def _complete(self, flight: Flight, now: float) -> None:
        self._finish_policies(flight, now)
        wr = flight.workload
        times = tuple(flight.token_times_s)
        handed_off = flight.decode and flight.decode != flight.front and len(times) > 1
        workers = (flight.front, flight.decode) if handed_off else (flight.front,)
        self._emit(RequestRecord(
            request_id=wr.request_id, arrival_s=wr.arrival_s, status="completed", slo_class=wr.slo_class,
            tenant=wr.tenant, prompt_tokens=wr.num_prompt_tokens, cached_tokens=flight.cached_tokens,
            output_tokens=len(times), first_token_s=times[0], token_times_s=times, finish_s=now,
            queue_s=flight.queue_s, worker_ids=workers, transfer_bytes=flight.transfer_bytes))

    def _fail(self, flight: Flight, reason: str, now: float) -> None:
        self._finish_policies(flight, now)
        wr = flight.workload
        self._emit(RequestRecord(
            request_id=wr.request_id, arrival_s=wr.arrival_s, status="failed", reason=reason,
            slo_class=wr.slo_class, tenant=wr.tenant, prompt_tokens=wr.num_prompt_tokens,
            output_tokens=len(flight.token_times_s), finish_s=now, worker_ids=(flight.front,),
            transfer_bytes=flight.transfer_bytes))

    def _reject(self, flight: Flight, reason: str, now: float) -> None:
        self._finish_policies(flight, now)
        wr = flight.workload
        times = tuple(flight.token_times_s)
        self._emit(RequestRecord(
            request_id=wr.request_id, arrival_s=wr.arrival_s, status="rejected", reason=reason,
            slo_class=wr.slo_class, tenant=wr.tenant, prompt_tokens=wr.num_prompt_tokens,
            output_tokens=len(times), first_token_s=times[0] if times else None, token_times_s=times,
            finish_s=now, worker_ids=(flight.front,)))

    def _emit(self, record: RequestRecord) -> None:
        flight = self._flights.pop(record.request_id)
        if self._forget_tokens is not None:
            self._forget_tokens(record.request_id)
        self._records.append(record)
        if self._on_record is not None:
            self._on_record(record)
        if self._unreserved:  # late reservation: its front's FIFO may move on now (its head, or tokens ahead, ended)
            self._reserve_in_turn(flight.front, record.finish_s)
