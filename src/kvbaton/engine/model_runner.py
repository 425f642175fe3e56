"""Runs one StepPlan through the torch model: builds the flat batch, forwards it, returns sampling logits.

Every chunk of the plan (decodes and prefill chunks alike) goes through one forward; only the
last position of chunks that sample is projected to the vocabulary, except for requests that asked
for their prompt's logprobs, whose chunk's every row is (a few hundred rows at a time, so a long
prompt never holds all its [rows, vocab] logits at once).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import NamedTuple, Protocol

import torch

from kvbaton.core.step import SampledToken, StepPlan
from kvbaton.engine.kv_storage import KVStorage
from kvbaton.model.attention import AttentionMetadata, SequenceSlice
from kvbaton.model.llama import LlamaModel

PROMPT_LOGPROB_ROWS = 256  # rows projected to the vocabulary at a time for prompt logprobs


class PromptLogprobsWanted(NamedTuple):
    """A request whose prompt logprobs are wanted from `first_position` on (earlier ones were collected)."""

    num_top: int
    prompt_token_ids: Sequence[int]
    first_position: int  # the first prompt position whose logprob is still missing (>= 1)


class StageLink(Protocol):
    """A pipeline stage's neighbours (`kvbaton.engine.rank_process`): the previous stage's hidden states in, this
    stage's out."""

    is_first: bool

    def receive(self, num_tokens: int) -> torch.Tensor: ...

    def send(self, hidden: torch.Tensor) -> None: ...


class ModelRunner:
    def __init__(self, model: LlamaModel, storage: KVStorage, device: str = "cpu",
                 stage: StageLink | None = None) -> None:
        """`stage`: set on the ranks of a pipeline-parallel worker, whose model is one stage's layers."""
        self.model = model
        self.storage = storage
        self.device = device
        self.stage = stage

    @torch.inference_mode()
    def execute(self, plan: StepPlan, between_layers: Callable[[], None] | None = None,
                prompt_logprobs: Mapping[str, PromptLogprobsWanted] | None = None,
                speculative: Collection[str] = (),
                ) -> tuple[torch.Tensor, list[str], dict[str, list[SampledToken]]]:
        """Returns (logits [N, vocab] float32, request ids of those N rows in plan order, the prompt logprobs
        this step computed for the requests in `prompt_logprobs`: position p's entry is prompt token p's
        logprob given the tokens before it, from `first_position` on); `between_layers` is called after each
        layer of the forward (`LlamaModel.forward`). The chunks of `speculative` requests (a decode and its
        drafts) have every row projected, in order: their request id repeats once per row."""
        token_ids: list[int] = []
        positions: list[int] = []
        seqs: list[SequenceSlice] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        chunk_rows: list[int] = []  # each chunk's first row in the flat batch
        for chunk in plan.chunks:
            chunk_rows.append(len(token_ids))
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.end_pos))
            seqs.append(SequenceSlice(chunk.start_pos, chunk.num_tokens, chunk.block_ids))
            if chunk.samples and chunk.request_id in speculative:
                sample_rows.extend(range(len(token_ids) - chunk.num_tokens, len(token_ids)))
                sample_ids.extend([chunk.request_id] * chunk.num_tokens)
            elif chunk.samples:
                sample_rows.append(len(token_ids) - 1)
                sample_ids.append(chunk.request_id)
        meta = AttentionMetadata.build(seqs, self.storage.block_size, self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        position_ids = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden_in = None if self.stage is None or self.stage.is_first else self.stage.receive(len(token_ids))
        hidden = self.model(input_ids, position_ids, meta, self.storage.kv_cache, between_layers, hidden_in)
        if not self.model.is_last_stage:
            assert self.stage is not None
            self.stage.send(hidden)
            return torch.empty(0, 0), [], {}
        prompt_out: dict[str, list[SampledToken]] = {}
        if prompt_logprobs:
            for chunk, first_row in zip(plan.chunks, chunk_rows):
                wanted = prompt_logprobs.get(chunk.request_id)
                if wanted is not None:
                    prompt_out[chunk.request_id] = self._prompt_logprobs(hidden, chunk.start_pos, first_row,
                                                                         chunk.num_tokens, wanted)
        if not sample_rows:
            return torch.empty(0, 0), [], prompt_out
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows)), sample_ids, prompt_out

    def _prompt_logprobs(self, hidden: torch.Tensor, start_pos: int, first_row: int, num_tokens: int,
                         wanted: PromptLogprobsWanted) -> list[SampledToken]:
        """Row r of the chunk (position start_pos + r) predicts position start_pos + r + 1: the prompt tokens
        at positions [max(first_position, start_pos + 1), min(start_pos + num_tokens + 1, prompt length))."""
        prompt = wanted.prompt_token_ids
        first = max(wanted.first_position, start_pos + 1)
        end = min(start_pos + num_tokens + 1, len(prompt))
        out: list[SampledToken] = []
        for lo in range(first, end, PROMPT_LOGPROB_ROWS):
            hi = min(lo + PROMPT_LOGPROB_ROWS, end)
            rows = hidden[first_row + lo - 1 - start_pos: first_row + hi - 1 - start_pos]
            logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            targets = torch.tensor(prompt[lo:hi], dtype=torch.long, device=logprobs.device)
            own_column = logprobs.gather(1, targets[:, None])
            own = own_column[:, 0].tolist()
            ranks = ((logprobs > own_column).sum(dim=1) + 1).tolist()  # as vLLM ranks a prompt token: 1 + those above
            if wanted.num_top > 0:
                values, ids = torch.topk(logprobs, wanted.num_top, dim=-1)
                tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
            else:
                tops = [()] * (hi - lo)
            out.extend(SampledToken(t, lp, top, rank) for t, lp, top, rank in zip(prompt[lo:hi], own, tops, ranks))
        return out
