"""What each worker's Ray actor holds (`launcher.ray_share`: its rank processes' CPUs and GPUs) and what a Ray
cluster's nodes cannot hold at all (`ray_workers.placement_refusal`, refused at once instead of waited for). Pure:
node resources as `ray.nodes()` reports them, no Ray started (tests/server/test_ray_launch.py and
test_ray_serve.py run the same through real Ray clusters)."""

from __future__ import annotations

import pytest

from kvbaton.cli import main
from kvbaton.server.launcher import ServeConfig, ray_share, worker_args
from kvbaton.server.ray_workers import RayWorker, placement_refusal


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_a_worker_holds_one_share_per_rank_process_and_its_arguments_carry_its_degrees() -> None:
    config = ServeConfig(model="tiny-random", num_workers=0, num_prefill=1, num_decode=1, threads_per_worker=2,
                         prefill_tensor_parallel_size=2, decode_pipeline_parallel_size=3, gpus_per_worker=1.0,
                         ray_address="auto")
    assert ray_share(config, "prefill") == (4.0, 2.0)  # TP2: two ranks of 2 threads, a GPU each
    assert ray_share(config, "decode") == (6.0, 3.0)  # PP3
    prefill = worker_args(config, "tcp://10.0.0.1:1", "p0", "prefill")
    assert (_flag(prefill, "--tensor-parallel-size"), _flag(prefill, "--threads")) == ("2", "2")
    assert _flag(worker_args(config, "tcp://10.0.0.1:1", "d0", "decode"), "--pipeline-parallel-size") == "3"
    one_rank = ServeConfig(num_workers=2, threads_per_worker=3, gpus_per_worker=0.5, ray_address="auto")
    assert ray_share(one_rank, "mixed") == (3.0, 0.5)  # as before parallel workers: the flags' own values
    tp2 = ServeConfig(num_workers=1, threads_per_worker=1, tensor_parallel_size=2, ray_address="auto")
    assert ray_share(tp2, "mixed") == (2.0, 0.0)  # no --gpus-per-worker: no GPU


def _node(cpus: float, gpus: float = 0.0) -> dict[str, float]:
    return {"CPU": cpus, "GPU": gpus, "memory": 1e9, "node:127.0.0.1": 1.0}


def test_nodes_that_hold_the_workers_are_not_refused() -> None:
    workers = [RayWorker("p0", (), 2.0, 2.0), RayWorker("d0", (), 1.0, 1.0)]
    assert placement_refusal(workers, [_node(2, 2), _node(1, 1)]) == ""
    assert placement_refusal(workers, [_node(3, 3)]) == ""
    assert placement_refusal([RayWorker("w0", ()), RayWorker("w1", ())], []) == ""  # nothing held: Ray decides


def test_a_parallel_worker_no_node_can_hold_is_refused() -> None:
    # Three CPUs in all, but a TP2 worker's two fit on neither one-CPU node ...
    refusal = placement_refusal([RayWorker("w0", (), 2.0)], [_node(1), _node(1), _node(1)])
    assert refusal.startswith("the Ray cluster's nodes can hold 0 of the 1 workers with 2 CPUs each"), refusal
    # ... nor two TP2 workers on a 3-CPU and a 1-CPU node, though the cluster has the 4 CPUs they need.
    refusal = placement_refusal([RayWorker("w0", (), 2.0), RayWorker("w1", (), 2.0)], [_node(3), _node(1)])
    assert refusal.startswith("the Ray cluster's nodes can hold 1 of the 2 workers with 2 CPUs each"), refusal


def test_a_larger_share_counts_against_the_room_for_a_smaller_one() -> None:
    # A TP2 prefill worker (2 GPUs) and two TP1 decode workers (1 GPU): 4 GPUs, and the cluster has 4, but two
    # 2-GPU slots hold the prefill worker and one decode worker only ...
    workers = [RayWorker("p0", (), 1.0, 2.0), RayWorker("d0", (), 1.0, 1.0), RayWorker("d1", (), 1.0, 1.0)]
    assert placement_refusal(workers, [_node(4, 2), _node(4, 2)]) == ""
    # ... while on three nodes of 1, 1 and 2 GPUs the room for 2 GPUs holds one, and for 1 GPU all three.
    assert placement_refusal(workers, [_node(4, 1), _node(4, 1), _node(4, 2)]) == ""
    refusal = placement_refusal(workers, [_node(4, 1), _node(4, 1), _node(4, 1), _node(4, 1)])
    assert refusal.startswith("the Ray cluster's nodes can hold 0 of the 1 workers with 1 CPUs and 2 GPUs each")
    # Enough CPUs (4) and GPUs (4) in all, but a GPU node's one CPU goes to whichever worker lands there.
    refusal = placement_refusal(workers, [_node(1, 2), _node(1, 2), _node(2, 0)])
    assert "can hold 2 of the 3 workers with 1 CPUs and 1 GPUs or more each" in refusal, refusal


def test_more_than_the_cluster_has_is_refused_with_each_workers_share() -> None:
    workers = [RayWorker("p0", (), 4.0), RayWorker("d0", (), 1.0), RayWorker("d1", (), 1.0)]
    refusal = placement_refusal(workers, [_node(4), _node(1)])
    assert refusal.startswith("the Ray cluster has 5 CPUs; its 3 workers (1 with 4 CPUs and 2 with 1 CPUs) need 6")
    refusal = placement_refusal([RayWorker("w0", (), 1.0, 1.0)], [_node(8)])
    assert refusal.startswith("the Ray cluster has 0 GPUs; its 1 workers (1 with 1 GPUs each) need 1"), refusal


@pytest.mark.parametrize("parallel", [["-tp", "2"], ["--prefill", "1", "--decode", "1", "--decode-pp", "2"]])
def test_gpus_for_parallel_workers_are_refused_before_ray_reserves_them(
        parallel: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    # Rank processes keep their KV in host shared memory: on a GPU every rank would refuse, after Ray held its GPUs.
    assert main(["serve", "--model", "tiny-random", "--ray", "local", "--gpus-per-worker", "1", *parallel]) == 2
    assert "tensor/pipeline parallel workers run on CPU only so far" in capsys.readouterr().err
