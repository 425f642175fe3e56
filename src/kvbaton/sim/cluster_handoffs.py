"""The disaggregated part of the simulated cluster: reservations, KV streaming, deliveries and adoption.

`HandoffFlow` is a base class of `ClusterSim` (`sim/cluster.py`), which owns the state these methods
read (declared below) and the helpers they call (`_admit`, `_kick`, `_push`, `_fail`, `_reject`,
`_sampling`). A handoff reserves on its decode worker as it arrives (or, with
`reserve_ahead_tokens`, in its prefill worker's turn); the grant admits the prefill; each executed
prefill step streams its KV; the decode worker adopts the blocks once the leg is complete. As live,
a prefill worker reads protocol messages between its steps, and a decode worker applies them as they
arrive (between two layers of its step) and adopts a completed leg's KV after its step in flight.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvbaton.core.request import Request
from kvbaton.core.step import StepPlan
from kvbaton.router.placement import ClusterPlacement
from kvbaton.sim.config import SimConfig
from kvbaton.sim.flight import Flight
from kvbaton.sim.handoff import Delivery, HandoffEvent, SimHandoffs
from kvbaton.sim.worker import SimWorker
from kvbaton.transfer import AdoptedKV
from kvbaton.transfer.source import num_due_to_reserve

DELIVERY, RETRY = 2, 3  # the kinds of ClusterSim's heap events this part pushes (a protocol message; a retry)


class HandoffFlow:
    """The handoff half of `ClusterSim`'s event handlers (see the module docstring)."""

    config: SimConfig
    workers: dict[str, SimWorker]
    handoffs: SimHandoffs | None
    placement: ClusterPlacement
    _flights: dict[str, Flight]
    _unreserved: dict[str, deque[Flight]]  # late reservation: per prefill worker, FIFO
    _inbox: dict[str, list[Delivery | HandoffEvent]]  # what a worker in mid-step handles after it

    def _reserve_in_turn(self, worker_id: str, now: float) -> None:
        """Late reservation: the FIFO's head reserves while its prefill worker has at most `reserve_ahead_tokens`
        prompt tokens to compute ahead of it (queued in its scheduler, or of handoffs asking for blocks now); a
        handoff that waited a whole lease for its turn fails, as live (`PrefillHandoffs._reserve_in_turn`).

        Runs whenever that can change: an arrival, a grant, the prefill worker's step end, and any request of that
        worker ending (`ClusterSim._emit`), so that the FIFO moves on when its head fails."""
        unreserved = self._unreserved.get(worker_id)
        if not unreserved:
            return
        limit = self.config.reserve_ahead_tokens
        assert limit is not None
        lease_s = self.config.handoff_lease_s
        expired = []  # the FIFO is in arrival order: its head waited longest
        while unreserved and now - unreserved[0].workload.arrival_s > lease_s:
            expired.append(unreserved.popleft())
        for flight in expired:  # each _fail asks again for the FIFO as it now stands (no expired head left)
            if self._flights.get(flight.workload.request_id) is flight:
                self._fail(flight, f"no turn to reserve KV on {flight.decode} within the {lease_s:g} s lease", now)
        if not unreserved:
            return
        ahead_tokens = self.workers[worker_id].scheduler.num_queued_prefill_tokens() + sum(
            f.workload.num_prompt_tokens for f in self._flights.values()
            if f.front == worker_id and f.reserving and f.prefill_request is not None)
        flights = self._flights
        live = [f for f in unreserved if flights.get(f.workload.request_id) is f]  # some ended while waiting
        num_due = num_due_to_reserve(ahead_tokens, (f.workload.num_prompt_tokens for f in live), limit)
        unreserved.clear()
        unreserved.extend(live[num_due:])
        for flight in live[:num_due]:
            self._start_handoff(flight, now)

    def _start_handoff(self, flight: Flight | None, now: float) -> None:
        if flight is None or flight.prefill_request is None:
            return  # ended while waiting to retry
        flight.reserving = True
        request = flight.prefill_request
        handoffs = self.handoffs
        assert handoffs is not None
        handoffs.start(request.request_id, flight.attempts, flight.front, flight.decode, request.num_prompt_tokens, now)

    def _stream_from(self, worker: SimWorker) -> Callable[[StepPlan, float], None]:
        return lambda plan, now: self.handoffs.on_executed(worker, plan, now)  # type: ignore[union-attr]

    def _on_handoff_events(self, events: list[HandoffEvent], now: float) -> None:
        for event in events:
            flight = self._flights.get(event.request_id)
            if flight is None:
                continue
            if event.kind == "granted" and flight.prefill_request is not None:
                request, flight.prefill_request = flight.prefill_request, None
                self._admit(self.workers[flight.front], flight, request, now)
                if self._unreserved:
                    self._reserve_in_turn(flight.front, now)
            elif event.kind == "refused":
                flight.attempts += 1
                if flight.attempts >= self.config.max_handoff_attempts:
                    self._fail(flight, f"decode worker {flight.decode} refused {flight.attempts} times: "
                                       f"{event.reason}", now)
                else:
                    self._push(now + self.config.handoff_retry_s, RETRY, event.request_id)
            elif event.kind == "complete" and event.transfer_id is not None:
                adopted = self.handoffs.adopt(flight.decode, event.transfer_id, now)  # type: ignore[union-attr]
                if adopted is None:
                    self._fail(flight, "handoff ended: the KV's lease ran out before the decode worker adopted it",
                               now)
                else:
                    self._adopt(flight, adopted, now)
            elif event.kind == "ended":
                front = self.workers[flight.front]
                front.scheduler.abort_request(event.request_id, now)
                front.take_finished()
                self._fail(flight, f"handoff ended: {event.reason}", now)

    def _adopt(self, flight: Flight, adopted: AdoptedKV, now: float) -> None:
        wr = flight.workload
        request = Request(wr.request_id, list(flight.prompt), self._sampling(wr.output_tokens), wr.arrival_s,
                          tenant=wr.tenant, slo_class=wr.slo_class, max_model_len=self.config.max_model_len,
                          output_token_ids=[adopted.first_token.token_id])
        flight.transfer_bytes = self.handoffs.bytes_of.pop(wr.request_id, 0)  # type: ignore[union-attr]
        self.handoffs.forget(wr.request_id)  # type: ignore[union-attr]
        decode = self.workers[flight.decode]
        # The decode stage's own gate (with admission): the prefill is already paid for.
        decision = self.placement.check_decode(wr.request_id, wr.num_prompt_tokens, wr.output_tokens, flight.decode,
                                               now)
        if decision is not None and not decision.admitted:
            decode.pool.release(adopted.block_ids)
            self._reject(flight, decision.reason, now)
            return
        flight.at_decode = True
        self.placement.on_tokens(wr.request_id, 1, now)  # the router hears the first token from the decode worker
        # The client sees the first token when the decode worker adopts the KV and streams it, as live: between
        # its steps, so after the one in flight (the prefill worker sampled it earlier; the router hears it here).
        if flight.token_times_s and self.config.first_token_at == "decode":
            flight.token_times_s[0] = decode.step_end_at if decode.busy else now
        decode.offer_handoff(request, adopted.num_tokens, adopted.block_ids, now)
        self._kick(decode, now)

    def _on_delivery(self, delivery: Delivery, now: float) -> None:
        worker = self.workers[delivery.to_worker]
        if not worker.busy:
            self._on_handoff_events(self.handoffs.deliver(delivery, now), now)  # type: ignore[union-attr]
        elif worker.spec.role == "decode":  # grants and KV now; a completed leg is adopted after the step
            events = self.handoffs.deliver(delivery, now)  # type: ignore[union-attr]
            if events:
                self._inbox.setdefault(delivery.to_worker, []).extend(events)
        else:
            self._inbox.setdefault(delivery.to_worker, []).append(delivery)
