"""Runs one StepPlan through the torch model: builds the flat batch, forwards it, returns sampling logits.

Every chunk of the plan (decodes and prefill chunks alike) goes through one forward; only the
last position of chunks that sample is projected to the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvbaton.core.step import StepPlan
from kvbaton.engine.kv_storage import KVStorage
from kvbaton.model.attention import AttentionMetadata, SequenceSlice
from kvbaton.model.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, storage: KVStorage, device: str = "cpu") -> None:
        self.model = model
        self.storage = storage
        self.device = device

    @torch.inference_mode()
    def execute(self, plan: StepPlan,
                between_layers: Callable[[], None] | None = None) -> tuple[torch.Tensor, list[str]]:
        """Returns (logits [N, vocab] float32, request ids of those N rows in plan order); `between_layers` is
        called after each layer of the forward (`LlamaModel.forward`)."""
        token_ids: list[int] = []
        positions: list[int] = []
        seqs: list[SequenceSlice] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        for chunk in plan.chunks:
            token_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_pos, chunk.end_pos))
            seqs.append(SequenceSlice(chunk.start_pos, chunk.num_tokens, chunk.block_ids))
            if chunk.samples:
                sample_rows.append(len(token_ids) - 1)
                sample_ids.append(chunk.request_id)
        meta = AttentionMetadata.build(seqs, self.storage.block_size, self.device)
        input_ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)
        position_ids = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, position_ids, meta, self.storage.kv_cache, between_layers)
        if not sample_rows:
            return torch.empty(0, 0), []
        rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
        return self.model.compute_logits(hidden.index_select(0, rows)), sample_ids
