"""The router RPC under CurveZMQ, attack by attack: a worker registering without the cluster secret (no CURVE at
all, or CURVE with keys of another secret), a re-registration hijack of a live worker's id, and a worker led to a
router without the secret. Only a holder of the secret takes an id over (a restart)."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from kvbaton.core.cluster_secret import ClusterSecret
from kvbaton.server import rpc
from kvbaton.server.base import TokenDelta
from kvbaton.server.cluster import ClusterManager
from kvbaton.server.rpc_auth import curve_keys, secure_dealer, secure_router
from tests.server.test_cluster_manager import ScriptedWorker, call, register, run_cluster, settle

SILENCE_S = 1.0  # how long an intruder is given to be heard (zmq retries its handshake every 0.1 s meanwhile)


def intruder(context: zmq.asyncio.Context, cluster: ClusterManager, worker_id: str,
             secret: ClusterSecret | None) -> zmq.asyncio.Socket:
    """A DEALER that claims `worker_id`: plain zmq (secret None), or CURVE with the keys of `secret`."""
    socket = context.socket(zmq.DEALER)
    if secret is not None:
        secure_dealer(socket, secret)
    socket.setsockopt(zmq.IDENTITY, worker_id.encode())
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(cluster.address)
    return socket


async def heard(socket: zmq.asyncio.Socket, timeout_s: float = SILENCE_S) -> bool:
    return bool(await socket.poll(int(timeout_s * 1000)))


async def served_by(cluster: ClusterManager, worker: ScriptedWorker, request_id: str) -> None:
    """Route one call; `worker` must be the one that receives it (and answers it to the end)."""
    stream = cluster.generate(call(request_id))
    first = asyncio.ensure_future(stream.__anext__())
    add = await worker.expect(rpc.AddRequest)
    assert isinstance(add, rpc.AddRequest) and add.request_id == request_id
    await worker.send(rpc.TokenDeltas(worker.worker_id, (TokenDelta(request_id, (7,), "a", True, "length", 9, 0,
                                                                    worker_id=worker.worker_id),)))
    assert (await first).finished


def test_a_worker_without_the_secret_cannot_register() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        for worker_id, secret in (("plain", None), ("other", ClusterSecret.generate())):
            socket = intruder(context, cluster, worker_id, secret)
            await socket.send(rpc.encode(register(worker_id)))
            assert not await heard(socket)  # no RegisterAck, no RegisterRefuse: the handshake never completed
            assert worker_id not in cluster.workers and cluster.num_serving_workers == 0
            socket.close(linger=0)

    run_cluster(body)


def test_a_re_registration_hijack_of_a_live_worker_id_is_refused() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        worker = ScriptedWorker(context, cluster, "w0")
        await worker.join()
        for secret in (None, ClusterSecret.generate()):
            thief = intruder(context, cluster, "w0", secret)  # ROUTER_HANDOVER would hand it w0's routing id
            await thief.send(rpc.encode(register("w0")))
            await thief.send(rpc.encode(rpc.Goodbye("w0", "hijacked")))
            await asyncio.sleep(SILENCE_S)
            assert sorted(cluster.workers) == ["w0"] and "w0" not in cluster.lost_workers
            await served_by(cluster, worker, f"after-{secret is None}")  # still routed to the real w0
            assert not await heard(thief, 0.2)  # the thief got neither the ack nor the call
            thief.close(linger=0)

    run_cluster(body)


def test_only_a_holder_of_the_secret_takes_a_worker_id_over() -> None:
    async def body(cluster: ClusterManager, context: zmq.asyncio.Context) -> None:
        old = ScriptedWorker(context, cluster, "w0")
        await old.join()
        restarted = ScriptedWorker(context, cluster, "w0")  # the same id, with the secret: a restart
        ack = await restarted.join()
        assert isinstance(ack, rpc.RegisterAck)
        await settle()
        assert sorted(cluster.workers) == ["w0"]
        await served_by(cluster, restarted, "to-the-new-one")

    run_cluster(body)


def test_a_worker_hears_no_router_without_the_secret() -> None:
    """A worker led to a fake router (plain zmq, or CURVE under another secret) completes no handshake: the
    router never reads its registration, and nothing it could send would reach the worker."""
    secret = ClusterSecret.generate()
    for fake_secret in (None, ClusterSecret.generate()):
        context = zmq.Context()
        router, worker = context.socket(zmq.ROUTER), context.socket(zmq.DEALER)
        authenticator = secure_router(router, context, fake_secret) if fake_secret is not None else None
        try:
            port = router.bind_to_random_port("tcp://127.0.0.1")
            secure_dealer(worker, secret)
            worker.setsockopt(zmq.IDENTITY, b"w0")
            worker.connect(f"tcp://127.0.0.1:{port}")
            worker.send(rpc.encode(register("w0")))
            assert not router.poll(int(SILENCE_S * 1000))
        finally:
            worker.close(linger=0)
            router.close(linger=0)
            if authenticator is not None:
                authenticator.stop()
            context.term()


def test_both_key_pairs_come_from_the_secret_and_differ_per_secret() -> None:
    first, second = ClusterSecret.generate(), ClusterSecret.generate()
    assert curve_keys(first) == curve_keys(ClusterSecret(first.value))
    assert curve_keys(first).client_public != curve_keys(second).client_public
    assert curve_keys(first).server_public != curve_keys(first).client_public
    assert first.value.hex() not in repr(first) and repr(curve_keys(first)) == "CurveKeys(...)"
