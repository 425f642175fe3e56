"""The front process's side of a tensor/pipeline-parallel worker: N rank processes behind one scheduler.

As vLLM's multiprocess executor: the engine (scheduler, block manager, prefix cache, sampler) stays in the front
process; `RankGroup` stands where a one-process worker's `ModelRunner` stands (`execute` has its signature).
It starts `tp x pp` rank processes (`kvbaton.engine.rank_process`), each with two pipes of its own and the path
of the worker's KV region, sends each step's plan to all of them and takes the sampling logits from the result
rank. The KV region (`ShmKVRegion`, a 0600 file in /dev/shm) holds every layer and KV head as a one-process
worker's storage does; rank (stage s, tensor rank t) computes and reads only its layers' and its heads' slice.
So the front process sees the whole KV as one storage: the KV store's loads and saves and the handoff read
and write it as they do for one process, and a handoff between different degrees lands each head where the rank
that owns it on the other side reads it. It lives in host shared memory: CPU only so far.

A rank that dies, or reports an error, fails the step within `poll_s` of it (`RankFailedError`); the engine
ends every request with that error. `close` (or the finalizer at exit) stops every rank by its pid.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Collection, Mapping

import numpy as np
import torch

from kvbaton.core.errors import KvbatonError
from kvbaton.core.step import SampledToken, StepPlan
from kvbaton.engine.model_runner import PromptLogprobsWanted
from kvbaton.engine.rank_wire import RankPipeClosed, decode_prompt_logprobs, encode_step, read_frame, write_frame
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.transport_shm import ShmKVRegion, remove_stale_regions

START_TIMEOUT_S = 600.0  # loading a model in several processes on a shared 2-core machine is slow
STOP_TIMEOUT_S = 5.0


class RankFailedError(KvbatonError):
    """A rank process of a parallel worker died or failed: the worker cannot run another step."""


class RankGroup:
    """`tp_size x pp_size` rank processes of one worker over one shared KV region (see the module docstring)."""

    def __init__(self, model: str, dtype: str, revision: str, layout: KVLayout, num_blocks: int, tp_size: int,
                 pp_size: int, *, region: ShmKVRegion | None = None, device: str = "cpu", num_threads: int = 0,
                 warm_up_rows: int = 0, poll_s: float = 0.002) -> None:
        """`region`: KV memory someone else owns (a decode worker's, which prefill workers write); else one is
        created here. `num_threads`: torch threads per rank (0: torch's default)."""
        if device != "cpu":
            raise KvbatonError(f"tensor/pipeline parallel workers run on CPU only so far (their KV is host shared "
                               f"memory), not on {device!r}")
        self.tp_size, self.pp_size = tp_size, pp_size
        self.poll_s = poll_s
        self._owns_region = region is None
        if region is None:
            remove_stale_regions()  # those of killed workers: this region would otherwise join them one day
        self.region = region if region is not None else ShmKVRegion.create(layout, num_blocks)
        self.kv_cache: torch.Tensor = self.region.torch_view()  # type: ignore[assignment]
        self._store_dir = tempfile.mkdtemp(prefix="kvbaton-ranks-")  # 0700: only this user reaches the rendezvous
        self.processes: list[subprocess.Popen] = []
        self._to_rank: list[int] = []
        self._from_rank: list[int] = []
        self._finalizer = weakref.finalize(self, _stop_ranks, self.processes, self._to_rank, self._from_rank,
                                           self._store_dir)
        env = dict(os.environ, GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"))
        try:
            for rank in range(tp_size * pp_size):
                to_rank_r, to_rank_w = os.pipe()
                from_rank_r, from_rank_w = os.pipe()
                args = {"fd_in": to_rank_r, "fd_out": from_rank_w, "model": model, "dtype": dtype,
                        "revision": revision, "device": device, "tp_size": tp_size, "pp_size": pp_size,
                        "rank": rank, "store_path": os.path.join(self._store_dir, "rendezvous"),
                        "region_path": self.region.path, "num_blocks": num_blocks, "num_threads": num_threads,
                        "warm_up_rows": warm_up_rows,
                        "layout": [getattr(layout, name) for name in layout.__dataclass_fields__]}
                process = subprocess.Popen([sys.executable, "-m", "kvbaton.engine.rank_process", json.dumps(args)],
                                           pass_fds=(to_rank_r, from_rank_w), env=env, stdin=subprocess.DEVNULL)
                os.close(to_rank_r)
                os.close(from_rank_w)
                self.processes.append(process)
                self._to_rank.append(to_rank_w)
                self._from_rank.append(from_rank_r)
            self._wait_all(lambda: None, time.monotonic() + START_TIMEOUT_S, "start")
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def execute(self, plan: StepPlan, between_layers: Callable[[], None] | None = None,
                prompt_logprobs: Mapping[str, PromptLogprobsWanted] | None = None,
                speculative: Collection[str] = (),
                ) -> tuple[torch.Tensor, list[str], dict[str, list[SampledToken]]]:
        """`ModelRunner.execute` over the ranks. `between_layers` is called while they run (every `poll_s`)."""
        frame = encode_step(plan, prompt_logprobs, speculative)
        try:
            for fd in self._to_rank:
                write_frame(fd, frame)
        except OSError as exc:
            raise RankFailedError(f"a rank process of this worker is gone ({exc})") from exc
        result = self._wait_all(between_layers or (lambda: None), float("inf"), "step")
        shape = tuple(result["shape"])
        if not result["rows"]:
            logits = torch.empty(0, 0)
        else:
            logits = torch.from_numpy(np.frombuffer(result["logits"], dtype=np.float32).reshape(shape).copy())
        return logits, [str(r) for r in result["rows"]], decode_prompt_logprobs(result["prompt_logprobs"])

    def _wait_all(self, between: Callable[[], None], deadline: float, what: str) -> dict:
        """Every rank's answer to the last frame; the result rank's (the one with logits) is returned."""
        waiting = dict(zip(self._from_rank, range(len(self._from_rank))))
        result: dict = {}
        while waiting:
            readable, _, _ = select.select(list(waiting), [], [], self.poll_s)
            for fd in readable:
                rank = waiting.pop(fd)
                try:
                    message = read_frame(fd)
                except RankPipeClosed:
                    raise RankFailedError(self._death_message(rank)) from None
                if message.get("op") == "error":
                    raise RankFailedError(str(message.get("message")))
                if "rows" in message or (what == "start" and rank == 0):
                    result = message
            if waiting:
                for rank in waiting.values():
                    if self.processes[rank].poll() is not None:
                        raise RankFailedError(self._death_message(rank))
                if time.monotonic() > deadline:
                    raise RankFailedError(f"rank processes did not {what} within {START_TIMEOUT_S:g} s")
                between()
        return result

    def _death_message(self, rank: int) -> str:
        process = self.processes[rank]
        try:
            code = process.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            code = None
        return f"rank {rank} (pid {process.pid}) of this worker ended (exit code {code})"

    def close(self) -> None:
        """Stop every rank (stop frame, then SIGKILL by pid after STOP_TIMEOUT_S) and free the region; idempotent."""
        self._finalizer()
        self.kv_cache = None  # type: ignore[assignment] - drop our view so the mapping can go
        if self._owns_region:
            self.region.close()


def _stop_ranks(processes: list[subprocess.Popen], to_rank: list[int], from_rank: list[int], store_dir: str) -> None:
    for fd in to_rank:
        try:
            write_frame(fd, {"op": "stop"})
        except OSError:
            pass
    deadline = time.monotonic() + STOP_TIMEOUT_S
    for process in processes:
        try:
            process.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    for fd in [*to_rank, *from_rank]:
        try:
            os.close(fd)
        except OSError:
            pass
    shutil.rmtree(store_dir, ignore_errors=True)
