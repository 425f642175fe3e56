"""One rank process of a tensor/pipeline-parallel worker: its model shard, its KV heads and layers, one step at a time.

Started by `RankGroup` (`python -m kvbaton.engine.rank_process ARGS_JSON`) with two pipes of its own. It loads
the model, keeps its shard (`kvbaton.model.sharding`), joins the worker's `torch.distributed` group (gloo on
CPU, NCCL on CUDA; rendezvous through a file in the front process's private directory, peers on loopback) and
maps the worker's KV region: its KV pool is the slice of that region holding its layers and its KV heads. Then
each plan the front sends runs through the same `ModelRunner` as a one-process worker. Under pipeline
parallelism a plan is cut into micro-batches (`micro_batches`: a long prefill chunk into pieces), each sent on
(`isend`) as soon as its layers are done, so stage s runs micro-batch i+1 while stage s+1 runs micro-batch i. A closed pipe (the front is gone) ends
the process.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kvbaton.core.step import ScheduledChunk, StepPlan
from kvbaton.engine.kv_storage import KVStorage
from kvbaton.engine.model_runner import ModelRunner
from kvbaton.engine.rank_wire import RankPipeClosed, decode_step, encode_prompt_logprobs, read_frame, write_frame
from kvbaton.model.llama import LlamaModel
from kvbaton.model.registry import model_revision, read_model_source, resolve_dtype, resolve_model_source
from kvbaton.model.sharding import ModelShard, shard_config, shard_state_dict
from kvbaton.transfer.layout import KVLayout
from kvbaton.transfer.transport_shm import ShmKVRegion


@dataclass(slots=True)
class PipelineLink:
    """This rank's neighbours in the pipeline: the same tensor rank of the previous and the next stage."""

    is_first: bool
    hidden_size: int
    dtype: torch.dtype
    device: str
    prev_rank: int
    next_rank: int
    pending: list[tuple[Any, torch.Tensor]] = field(default_factory=list)  # isends in flight and their tensors

    def receive(self, num_tokens: int) -> torch.Tensor:
        hidden = torch.empty(num_tokens, self.hidden_size, dtype=self.dtype, device=self.device)
        dist.recv(hidden, src=self.prev_rank)
        return hidden

    def send(self, hidden: torch.Tensor) -> None:
        hidden = hidden.contiguous()
        self.pending.append((dist.isend(hidden, dst=self.next_rank), hidden))

    def wait_sent(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


MIN_MICRO_BATCH_TOKENS = 32  # below this a micro-batch's send costs more than the overlap it buys


def micro_batches(plan: StepPlan, num_stages: int, speculative: Collection[str] = ()) -> list[StepPlan]:
    """The plan's tokens in order, in up to 2 x `num_stages` runs of about equal size, so that stage s computes one
    while stage s+1 computes the one before (the bubble is (stages - 1) / (runs + stages - 1) of a step).

    A prefill chunk may be cut in two: its second piece starts where the first ends and attends over the KV this
    stage's layers wrote for the first, exactly as a later chunk of a chunked prefill does; only the last piece
    samples. A decode (and its drafts) is never cut."""
    num_tokens = plan.num_batched_tokens
    num_runs = min(2 * num_stages, num_tokens // MIN_MICRO_BATCH_TOKENS)
    if num_stages == 1 or num_runs < 2:
        return [plan]
    target = -(-num_tokens // num_runs)
    batches: list[StepPlan] = []
    current: list[ScheduledChunk] = []
    room = target
    for chunk in plan.chunks:
        while (chunk.num_tokens > room and chunk.num_tokens > 1 and chunk.request_id not in speculative
               and len(batches) < num_runs - 1):
            head = ScheduledChunk(chunk.request_id, chunk.start_pos, chunk.token_ids[:room], chunk.block_ids, False)
            chunk = ScheduledChunk(chunk.request_id, chunk.start_pos + room, chunk.token_ids[room:], chunk.block_ids,
                                   chunk.samples)
            current.append(head)
            batches.append(StepPlan(plan.step_id, tuple(current), sum(c.num_tokens for c in current)))
            current, room = [], target
        current.append(chunk)
        room -= chunk.num_tokens
        if room <= 0 and len(batches) < num_runs - 1:
            batches.append(StepPlan(plan.step_id, tuple(current), sum(c.num_tokens for c in current)))
            current, room = [], target
    if current:
        batches.append(StepPlan(plan.step_id, tuple(current), sum(c.num_tokens for c in current)))
    return batches


def main(args: dict[str, Any]) -> int:
    fd_in, fd_out = int(args["fd_in"]), int(args["fd_out"])
    if args["num_threads"] > 0:
        torch.set_num_threads(int(args["num_threads"]))
    tp_size, pp_size, rank = int(args["tp_size"]), int(args["pp_size"]), int(args["rank"])
    shard = ModelShard(rank % tp_size, tp_size, rank // tp_size, pp_size)
    device = str(args["device"])
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"file://{args['store_path']}", rank=rank,
                            world_size=tp_size * pp_size)
    region = None
    try:
        # Every rank creates every stage's tensor group, in the same order, as torch.distributed requires.
        groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size))) if pp_size > 1 else None
                  for s in range(pp_size)]
        group = groups[shard.pp_rank]
        source = resolve_model_source(str(args["model"]))
        config, state_dict, _ = read_model_source(source)
        if model_revision(source, state_dict) != args["revision"]:
            raise RuntimeError(f"model {args['model']!r} changed since the worker read it")
        dtype = resolve_dtype(str(args["dtype"]))
        local_config = shard_config(config, shard)

        def all_reduce(tensor: torch.Tensor) -> None:
            dist.all_reduce(tensor, group=group)

        model = LlamaModel.from_hf_state_dict(local_config, shard_state_dict(config, state_dict, shard), dtype,
                                              device, all_reduce if tp_size > 1 else None, shard.is_last_stage)
        del state_dict
        if args["warm_up_rows"]:
            model.warm_up_linears(int(args["warm_up_rows"]), int(args["warm_up_rows"]))
        layout = KVLayout(*args["layout"])
        region = ShmKVRegion.attach(str(args["region_path"]), layout, int(args["num_blocks"]))
        layers = shard.layer_range(config.num_layers)
        heads = shard.kv_head_range(config.num_kv_heads)
        full = region.torch_view()
        own_kv = full[layers.start:layers.stop, :, :, :, heads.start:heads.stop]  # type: ignore[index]
        storage = KVStorage(local_config, int(args["num_blocks"]), layout.block_size, dtype, device, own_kv)
        link = None
        if pp_size > 1:
            link = PipelineLink(shard.is_first_stage, config.hidden_size, dtype, device, rank - tp_size,
                                rank + tp_size)
        runner = ModelRunner(model, storage, device, link)
        is_result_rank = shard.is_last_stage and shard.tp_rank == 0
        write_frame(fd_out, {"op": "ready", "rank": rank})
        return _serve(fd_in, fd_out, runner, link, pp_size, is_result_rank)
    except RankPipeClosed:
        return 0
    except Exception as exc:  # the front reads why, then sees this process end
        try:
            write_frame(fd_out, {"op": "error", "message": f"rank {rank}: {type(exc).__name__}: {exc}"})
        except OSError:
            pass
        return 1
    finally:
        if region is not None:
            region.close()
        dist.destroy_process_group()


def _serve(fd_in: int, fd_out: int, runner: ModelRunner, link: PipelineLink | None, num_stages: int,
           is_result_rank: bool) -> int:
    while True:
        message = read_frame(fd_in)
        if message.get("op") == "stop":
            return 0
        plan, wanted, speculative = decode_step(message)
        logits_parts, row_ids, prompt_out = [], [], {}
        for batch in micro_batches(plan, num_stages, speculative):
            logits, ids, prompt = runner.execute(batch, None, wanted or None, speculative)
            if ids:
                logits_parts.append(logits)
                row_ids.extend(ids)
            for request_id, entries in prompt.items():  # a cut chunk's pieces come in order
                prompt_out.setdefault(request_id, []).extend(entries)
        if link is not None:
            link.wait_sent()
        if not is_result_rank:
            write_frame(fd_out, {"op": "done"})
            continue
        logits = torch.cat(logits_parts) if logits_parts else torch.empty(0, 0)
        write_frame(fd_out, {"op": "done", "rows": row_ids, "shape": list(logits.shape),
                             "logits": logits.float().contiguous().cpu().numpy().tobytes(),
                             "prompt_logprobs": encode_prompt_logprobs(prompt_out)})


if __name__ == "__main__":
    with torch.inference_mode():
        sys.exit(main(json.loads(sys.argv[1])))
