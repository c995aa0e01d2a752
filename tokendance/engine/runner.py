"""Model runner: plain scheduler data in, tensors through the model, sampled token ids out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendance.engine.scheduler import ScheduledRequest, SchedulerOutput
from tokendance.model.llama import (
    AttentionMetadata,
    DecodeAttention,
    KVCacheTensors,
    LlamaModel,
    PrefillAttention,
)
from tokendance.sampling import Sampler


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request id -> next token, for requests that sampled this step
    logits: dict[str, torch.Tensor]  # request id -> [vocab] float32, when return_logits is set


class ModelRunner:
    """Owns the KV tensors and the sampler; keeps no request state besides sampler generators."""

    def __init__(self, model: LlamaModel, kv_cache: KVCacheTensors, block_size: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device
        self.sampler = Sampler(model.device)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self._copy_blocks(out.block_copies)
        input_ids, positions, meta, sample_rows = self._prepare(out.scheduled)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)
        samplers = [item for item in out.scheduled if item.sample]
        if not samplers:
            return RunnerOutput({}, {})
        logits = self.model.compute_logits(hidden[sample_rows])  # [num_samplers, vocab]
        ids = [item.request_id for item in samplers]
        tokens = self.sampler.sample(logits, ids, [item.sampling_params for item in samplers])
        kept = {
            item.request_id: logits[row].float()
            for row, item in enumerate(samplers)
            if item.sampling_params.return_logits
        }
        return RunnerOutput(dict(zip(ids, tokens)), kept)

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def _prepare(self, scheduled: list[ScheduledRequest]):
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        sample_rows: list[int] = []
        prefills: list[PrefillAttention] = []
        decode_rows: list[int] = []
        decode_slots: list[list[int]] = []
        for item in scheduled:
            row = len(input_ids)
            num_new = len(item.token_ids)
            end = item.start_position + num_new
            input_ids.extend(item.token_ids)
            positions.extend(range(item.start_position, end))
            slot_mapping.extend(item.context_slots[item.start_position : end])
            if item.sample:
                sample_rows.append(row + num_new - 1)
            if num_new == 1 and item.start_position > 0:
                decode_rows.append(row)
                decode_slots.append(item.context_slots)
            else:
                prefills.append(self._prefill_attention(item, row))
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slot_mapping),
            prefills=prefills,
            decode=self._decode_attention(decode_rows, decode_slots) if decode_rows else None,
        )
        return self._tensor(input_ids), self._tensor(positions), meta, self._tensor(sample_rows)

    def _prefill_attention(self, item: ScheduledRequest, row: int) -> PrefillAttention:
        num_new = len(item.token_ids)
        if item.start_position == 0:
            return PrefillAttention(row, row + num_new, None, None)
        num_context = item.start_position + num_new
        query_positions = torch.arange(item.start_position, num_context, device=self.device)
        key_positions = torch.arange(num_context, device=self.device)
        mask = key_positions[None, :] <= query_positions[:, None]  # [Lq, Lk] causal
        return PrefillAttention(row, row + num_new, self._tensor(item.context_slots), mask)

    def _decode_attention(self, rows: list[int], slots: list[list[int]]) -> DecodeAttention:
        lengths = [len(s) for s in slots]
        width = max(lengths)
        padded = [s + [0] * (width - len(s)) for s in slots]
        length_tensor = self._tensor(lengths)
        mask = torch.arange(width, device=self.device)[None, :] < length_tensor[:, None]  # [B, Lk]
        return DecodeAttention(self._tensor(rows), self._tensor(padded), mask[:, None, None, :])

    def _copy_blocks(self, copies) -> None:
        if not copies:
            return
        size = self.block_size
        src = torch.cat([torch.arange(s * size, (s + 1) * size) for s, _ in copies]).to(self.device)
        dst = torch.cat([torch.arange(d * size, (d + 1) * size) for _, d in copies]).to(self.device)
        for cache in (*self.kv_cache.keys, *self.kv_cache.values):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
