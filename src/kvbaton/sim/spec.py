"""Cluster specs: `4xmixed`, `2P2D`, `2P2D:tp_p=2,link=nvlink` -> the workers to simulate.

Grammar: `<N>xmixed`, `<P>P<D>D` or both (`<N>xmixed+<P>P<D>D`), then optionally `:` and comma-separated options:
`tp`/`pp` (every worker), `tp_p`/`pp_p` (prefill pool), `tp_d`/`pp_d` (decode pool), and
`link=<preset>` for prefill->decode KV transfers (default infiniband). Each option at most once; a mixed
cluster takes only `tp` and `pp`. Worker ids: `w<i>` mixed, `p<i>` prefill, `d<i>` decode.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kvbaton.core.errors import InvalidRequestError
from kvbaton.sim.costs.base import Parallelism
from kvbaton.sim.links import get_link

ROLES = ("mixed", "prefill", "decode")
_MIXED = re.compile(r"^(\d+)x(mixed)$")
_DISAGG = re.compile(r"^(\d+)P(\d+)D$", re.IGNORECASE)
_COMBINED = re.compile(r"^(\d+)xmixed\+(\d+)P(\d+)D$", re.IGNORECASE)  # both kinds of pool, as `kvbaton serve` runs
_INT_OPTIONS = ("tp", "pp", "tp_p", "pp_p", "tp_d", "pp_d")


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    worker_id: str
    role: str  # mixed | prefill | decode
    parallel: Parallelism


@dataclass(frozen=True, slots=True)
class ClusterSpec:
    text: str  # as given
    workers: tuple[WorkerSpec, ...]
    link: str = "infiniband"  # prefill -> decode KV link preset

    @property
    def disaggregated(self) -> bool:
        return any(w.role != "mixed" for w in self.workers)

    @property
    def num_gpus(self) -> int:
        return sum(w.parallel.num_gpus for w in self.workers)

    def of_role(self, role: str) -> list[WorkerSpec]:
        return [w for w in self.workers if w.role == role]


def parse_cluster_spec(text: str) -> ClusterSpec:
    shape, _, option_text = text.strip().partition(":")
    options: dict[str, str] = {}
    for item in filter(None, option_text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or key not in (*_INT_OPTIONS, "link"):
            raise InvalidRequestError(f"cluster option {item!r}: expected one of {_INT_OPTIONS + ('link',)}=VALUE")
        if key in options:
            raise InvalidRequestError(f"cluster spec {text!r}: option {key} given twice")
        options[key] = value
    ints: dict[str, int] = {}
    for key in _INT_OPTIONS:
        if key in options:
            try:
                ints[key] = int(options[key])
            except ValueError:
                raise InvalidRequestError(f"cluster option {key} needs an integer, got {options[key]!r}") from None
    link = options.get("link", "infiniband")
    get_link(link)
    combined = _COMBINED.match(shape)
    mixed, disagg = _MIXED.match(shape), _DISAGG.match(shape)
    if mixed:
        pooled = sorted(set(options) - {"tp", "pp"})
        if pooled:  # a mixed cluster has no prefill or decode pool, nor transfers between them
            raise InvalidRequestError(f"cluster spec {text!r}: {', '.join(pooled)} applies to a <P>P<D>D cluster only")
        counts = {"mixed": int(mixed.group(1))}
    elif disagg:
        counts = {"prefill": int(disagg.group(1)), "decode": int(disagg.group(2))}
    elif combined:
        counts = {"mixed": int(combined.group(1)), "prefill": int(combined.group(2)), "decode": int(combined.group(3))}
    else:
        raise InvalidRequestError(f"cluster spec {text!r}: expected like 4xmixed, 2P2D, 2xmixed+1P1D or 2P2D:tp_p=2")
    if any(n <= 0 for n in counts.values()):
        raise InvalidRequestError(f"cluster spec {text!r}: every pool needs at least one worker")
    workers: list[WorkerSpec] = []
    for role, count in counts.items():
        suffix = {"mixed": "", "prefill": "_p", "decode": "_d"}[role]
        parallel = Parallelism(tp=ints.get(f"tp{suffix}", ints.get("tp", 1)),
                               pp=ints.get(f"pp{suffix}", ints.get("pp", 1)))
        prefix = {"mixed": "w", "prefill": "p", "decode": "d"}[role]
        workers += [WorkerSpec(f"{prefix}{i}", role, parallel) for i in range(count)]
    return ClusterSpec(text, tuple(workers), link)
