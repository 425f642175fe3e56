"""Benchmark layer: workloads, arrival processes, per-request records, metrics and reports.

The live `kvbaton bench` driver, the simulator and the planner all produce their figures
through this package, so a TTFT or a goodput means the same thing everywhere. Pure Python plus
numpy: no torch, fastapi or zmq; matplotlib is imported only when a plot is drawn.

Entry points: `create_workload` / `WORKLOADS` (kvbaton.bench.workloads), `RequestRecord`
(records), `SLO`, `summarize`, `max_goodput_rate`, `pool_goodput_per_gpu` (metrics),
`write_report` (report), `describe_workload` (sharing), `run_live` (driver, needs httpx).
"""

from kvbaton.bench.metrics import SLO, Summary, jain_index, max_goodput_rate, pool_goodput_per_gpu, summarize
from kvbaton.bench.records import RequestRecord, read_records, write_records
from kvbaton.bench.workloads import WORKLOADS, WorkloadRequest, create_workload

__all__ = [
    "SLO", "WORKLOADS", "RequestRecord", "Summary", "WorkloadRequest", "create_workload", "jain_index",
    "max_goodput_rate", "pool_goodput_per_gpu", "read_records", "summarize", "write_records",
]
