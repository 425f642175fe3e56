"""A serving worker's own step timings, written as JSON lines for `kvbaton profile --from-step-log`.

`kvbaton profile` times the engine alone on an idle host; a serving worker also pays for its loop
(router messages, heartbeats, sending tokens) and shares the host's cores and memory bandwidth with
the router and its peers. With `kvbaton worker --step-log FILE` (or `kvbaton serve --step-log-dir DIR`)
each worker records, per step, the batch shape and the time until it could start its next step:
back to back, the period from one step's start to the next; when the queue ran dry, the step itself.
Those samples fit the simulator's cost model for this host *as it serves*.
"""

from __future__ import annotations

from pathlib import Path

from kvbaton.core.step import StepPlan
from kvbaton.sim.costs.base import BatchShape
from kvbaton.sim.costs.fit import StepSample, write_step_samples


class StepLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.samples: list[StepSample] = []
        self._open: tuple[BatchShape, float, float] | None = None  # a busy step waiting for the next one's start

    def on_step(self, plan: StepPlan, started_s: float, ended_s: float, still_busy: bool) -> None:
        """A step ran from `started_s` to `ended_s` (tokens sent); `still_busy`: more work is queued."""
        if self._open is not None:
            shape, open_started_s, _ = self._open
            self.samples.append(StepSample(shape, started_s - open_started_s))
            self._open = None
        if not plan.chunks:
            return
        shape = BatchShape.of_plan(plan)
        if still_busy:
            self._open = (shape, started_s, ended_s)
        else:
            self.samples.append(StepSample(shape, ended_s - started_s))

    def on_idle(self) -> None:
        """The worker waited for work: a step left open ends at its own end."""
        if self._open is not None:
            shape, started_s, ended_s = self._open
            self.samples.append(StepSample(shape, ended_s - started_s))
            self._open = None

    def write(self) -> None:
        self.on_idle()
        write_step_samples(self.path, self.samples)
