"""A prefill worker reads its socket between the layers of a step: a handoff asks for its KV at once, the rest waits.

Without this, a request routed to a busy prefill worker waited for the step in flight before its reservation
went out (a traced 1P+1D run: 21 ms on average at 0.8 req/s, up to a whole prefill step), which the simulator,
whose handoffs reserve as they arrive, did not see.
"""

from __future__ import annotations

import time

import zmq

from kvbaton.core.sampling import SamplingParams
from kvbaton.model.registry import load_model
from kvbaton.server import rpc
from kvbaton.server.worker import Worker, WorkerConfig
from kvbaton.server.worker_links import RouterLinks


class RecordingHandoffs:
    """Stands in for PrefillHandoffs: records which handoffs were submitted, in order."""

    def __init__(self) -> None:
        self.submitted: list[str] = []

    def submit(self, request_id: str, *_: object) -> None:
        self.submitted.append(request_id)


def test_handoffs_are_submitted_mid_step_and_other_messages_wait_in_order() -> None:
    worker = Worker(WorkerConfig(router_address="inproc://unused", worker_id="p0", model="tiny-random",
                                 role="prefill", block_size=16, num_blocks=64), load_model("tiny-random"))
    handoffs = RecordingHandoffs()
    worker.prefill = handoffs  # type: ignore[assignment]
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    dealer = context.socket(zmq.DEALER)
    try:
        router.bind("inproc://mid-step")
        dealer.setsockopt(zmq.IDENTITY, b"p0")
        dealer.connect("inproc://mid-step")
        worker._links = RouterLinks.of_socket(dealer, "p0", time.monotonic)
        sampling = SamplingParams(max_tokens=4)
        messages = [rpc.AddRequest("h1", (1, 2, 3), sampling, decode_worker="d0", decode_address="a"),
                    rpc.Abort(("x",)),
                    rpc.AddRequest("plain", (1, 2, 3), sampling),
                    rpc.AddRequest("h2", (4, 5, 6), sampling, decode_worker="d0", decode_address="a"),
                    rpc.Shutdown("done")]
        dealer.send(rpc.encode(rpc.Ping("p0")))  # the router learns the dealer's route
        router.recv_multipart()
        for message in messages:
            router.send_multipart([b"p0", rpc.encode(message)])
        while len(handoffs.submitted) + len(worker._deferred) < len(messages):
            assert dealer.poll(2000), "messages did not arrive"
            worker._read_mid_step()
        assert handoffs.submitted == ["h1", "h2"]
        assert [message for _, message in worker._deferred] == [messages[1], messages[2], messages[4]]
        assert not worker._stopping  # Shutdown is handled after the step, not between two layers
    finally:
        dealer.close(linger=0)
        router.close(linger=0)
        context.term()
