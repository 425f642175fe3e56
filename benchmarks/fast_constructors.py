"""What the `fast_*` constructor copies save end to end: the simulator's CPU with them against `__init__`.

Several hot paths build frozen slotted dataclass values with `object.__new__` and slot setters instead of the
generated `__init__` (`cache/fast_init.py`; builders in `scheduler/fast_values.py`, `transfer/fast_messages.py`,
`router/base.py`, `cache/events.py`, `cache/radix_node.py`, `transfer/destination.py`, `sim/worker.py`). Issue 20
keeps such a copy only where it saves >= 5 % end to end. This measures it per builder, in one process:

1. one simulated run with every builder wrapped by a counter (exact call counts; the first call's arguments kept);
2. per builder, the time of a call (timeit, best of repeats) and of the class's own `__init__` building the
   same value from the result's fields: the saving per call;
3. the same run again unwrapped, for its CPU time: each builder's share = calls x saving per call / that CPU.

The `__init__` side builds from the finished value's fields, so work a builder does to derive a field counts on the
fast side only: a saving here is a lower bound (a builder that only sets fields is measured exactly).
Usage: python benchmarks/fast_constructors.py [--cluster 8P8D --policy preble --num-requests 2000]; one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import timeit
from collections.abc import Callable
from typing import Any

from kvbaton.bench.workloads import create_workload
from kvbaton.sim.run import SimSetup, simulate

BUILDERS = (  # (module, function name) of every builder that skips __init__
    ("kvbaton.scheduler.fast_values", "make_chunk"),
    ("kvbaton.scheduler.fast_values", "make_plan"),
    ("kvbaton.scheduler.fast_values", "make_result"),
    ("kvbaton.transfer.fast_messages", "make_transfer_id"),
    ("kvbaton.transfer.fast_messages", "make_first_token"),
    ("kvbaton.transfer.fast_messages", "make_outgoing"),
    ("kvbaton.transfer.fast_messages", "make_reserve_request"),
    ("kvbaton.transfer.fast_messages", "make_layer_chunk"),
    ("kvbaton.transfer.fast_messages", "make_source_done"),
    ("kvbaton.transfer.fast_messages", "make_reserve_granted"),
    ("kvbaton.transfer.fast_messages", "make_ack"),
    ("kvbaton.router.base", "make_route_request"),
    ("kvbaton.router.base", "make_cost_terms"),
    ("kvbaton.router.base", "make_route_decision"),
    ("kvbaton.cache.events", "make_kv_event"),
    ("kvbaton.cache.radix_node", "make_prefix_match"),
    ("kvbaton.transfer.destination", "_make_adopted"),
)


class Counted:
    """A builder wrapped: counts its calls and keeps the first call's arguments."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.calls = 0
        self.first: tuple[tuple[Any, ...], dict[str, Any]] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        if self.first is None:
            self.first = (args, kwargs)
        return self.fn(*args, **kwargs)


def swap_everywhere(old: object, new: object) -> None:
    """Replace every module-level reference to `old` (the builder's own module and every `from ... import`)."""
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if not namespace or not getattr(module, "__name__", "").startswith("kvbaton"):
            continue
        for name, value in list(namespace.items()):
            if value is old:
                setattr(module, name, new)


def per_call_s(fn: Callable[[], object]) -> float:
    timer = timeit.Timer(fn)
    number, _ = timer.autorange()
    return min(timer.repeat(5, number)) / number


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cluster", default="8P8D")
    parser.add_argument("--policy", default="preble")
    parser.add_argument("--workload", default="tool-use")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=40.0)
    args = parser.parse_args()
    import importlib

    builders = {name: getattr(importlib.import_module(module), name) for module, name in BUILDERS}
    requests = create_workload(args.workload, num_requests=args.num_requests, seed=0, rate=args.rate)
    setup = SimSetup(model="llama-3-8b", gpu="h100", cluster=args.cluster, policy=args.policy)
    simulate(requests, setup)  # warm: imports, caches
    started = time.process_time()
    simulate(requests, setup)
    cpu_s = time.process_time() - started
    counted = {name: Counted(fn) for name, fn in builders.items()}
    for name, fn in builders.items():
        swap_everywhere(fn, counted[name])
    simulate(requests, setup)
    for name, fn in builders.items():
        swap_everywhere(counted[name], fn)
    rows = []
    for name, fn in builders.items():
        wrapped = counted[name]
        if wrapped.first is None:
            rows.append({"builder": name, "calls": 0})
            continue
        call_args, call_kwargs = wrapped.first
        value = fn(*call_args, **call_kwargs)
        cls = type(value)
        field_values = [getattr(value, f.name) for f in dataclasses.fields(value)]
        fast_s = per_call_s(lambda: fn(*call_args, **call_kwargs))
        init_s = per_call_s(lambda: cls(*field_values))
        saved_s = wrapped.calls * (init_s - fast_s)
        rows.append({"builder": name, "class": cls.__name__, "calls": wrapped.calls,
                     "fast_us": round(1e6 * fast_s, 3), "init_us": round(1e6 * init_s, 3),
                     "saved_cpu_s": round(saved_s, 4), "saved_fraction": round(saved_s / cpu_s, 4)})
    total = sum(row.get("saved_cpu_s", 0.0) for row in rows)
    print(json.dumps({"metric": "fast_constructor_saving", "cluster": args.cluster, "policy": args.policy,
                      "workload": args.workload, "num_requests": len(requests), "run_cpu_s": round(cpu_s, 3),
                      "total_saved_fraction": round(total / cpu_s, 4), "threshold": 0.05,
                      "builders": sorted(rows, key=lambda row: -row.get("saved_cpu_s", 0.0))}))


if __name__ == "__main__":
    main()
