"""The worker side's pass over the mirrors admitted in one step, through vLLM's own model modules
(embedding, decoder layers with their norms, projections, RoPE and MLP), with attention replaced
for the pass by `PassAttention`: exact causal limits over each mirror's paged KV.

For all mirrors of the step at once:
0. exact spans (the same tokens at the same positions after the same prefix: an agent's own
   history past vLLM's block-aligned hit, from blocks or from the session store, a master's
   identical system prompt) copied in every layer; the other claimed tokens go through 1-4;
1. the check pass: layers 0..c over every claimed token, exactly (their KV is written as is);
   none for a selection that ranks nothing (EPIC: each span's first tokens), c = -1 then;
2. selection: each reused span's tokens by how far the master's key, re-rotated, is from the
   fresh key at layer c (`reuse/selection.py`, the engine's selectors);
3. the copy: for layers c+1.., the master's K/V of the tokens not selected, keys re-rotated to
   the mirror's positions (from a mirror of the same pass that first holds a piece no master
   computes: in each layer of 4., after that mirror's rows are written) (with in-round anchors, the mean of every anchor's K/V, keys re-rotated
   first: `Sources`);
4. the recompute: the selected and private tokens through layers c+1.., from their hidden states
   at layer c, attending over the fused KV.
At recompute ratio 1.0 every token is recomputed: an exact prefill of the claimed range.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tokendance.model import kernels
from tokendance.model.kv_math import angles_between, key_deviation, rotate_pairs, weighted_mean
from tokendance.vllm_plugin.worker.pointwise import fused_pointwise
from tokendance.reuse.selection import Selector, make_selector
from tokendance.vllm_plugin.worker.layouts import PagedLayout
from tokendance.vllm_plugin.step_plan import MirrorLoad
from tokendance.vllm_plugin.worker.store import RestoreError


class UnsupportedModel(Exception):
    """The model's shape is not one the pass can drive (the connector then stays inert)."""


class KeyRotator:
    """Moves keys cached at one position to another with the model's own RoPE table: the rotation
    R(dst) R(src)^T from vLLM's cos/sin cache (exact for any fixed-frequency table: default,
    linear, llama3 and YaRN scaling alike; the YaRN magnitude cancels). Neox pairing (j, j + r/2)
    over the first `rotary_dim` dimensions."""

    def __init__(self, rotary_emb: nn.Module):
        cache = getattr(rotary_emb, "cos_sin_cache", None)
        if cache is None or not getattr(rotary_emb, "is_neox_style", False) or "MRotary" in type(rotary_emb).__name__:
            raise UnsupportedModel(f"rotary embedding {type(rotary_emb).__name__} is not a neox-style cached table")
        self.table = cache.detach().to(torch.float64)  # [max_position, rotary_dim]: cos | sin
        self.rotary_dim = int(rotary_emb.rotary_dim)

    def __call__(self, keys: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """keys [N, H, D] cached at positions src [N], as computed at dst [N] (float32 math)."""
        cos, sin = angles_between(self.table, src, dst)
        return rotate_pairs(keys.float(), cos, sin, self.rotary_dim).to(keys.dtype)


@dataclass
class Sources:
    """Where the K/V of reused tokens come from: per encoding e, `slots[e]` read at `positions[e]`
    (each [N]), weighed `weights[e]` ([N]: 1/k for a token k encodings hold, 0 where a token has
    fewer than e + 1; that encoding's slot then repeats another)."""

    slots: list[torch.Tensor]
    positions: list[torch.Tensor]
    weights: list[torch.Tensor]

    def read(self, layout: PagedLayout, rotate: KeyRotator, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (re-rotated to positions `at`) and values of the tokens, their encodings' mean."""
        if len(self.slots) == 1:  # one encoding: a copy
            keys, values = layout.read(self.slots[0])
            return rotate(keys, self.positions[0], at), values
        read = [layout.read(slots) for slots in self.slots]
        keys = weighted_mean([rotate(k.float(), p, at) for (k, _), p in zip(read, self.positions)], self.weights)
        values = weighted_mean([v for _, v in read], self.weights)
        dtype = layout.cache.dtype
        return keys.to(dtype), values.to(dtype)

    def select(self, rows: torch.Tensor) -> "Sources":
        return Sources([s[rows] for s in self.slots], [p[rows] for p in self.positions], [w[rows] for w in self.weights])

    @classmethod
    def cat(cls, parts: list["Sources"]) -> "Sources":
        """Several spans' sources as one, padded to the most encodings any holds."""
        width = max(len(p.slots) for p in parts)
        padded = [Sources(p.slots + p.slots[:1] * (width - len(p.slots)),
                          p.positions + p.positions[:1] * (width - len(p.positions)),
                          p.weights + [torch.zeros_like(p.weights[0])] * (width - len(p.weights))) for p in parts]
        return cls(*[[torch.cat([getattr(p, name)[e] for p in padded]) for e in range(width)]
                     for name in ("slots", "positions", "weights")])


@dataclass
class Attend:
    """Query rows [row_start, row_end) of the pass's batch attend the keys at positions
    [0, len(context_slots)) of one mirror, each up to its own position."""

    row_start: int
    row_end: int
    positions: torch.Tensor  # [n] int64
    context_slots: torch.Tensor  # [S] slot of each position


class PassAttention(nn.Module):
    """Stands in for one decoder layer's vLLM `Attention` during the pass: writes the batch's K/V
    to their slots, then attends each query over its mirror's paged KV with exact causal limits.
    Attention runs in the engine's bf16 prefill kernel where the CPU has one (AVX512-BF16, bf16
    model, head size 64: each query stopped at its position, no mask), else in SDPA with a mask."""

    def __init__(self, attention: nn.Module, layout: PagedLayout):
        super().__init__()
        self.num_heads = attention.num_heads
        self.num_kv_heads = attention.num_kv_heads
        self.head_size = attention.head_size
        self.scale = float(attention.impl.scale)
        self.layout = layout
        cache = layout.cache
        self.kernel = None
        if cache.device.type == "cpu" and cache.dtype == torch.bfloat16 and self.head_size == kernels.PREFILL_DIM:
            self.kernel = kernels.load_prefill()
        self.write_slots: torch.Tensor | None = None
        self.after_write = None  # called with the layout once the batch's K/V are written
        self.attends: list[Attend] = []
        self.keys: torch.Tensor | None = None  # the batch's fresh keys, when `capture`
        self.capture = False
        self.seconds = 0.0  # in the attention itself (reads and kernel), summed until reset

    def forward(self, query, key, value, output_shape=None, output_dtype=None):
        rows = query.shape[0]
        q = query.view(rows, self.num_heads, self.head_size)
        k = key.view(rows, self.num_kv_heads, self.head_size)
        v = value.view(rows, self.num_kv_heads, self.head_size)
        if self.capture:
            self.keys = k.clone()
        self.layout.write(self.write_slots, k, v)
        if self.after_write is not None:
            self.after_write(self.layout)
        out = torch.empty_like(q)
        started = time.perf_counter()
        for a in self.attends:
            keys, values = self.layout.read(a.context_slots)  # [S, Hkv, D]
            out[a.row_start:a.row_end] = self._attend(q[a.row_start:a.row_end], keys, values, a.positions)
        self.seconds += time.perf_counter() - started
        return out.view(rows, self.num_heads * self.head_size)

    def _attend(self, q, keys, values, positions) -> torch.Tensor:  # q [n, Hq, D] at `positions` -> [n, Hq, D]
        if self.kernel is not None:
            return kernels.prefill_attention_bf16(self.kernel, q.contiguous(), keys.contiguous(), values.contiguous(),
                                                  positions + 1, self.scale, None).to(q.dtype)
        group = self.num_heads // self.num_kv_heads
        mask = torch.arange(len(keys), device=q.device)[None, :] <= positions[:, None]  # [n, S]
        attended = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, Hq, n, D]
            keys.repeat_interleave(group, dim=1).transpose(0, 1)[None],  # [1, Hq, S, D]
            values.repeat_interleave(group, dim=1).transpose(0, 1)[None],
            attn_mask=mask, scale=self.scale)
        return attended[0].transpose(0, 1)


class MirrorPass:
    """Drives a vLLM decoder-only model (Llama, Qwen2, Qwen3, Mistral shapes) over mirrors'
    claimed ranges. `layouts` maps each decoder layer index to its KV layout."""

    def __init__(self, model: nn.Module, layouts: list[PagedLayout], block_size: int, selection: str,
                 recompute_ratio: float, check_layer: int):
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        if layers is None or getattr(inner, "start_layer", 0) != 0 or getattr(inner, "end_layer", len(layers)) != len(layers):
            raise UnsupportedModel(f"{type(model).__name__}: no single-stage `model.layers` to drive")
        if len(layouts) != len(layers):
            raise UnsupportedModel(f"{len(layouts)} KV layers for {len(layers)} decoder layers")
        self.inner, self.layers = inner, list(layers)
        self.shims = []
        for layer in self.layers:
            attention = getattr(getattr(layer, "self_attn", None), "attn", None)
            if attention is None or getattr(attention, "sliding_window", None) or getattr(attention.impl, "logits_soft_cap", None):
                raise UnsupportedModel(f"{type(layer).__name__}: needs `self_attn.attn` without sliding window or softcap")
        for layer, layout in zip(self.layers, layouts):
            self.shims.append(PassAttention(layer.self_attn.attn, layout))
        self.rotate = KeyRotator(self.layers[0].self_attn.rotary_emb)
        self.layouts = layouts
        self.block_size = block_size
        self.selection, self.recompute_ratio = selection, recompute_ratio
        self.selectors: dict[float, Selector] = {}
        self.check_layer = min(check_layer, len(self.layers) - 1)
        self.store = None  # the session store (`store.py`) that stored spans read, where there is one
        self.restored: dict = {}

    # ------------------------------------------------------------ the pass

    def run(self, loads: list[MirrorLoad]) -> Counter:
        """Fill every load's claimed range (call under inference mode); returns what it did, as the
        connector's stats count it: `reused_tokens` (served from masters or the mirror's session,
        exact copies included), `computed_tokens.selected` (reused-span tokens recomputed),
        `computed_tokens.check` (the reused tokens' layers 0..c, in full-model token equivalents),
        `pass_tokens` (claimed), `pass_seconds.<phase>` (check, select, copy, recompute;
        `attention` inside check and recompute; `restore`: reads from the session store)."""
        clock = PhaseClock()
        for shim in self.shims:
            shim.seconds = 0.0
        context = [self._slots(load.block_ids, 0, load.end) for load in loads]
        # a selection that ranks nothing (EPIC: each span's first tokens) needs no check pass
        c = self.check_layer if self._selector(None).needs_check_pass else -1
        # 0. exact spans copied in every layer; the pass computes the other rows (`batch`)
        exact = self._copy_exact(loads, context, c, clock)
        keep = self._compute(loads, context, [~mask for mask in exact], c, clock)
        copied = sum(int(m.sum()) for m in exact)
        reused = int((~keep).sum())
        span_tokens = sum(span.length for load in loads for span in load.spans if not span.exact)
        report = Counter({"pass_tokens": sum(len(load.token_ids) for load in loads), "reused_tokens": reused + copied,
                          "computed_tokens.selected": span_tokens - reused,
                          "computed_tokens.check": reused * (c + 1) / len(self.layers)})
        report.update({f"pass_seconds.{phase}": seconds for phase, seconds in clock.laps.items()})
        report["pass_seconds.attention"] = sum(shim.seconds for shim in self.shims)
        return report

    def _compute(self, loads, context, batch, c: int, clock: "PhaseClock"):
        """Steps 1-4 over the rows `batch` marks in each load; returns the mask of those rows
        recomputed in 4. (the others are reused)."""
        device = self.layouts[0].cache.device
        counts = [int(m.sum()) for m in batch]
        ids = torch.cat([torch.tensor(load.token_ids, device=device)[m] for load, m in zip(loads, batch)])
        positions = torch.cat([torch.arange(load.start, load.end, device=device)[m] for load, m in zip(loads, batch)])
        write = torch.cat([slots[load.start:][m] for load, slots, m in zip(loads, context, batch)])
        clock.lap("copy")
        keep = torch.ones(len(ids), dtype=torch.bool, device=device)  # rows recomputed in 4.
        if not len(ids):
            return keep
        embed = getattr(self.inner, "embed_input_ids", None) or self.inner.embed_tokens
        hidden, residual = embed(ids), None
        # 1. the check pass: every computed row through layers 0..c, exactly
        attends, row = [], 0
        for slots, n in zip(context, counts):
            if n:
                attends.append(Attend(row, row + n, positions[row:row + n], slots))
            row += n
        fresh = None
        if c >= 0:
            self.shims[c].capture = True
            hidden, residual = self._layers(range(0, c + 1), positions, hidden, residual, write, attends,
                                            clock=clock, phase="check")
            fresh = self.shims[c].keys
            self.shims[c].capture, self.shims[c].keys = False, None
        clock.lap("check")
        # 2. selection and 3. the copy of the sources' K/V for the tokens not selected (from a
        # mirror of this pass, layer by layer in 4., once that mirror's rows are written)
        copies, late = self._select(loads, batch, fresh, keep)
        self.restored = {}  # read by the selection only: not held until the next pass
        clock.lap("select")
        later = range(c + 1, len(self.layers))
        if copies is not None:
            self._copy(*copies, layers=later)
        clock.lap("copy")
        # 4. the recompute: selected and private tokens through the remaining layers
        rows = keep.nonzero().flatten()
        if len(later) and len(rows):
            attends = attends_of(rows, positions, context, counts)
            self._layers(later, positions[rows], hidden[rows], None if residual is None else residual[rows],
                         write[rows], attends, late, clock=clock, phase="recompute")
        elif late is not None:
            self._copy(*late, layers=later)
        clock.lap("recompute")
        return keep

    def _copy_exact(self, loads, context, check_layer: int, clock: "PhaseClock") -> list[torch.Tensor]:
        """Copy every exact span's K/V, all layers, as is (same tokens, same positions, same
        prefix); per load, the mask of its claimed positions so filled. A moved piece read from
        the session store is staged in its destination's layers after the check layer, its keys
        rotated once to the destination's positions (the copy then moves it no further)."""
        masks, src, dst, stored = [], [], [], []
        for load, slots in zip(loads, context):
            mask = torch.zeros(len(load.token_ids), dtype=torch.bool)
            for span in load.spans:
                to = slots[span.start:span.start + span.length]
                if span.stored is not None:  # from the session store, as the agent held it
                    stored.append((span.stored, span.source_start, span.source_start + span.length, to,
                                   0 if span.exact else check_layer + 1, span.start))  # (the piece may repeat)
                if span.exact:
                    mask[span.start - load.start:span.start - load.start + span.length] = True
                    if span.stored is not None:
                        continue
                    src.append(self._slots(span.source_block_ids, span.source_start, span.source_start + span.length))
                    dst.append(to)
            masks.append(mask.to(slots.device))
        if stored and self.store is None:
            raise RestoreError("a claim reads the session store, which this worker does not have")
        if src:
            src_slots, dst_slots = torch.cat(src), torch.cat(dst)
            for layout in self.layouts:
                layout.write(dst_slots, *layout.read(src_slots))
        clock.lap("copy")
        self.restored = {}  # (entry, start, end, destination) -> its rows, every layer: read once per pass
        for entry, start, end, to, first, at in stored:
            try:
                read = self.store.rows(entry, start, end, torch.arange(at, at + end - start))
            except Exception as exc:
                raise RestoreError(f"reading entry {entry} [{start}, {end}) from the session store failed") from exc
            keys, values = self.restored[entry, start, end, at] = tuple(rows.to(to.device) for rows in read)
            for index in range(first, len(self.layouts)):
                self.layouts[index].write(to, keys[:, index], values[:, index])
        clock.lap("restore")
        return masks

    def _select(self, loads, batch, fresh, keep):
        """Choose each reused span's tokens to recompute (clearing `keep` for the others) and return
        the copies for the rest, (their `Sources`, destination slots, destination positions) or
        None: those from KV written before this pass, and those from mirrors of this pass."""
        row = 0
        sources, dst_slots, dst_pos = ([], []), ([], []), ([], [])  # (from earlier KV, from this pass)
        spans = []  # (load, span, its held sources, its positions, its rows in the batch, its deviation)
        for load, mask in zip(loads, batch):
            row_of = row + torch.cumsum(mask.long(), 0) - 1  # claimed position -> batch row
            for span in load.spans:
                if span.exact:
                    continue
                offsets = torch.arange(span.length)
                weight = torch.full((span.length,), 1 / len(span.sources), device=keep.device)
                # a stored piece was staged in its destination, at its positions (`_copy_exact`)
                origins = [(load.block_ids, span.start)] if span.stored is not None else span.sources
                held = Sources([self._slots(blocks, start, start + span.length) for blocks, start in origins],
                               [offsets + start for _, start in origins], [weight] * len(origins))
                d_pos = offsets + span.start
                rows = row_of[span.start - load.start + offsets]
                deviation = None
                if fresh is not None:
                    if span.stored is not None:  # its check layer holds fresh KV now: the store's, at d_pos
                        keys = self.restored[span.stored, span.source_start, span.source_start + span.length, span.start][0]
                        cached = keys[:, self.check_layer]
                    else:
                        cached = held.read(self.layouts[self.check_layer], self.rotate, d_pos)[0]
                    deviation = key_deviation(fresh[rows], cached)
                spans.append((load, span, held, d_pos, rows, deviation))
            row += int(mask.sum())
        if fresh is not None:
            agreed = across_ranks([deviation for *_, deviation in spans])
            spans = [(*span[:-1], deviation) for span, deviation in zip(spans, agreed)]
        for load, span, held, d_pos, rows, deviation in spans:
            chosen = torch.zeros(span.length, dtype=torch.bool)
            chosen[self._selector(load.recompute_ratio).select(span.length, deviation)] = True
            reused = ~chosen
            keep[rows[reused]] = False
            sources[span.late].append(held.select(reused))
            dst_slots[span.late].append(self._slots(load.block_ids, span.start, span.start + span.length)[reused])
            dst_pos[span.late].append(d_pos[reused])
        return tuple(None if not sources[k] else (Sources.cat(sources[k]), torch.cat(dst_slots[k]), torch.cat(dst_pos[k]))
                     for k in (0, 1))

    def _selector(self, ratio: float | None) -> Selector:
        ratio = self.recompute_ratio if ratio is None else ratio
        if ratio not in self.selectors:
            self.selectors[ratio] = make_selector(self.selection, ratio)
        return self.selectors[ratio]

    def _copy(self, sources: Sources, dst_slots, dst_pos, layers) -> None:
        if not len(dst_slots):
            return
        for index in layers:
            layout = self.layouts[index]
            layout.write(dst_slots, *sources.read(layout, self.rotate, dst_pos))

    def _layers(self, indices, positions, hidden, residual, write, attends, late=None, *, clock, phase):
        """Run decoder layers `indices` over the batch; returns the last hidden state and residual.
        `late`: copies made in each layer after its rows are written, before they attend (pieces
        their first holder computes in this batch)."""
        for index in indices:
            layer, shim = self.layers[index], self.shims[index]
            shim.write_slots, shim.attends = write, attends
            if late is not None:
                shim.after_write = lambda layout, late=late: layout.write(late[1], *late[0].read(layout, self.rotate, late[2]))
            attention = layer.self_attn.attn
            layer.self_attn.attn = shim
            try:
                with fused_pointwise([layer], hidden.dtype, hidden.device):
                    hidden, residual = layer(positions, hidden, residual)
            finally:
                layer.self_attn.attn = attention
                shim.write_slots, shim.attends, shim.after_write = None, [], None
            clock.lap(phase)
        return hidden, residual

    def _slots(self, block_ids: list[int], start: int, end: int) -> torch.Tensor:
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        position = torch.arange(start, end)
        return (blocks[position // self.block_size] * self.block_size + position % self.block_size).to(
            self.layouts[0].cache.device)


def across_ranks(deviations: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each span's key deviations summed over the tensor-parallel ranks (each holds some heads), so
    that every rank selects the same tokens: the recompute's layers all-reduce its rows across the
    ranks, and ranks that had picked different tokens would sum rows of different tokens (or, with
    different counts, never meet). One all-reduce for the whole pass."""
    from vllm.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce

    try:
        ranks = get_tensor_model_parallel_world_size()
    except AssertionError:  # no model-parallel group in this process
        ranks = 1
    if not deviations or ranks == 1:
        return deviations
    summed = tensor_model_parallel_all_reduce(torch.cat(deviations))
    return list(summed.split([len(d) for d in deviations]))


class PhaseClock:
    """Seconds since the previous lap, by phase name."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self.last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = self.laps.get(phase, 0.0) + now - self.last
        self.last = now


def attends_of(rows: torch.Tensor, positions: torch.Tensor, context: list[torch.Tensor],
               counts: list[int]) -> list[Attend]:
    """The recompute's attention, per mirror: its kept rows (renumbered in the recompute's batch)
    over its whole context; `counts`: each mirror's rows in the pass's batch."""
    attends, batch_row, first = [], 0, 0
    for slots, count in zip(context, counts):
        last = first + count
        mine = rows[(rows >= first) & (rows < last)]
        if len(mine):
            attends.append(Attend(batch_row, batch_row + len(mine), positions[mine], slots))
            batch_row += len(mine)
        first = last
    return attends
