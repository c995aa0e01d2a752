"""Model runner: plain batch data in, tensors through the model, sampled token ids out."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import torch

from tokendance.batch import SchedulerOutput, ScheduledRequest
from tokendance.model.attention import AttentionMetadata, DecodeAttention, PrefillAttention
from tokendance.model.kv_math import key_deviation, rotate_pairs
from tokendance.model.llama import KVCacheTensors, LlamaModel
from tokendance.sampling import Sampler, TokenLogprobs, prompt_token_logprobs, token_logprobs
from tokendance.structured import GrammarCompiler


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request id -> next token, for requests that sampled this step
    logits: dict[str, torch.Tensor]  # request id -> [vocab] float32, when return_logits is set
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # when sampling_params.logprobs is set
    # request id -> (prompt position, its TokenLogprobs) for the prompt tokens this step computed
    prompt_logprobs: dict[str, list[tuple[int, TokenLogprobs]]] = field(default_factory=dict)
    # request id -> (prompt position, float32 [vocab] logits scoring it), when return_logits is set too
    prompt_logits: dict[str, list[tuple[int, torch.Tensor]]] = field(default_factory=dict)

    def merge(self, other: "RunnerOutput") -> None:
        """Add another batch's results (of other requests) to these."""
        for part in fields(self):
            getattr(self, part.name).update(getattr(other, part.name))


PROMPT_LOGPROBS_ROWS = 256  # prompt positions whose logits are computed at once
MIN_CHUNK = 32  # queries per attention call, at least
MAX_CHUNKS = 8
CALL_COST = 4096  # one more attention call, in query x key score cells (its fixed overhead)


def key_prefix_chunks(positions) -> list[tuple[int, int, int]]:
    """Query rows cut into at most MAX_CHUNKS runs of equal size, each attending only to the keys
    up to its last position: (start, end, num_keys) per run, the count of runs minimizing the
    score cells computed plus CALL_COST per call."""
    count, best = len(positions), None
    for parts in range(1, min(MAX_CHUNKS, count // MIN_CHUNK) + 1):
        cuts = [count * i // parts for i in range(parts + 1)]
        chunks = [(a, b, positions[b - 1] + 1) for a, b in zip(cuts, cuts[1:])]
        cost = sum((b - a) * keys for a, b, keys in chunks) + CALL_COST * parts
        if best is None or cost < best[0]:
            best = (cost, chunks)
    return best[1] if best else [(0, count, positions[-1] + 1)]


class ModelRunner:
    """Owns the KV tensors and the sampler; keeps no request state besides the sampler's
    generators and grammar matchers."""

    def __init__(self, model: LlamaModel, kv_cache: KVCacheTensors, block_size: int,
                 grammars: GrammarCompiler | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.device = model.device
        self.sampler = Sampler(model.device, grammars)
        self.sampling_seconds = 0.0  # spent in the sampler (penalties, masks, top-k/p, draws), cumulative

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        hidden, sample_rows = self._forward(out)
        prompt_logprobs, prompt_logits = self._prompt_logprobs(out, hidden)
        samplers = [item for item in out.scheduled if item.sample]
        if not samplers:
            return RunnerOutput({}, {}, {}, prompt_logprobs, prompt_logits)
        logits = self.model.compute_logits(hidden[sample_rows])  # [num_samplers, vocab]
        ids = [item.request_id for item in samplers]
        started = time.perf_counter()
        tokens = self.sampler.sample(logits, ids, [item.sampling_params for item in samplers],
                                     [item.history for item in samplers])
        self.sampling_seconds += time.perf_counter() - started
        kept = {
            item.request_id: logits[row].float()
            for row, item in enumerate(samplers)
            if item.sampling_params.return_logits
        }
        rows = [row for row, item in enumerate(samplers) if item.sampling_params.logprobs is not None]
        logprobs = {}
        if rows:
            found = token_logprobs(logits[rows], [tokens[r] for r in rows],
                                   [samplers[r].sampling_params.logprobs for r in rows])
            logprobs = {samplers[r].request_id: entry for r, entry in zip(rows, found)}
        return RunnerOutput(dict(zip(ids, tokens)), kept, logprobs, prompt_logprobs, prompt_logits)

    def _prompt_logprobs(self, out: SchedulerOutput, hidden: torch.Tensor) -> tuple[dict, dict]:
        """For requests asking for prompt logprobs: each computed position p < L-1 scores prompt
        token p+1 (its logits in slices of PROMPT_LOGPROBS_ROWS rows, bounding the memory). The
        logits themselves are kept for requests that also set return_logits."""
        found, kept, start = {}, {}, 0
        for item in out.scheduled:
            params, first = item.sampling_params, start
            start += len(item.token_ids)
            if params is None or params.prompt_logprobs is None:
                continue
            prompt = item.history.prompt_token_ids
            positions = [p for p in item.positions if item.score_from <= p < len(prompt) - 1]
            entries, rows = [], []
            for i in range(0, len(positions), PROMPT_LOGPROBS_ROWS):
                part = positions[i:i + PROMPT_LOGPROBS_ROWS]
                logits = self.model.compute_logits(hidden[first + part[0] - item.positions[0]:][:len(part)])
                entries += prompt_token_logprobs(logits, [prompt[p + 1] for p in part], params.prompt_logprobs)
                if params.return_logits:
                    rows += list(logits.float())
            found[item.request_id] = [(p + 1, entry) for p, entry in zip(positions, entries)]
            if params.return_logits:
                kept[item.request_id] = [(p + 1, row) for p, row in zip(positions, rows)]
        return found, kept

    @torch.inference_mode()
    def compute_kv(self, out: SchedulerOutput, num_layers: int | None = None) -> None:
        """Only fill the KV of the scheduled tokens (in the first `num_layers` layers)."""
        self._forward(out, num_layers)

    @torch.inference_mode()
    def read_keys(self, layer: int, slots: list[int], read_positions: list[int]) -> torch.Tensor:
        """Keys of `slots` at `layer` as seen from `read_positions`: [N, Hkv, D] float32."""
        slot_tensor = self._tensor(slots)
        shift = self._tensor(read_positions) - self.kv_cache.positions[slot_tensor]
        keys = self.kv_cache.keys[layer].index_select(0, slot_tensor).float()
        rotation = self.model.key_rotation(shift)
        return rotate_pairs(keys, rotation.cos, rotation.sin)

    def copy_kv(self, src_slots: list[int], dst_slots: list[int], dst_positions: list[int]) -> None:
        """Copy KV between slots, rotating keys to `dst_positions` (a position-corrected copy)."""
        self.blend_kv([src_slots], dst_slots, dst_positions)

    @torch.inference_mode()
    def blend_kv(self, sources: list[list[int]], dst_slots: list[int], dst_positions: list[int]) -> torch.Tensor:
        """Write into `dst_slots` the mean of the KV of several slot lists of the same tokens (keys
        rotated to `dst_positions` first, means taken in float32), on every layer. Returns how much
        the sources disagree, per token: the squared distance of their values from the mean,
        summed over layers and sources ([N] float32; zeros for one source)."""
        dst, positions = self._tensor(dst_slots), self._tensor(dst_positions)
        srcs = [self._tensor(slots) for slots in sources]
        rotations = [self.model.key_rotation(positions - self.kv_cache.positions[src]) for src in srcs]
        spread = torch.zeros(len(dst_slots))
        for keys, values in zip(self.kv_cache.keys, self.kv_cache.values):
            key_sum = sum(rotate_pairs(keys.index_select(0, src).float(), r.cos, r.sin) for src, r in zip(srcs, rotations))
            keys.index_copy_(0, dst, (key_sum / len(srcs)).to(keys.dtype))
            if len(srcs) == 1:  # a copy: the values as they are
                values.index_copy_(0, dst, values.index_select(0, srcs[0]))
                continue
            encodings = [values.index_select(0, src).float() for src in srcs]
            mean = sum(encodings) / len(srcs)
            spread += sum(key_deviation(e, mean) for e in encodings)
            values.index_copy_(0, dst, mean.to(values.dtype))
        self.kv_cache.positions.index_copy_(0, dst, positions)
        return spread

    def execute_each(self, out: SchedulerOutput) -> tuple[SchedulerOutput, RunnerOutput, list]:
        """After `out` failed as one batch: each request of it run alone (it rewrites its own new
        slots, so this is safe; the batch's copy-on-write copies are redone once first). Returns the
        requests that ran, their merged result, and (id, error) of the others, whose sampling left
        no trace (generators and grammar matchers as before them)."""
        kept, result, failed = SchedulerOutput(), RunnerOutput({}, {}), []
        self.copy_blocks(out.block_copies)  # once: the copied blocks as before the step
        for item in out.scheduled:
            sampling = self.sampler.snapshot()
            try:
                alone = self.execute(SchedulerOutput([item], [], len(item.token_ids)))
            except Exception as error:
                self.sampler.restore(sampling)
                failed.append((item.request_id, error))
                continue
            kept.scheduled.append(item)
            result.merge(alone)
        return kept, result, failed

    def _forward(self, out: SchedulerOutput, num_layers: int | None = None):
        self.copy_blocks(out.block_copies)
        input_ids, positions, meta, sample_rows = self._prepare(out.scheduled)
        return self.model.forward(input_ids, positions, meta, self.kv_cache, num_layers), sample_rows

    def release(self, request_id: str) -> None:
        self.sampler.release(request_id)

    def _prepare(self, scheduled: list[ScheduledRequest]):
        input_ids: list[int] = []
        positions: list[int] = []
        write_slots: list[int] = []
        sample_rows: list[int] = []
        for item in scheduled:
            if item.sample:
                sample_rows.append(len(input_ids) + len(item.token_ids) - 1)
            input_ids.extend(item.token_ids)
            positions.extend(item.positions)
            write_slots.extend(item.context_slots[p] for p in item.positions)
        slot_mapping = self._tensor(write_slots)
        position_tensor = self._tensor(positions)
        # Record where each written key is rotated for, before reading shifts below.
        self.kv_cache.positions.index_copy_(0, slot_mapping, position_tensor)
        prefills: list[PrefillAttention] = []
        decode_rows: list[int] = []
        decode_slots: list[list[int]] = []
        row = 0
        for item in scheduled:
            num_new = len(item.token_ids)
            if item.is_decode:
                decode_rows.append(row)
                decode_slots.append(item.context_slots)
            else:
                prefills.append(self._prefill_attention(item, row))
            row += num_new
        meta = AttentionMetadata(
            slot_mapping=slot_mapping,
            prefills=prefills,
            decode=self._decode_attention(decode_rows, decode_slots) if decode_rows else None,
        )
        return self._tensor(input_ids), position_tensor, meta, self._tensor(sample_rows)

    def _prefill_attention(self, item: ScheduledRequest, row: int) -> PrefillAttention:
        num_new = len(item.token_ids)
        num_context = len(item.context_slots)
        if num_new == num_context:  # the new tokens are the whole context: plain causal attention
            return PrefillAttention(row, row + num_new, None)
        query_positions = self._tensor(list(item.positions))
        key_positions = torch.arange(num_context, device=self.device)
        slots = self._tensor(item.context_slots)
        if self.model.attention.prefill is not None:  # stops each query at its position, rotates keys itself
            return PrefillAttention(row, row + num_new, slots, limits=query_positions + 1)
        parts = tuple((start, end, num_keys, key_positions[None, :num_keys] <= query_positions[start:end, None])
                      for start, end, num_keys in key_prefix_chunks(item.positions))  # causal masks
        return PrefillAttention(row, row + num_new, slots, self._rotation(slots, key_positions), parts)

    def _decode_attention(self, rows: list[int], slots: list[list[int]]) -> DecodeAttention:
        lengths = [len(s) for s in slots]
        width = max(lengths)
        padded = self._tensor([s + [0] * (width - len(s)) for s in slots])  # [B, Lk]
        length_tensor = self._tensor(lengths)
        if self.model.attention.decode is not None:  # reads slots in place, rotates queries itself
            return DecodeAttention(self._tensor(rows), padded, length_tensor)
        key_positions = torch.arange(width, device=self.device)
        mask = key_positions[None, :] < length_tensor[:, None]  # [B, Lk]
        shift = (key_positions[None, :] - self.kv_cache.positions[padded]).masked_fill(~mask, 0)
        is_shifted = shift != 0
        if not bool(is_shifted.any()):
            return DecodeAttention(self._tensor(rows), padded, length_tensor, mask[:, None, None, :])
        # Attention does not depend on the order of the keys: move each row's shifted keys to
        # its first columns, so only the first `num_rotated` columns go through the rotation.
        order = torch.sort(is_shifted.to(torch.int8), dim=1, descending=True, stable=True).indices
        padded, mask, shift = padded.gather(1, order), mask.gather(1, order), shift.gather(1, order)
        num_rotated = int(is_shifted.sum(1).max())
        rotation = self.model.key_rotation(shift[:, :num_rotated])
        return DecodeAttention(self._tensor(rows), padded, length_tensor, mask[:, None, None, :], rotation, num_rotated)

    def _rotation(self, slots: torch.Tensor, key_positions: torch.Tensor, valid=None):
        """RoPE corrections for keys stored at other positions than they are read (shared KV)."""
        shift = key_positions - self.kv_cache.positions[slots]
        if valid is not None:
            shift = shift.masked_fill(~valid, 0)
        if not bool(shift.any()):
            return None
        return self.model.key_rotation(shift)

    def copy_blocks(self, copies) -> None:
        if not copies:
            return
        size = self.block_size
        src = torch.cat([torch.arange(s * size, (s + 1) * size) for s, _ in copies]).to(self.device)
        dst = torch.cat([torch.arange(d * size, (d + 1) * size) for _, d in copies]).to(self.device)
        for cache in (*self.kv_cache.keys, *self.kv_cache.values):
            cache.index_copy_(0, dst, cache.index_select(0, src))
        positions = self.kv_cache.positions
        positions.index_copy_(0, dst, positions.index_select(0, src))

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)
