"""Regressions found by the second bug hunt (router process: ClusterManager against scripted workers); each test
names the bug it guards, which it showed on the code it was written against."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
import zmq.asyncio

from kvbaton.cache.hashing import CacheKey, hash_block_tokens
from kvbaton.router.admission import AdmissionPolicy, AdmissionSLO
from kvbaton.server import rpc
from kvbaton.server.base import TokenDelta
from kvbaton.server.cluster import ClusterConfig, ClusterManager
from tests.server.test_cluster_admission import COST
from tests.server.test_cluster_manager import LAYOUT, ScriptedWorker, call, register, run_cluster, settle


# Was a bug: with SLO admission, a disaggregated cluster whose decode workers are all gone (only prefill workers
# serve; /ready still says ready) made ClusterManager._admit price the call over no (prefill, decode) option, and
# AdmissionPolicy.check_options raised InvalidRequestError("admission needs at least one serving worker ..."),
# which the HTTP layer (api_run._refusal) answered as a 400 invalid_request_error: a server-side condition blamed
# on the client. Without admission the same call is served whole on a prefill worker; fixed: admission prices
# that option too, so the call is admitted (or refused with a 429 on its SLO) and routed as placement routes it.
def test_admission_without_a_decode_worker_prices_the_prefill_workers_as_placement_routes() -> None:
    async def main() -> None:
        admission = AdmissionPolicy("early", AdmissionSLO(10.0, 10.0), {}, default_model=COST)
        cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4, tokenizer_probe_hash="probe"),
                                 admission=admission)
        await cluster.start()
        context = zmq.asyncio.Context()
        try:
            worker = ScriptedWorker(context, cluster, "p0")
            await worker.send(register("p0", role="prefill"))
            await worker.expect(rpc.RegisterAck)
            await worker.heartbeat()
            assert cluster.is_ready()[0]
            stream = cluster.generate(call("r0"))
            first = asyncio.ensure_future(stream.__anext__())
            add = await worker.expect(rpc.AddRequest)
            assert add.request_id == "r0" and not add.decode_worker  # whole, on the prefill worker
            await worker.send(rpc.TokenDeltas("p0", (TokenDelta("r0", (5,), "x", True, "length", 3,
                                                                worker_id="p0"),)))
            assert (await asyncio.wait_for(first, 2.0)).finish_reason == "length"
            await stream.aclose()
            await settle()
            assert cluster.num_in_flight == 0 and cluster.num_waiting == 0
        finally:
            await cluster.shutdown(timeout_s=0.1)
            context.destroy(linger=0)

    asyncio.run(main())


# Was a bug: the router's global prefix index learns a routed prompt's blocks optimistically (state.commit ->
# GlobalPrefixIndex.on_routed) and is only ever corrected by the worker's KV events; a call that ends before its
# worker cached anything (aborted while queued, or refused by the engine with an error delta) produces no
# event, so the index keeps claiming the worker holds those blocks forever (only a seq gap's snapshot or the
# 1M-block bound ever drops them). Seen with real tiny-random workers too: 8 calls aborted right after submit ->
# /cluster shows indexed_blocks 48 against num_cached_blocks 0 at idle. longest_prefix / preble then route
# later prompts with that prefix to a worker that does not have it. Fixed: such an ending marks the worker, whose
# entries are resynced from a snapshot at its next idle heartbeat (or INDEX_RESYNC_S later when it stays busy).
@pytest.mark.parametrize("ending", ["abort", "error"])
def test_a_call_that_ended_before_caching_leaves_no_blocks_in_the_index(ending: str) -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        worker = ScriptedWorker(context, cluster, "w0")
        await worker.join()
        tokens = tuple(range(1, 14))  # 3 full blocks of 4
        stream = cluster.generate(call("r0", tokens))
        first = asyncio.ensure_future(stream.__anext__())
        add = await worker.expect(rpc.AddRequest)
        assert add.request_id == "r0"
        hashes = hash_block_tokens(CacheKey("rev1", LAYOUT), list(tokens), 4)
        assert cluster.state.index.match(hashes) == {"w0": 3}  # optimistic, as designed
        if ending == "abort":
            await cluster.abort("r0")
            await worker.expect(rpc.Abort)
        # The worker never prefilled it: it ends the call with no token and stores nothing (no KV event).
        await worker.send(rpc.TokenDeltas("w0", (TokenDelta("r0", (), "", True, ending, len(tokens), worker_id="w0"),)))
        assert (await asyncio.wait_for(first, 2.0)).finish_reason == ending
        await stream.aclose()
        await worker.heartbeat()  # idle, nothing cached: the router asks for the truth
        request = await worker.expect(rpc.SnapshotRequest)
        assert "before its first token" in request.reason
        await worker.send(rpc.SnapshotResponse("w0", 0, ()))
        for _ in range(3):
            await worker.heartbeat()
            await settle()
        assert cluster.num_in_flight == 0
        assert cluster.state.index.match(hashes) == {}, "the index claims blocks the worker never cached"

    run_cluster(body)


# Was a bug: when the send of a disaggregated call to its decode worker found that worker unreachable, the worker
# left the pool and failed the call (aborting it on the prefill worker), and then the prefill leg's AddRequest went
# out anyway: the prefill worker started a handoff for a call already over, held until it failed or its lease ran
# out. Fixed: _route sends the prefill leg only while the call is still live.
def test_an_unreachable_decode_worker_gets_no_prefill_leg_started_after_the_call_failed() -> None:
    sent: list[tuple[str, rpc.Message]] = []

    class _DecodeGone:
        def send(self, worker_id: str, message: rpc.Message) -> OSError | None:
            if worker_id == "d0":
                return OSError(113, "Host unreachable")
            sent.append((worker_id, message))
            return None

    cluster = ClusterManager(ClusterConfig(model_name="tiny-random", block_size=4, local_prefill_threshold_tokens=0,
                                           migration_limit=0),  # the call fails rather than run whole on p0
                             clock=lambda: 0.0)
    for worker_id, role in (("p0", "prefill"), ("d0", "decode")):
        cluster.pool.handle(worker_id, replace(register(worker_id, role=role),
                                           kv_address="shm://127.0.0.1:1" if role == "decode" else ""))
        cluster.pool.handle(worker_id, rpc.Stats(worker_id, 0, 0, 0, 0, 64, 0, 0, 0, 0, 0, 0.0))
    cluster.pool.socket = _DecodeGone()  # type: ignore[assignment]
    deltas: list[TokenDelta] = []
    cluster.submit(call("r0", tuple(range(1, 40))), deltas.append)
    assert "d0" in cluster.lost_workers and [d.finish_reason for d in deltas] == ["error"]
    assert [type(m).__name__ for worker, m in sent if worker == "p0"] == ["Abort"], sent
    assert cluster.num_in_flight == 0
