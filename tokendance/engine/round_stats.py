"""A round's statistics: times, tokens computed vs reused, and KV accounting (Master-Mirror).

Counts are filled from the round's outputs and the KV manager's tables; the ratios are derived
from the counts in one place (`derive`), for a round and for a round merged from waves alike.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from tokendance.kv.manager import KVCacheManager
from tokendance.model.roofline import Account, Peaks
from tokendance.outputs import RequestOutput
from tokendance.reuse.cost import RoundCost
from tokendance.reuse.round_kv import PrefillReport
from tokendance.reuse.segments import TokenizedTurn


@dataclass
class AgentKVStats:
    agent_id: str
    logical_tokens: int  # tokens in the agent's table
    private_blocks: int  # blocks no other agent of the round holds
    diff_blocks: int  # private blocks holding tokens of shared spans (the mirror's diff)
    kv_bytes: float  # private blocks + shared blocks split evenly among their holders


@dataclass
class RoundStats:
    round_index: int
    mode: str
    num_agents: int
    round_seconds: float = 0.0  # until every agent has its whole output
    first_token_seconds: float = 0.0  # until the first agent has its first token
    prefill_seconds: float = 0.0  # round TTFT: until every agent has its first token
    decode_seconds: float = 0.0
    lookup_seconds: float = 0.0  # base KV of shared spans (+ position-corrected copies in pic)
    selection_seconds: float = 0.0
    recompute_seconds: float = 0.0
    private_prefill_seconds: float = 0.0  # the rest of the prefill (scheduler-side)
    prompt_tokens: int = 0
    computed_tokens: float = 0.0  # prefill tokens computed, in full-model token equivalents
    reused_tokens: int = 0  # shared-span tokens served from shared KV
    recomputed_tokens: int = 0  # shared-span tokens selected for recompute
    logical_kv_tokens: int = 0
    physical_kv_blocks: int = 0
    physical_kv_tokens: int = 0
    kv_bytes: int = 0
    kv_bytes_per_agent: float = 0.0
    compression: float = 0.0  # logical KV tokens / physical KV tokens (blocks x block size)
    shared_logical_tokens: int = 0  # tokens of shared spans over all agents
    shared_physical_tokens: int = 0  # distinct slots holding them (master + diffs)
    shared_compression: float = 0.0
    diff_blocks: int = 0
    num_waves: int = 1  # > 1: the pool could not hold the round at once; it ran in parts
    # decode attention's KV traffic during the round (all layers): bytes read from the pool, and
    # what each agent reading its own whole context would read
    decode_steps: int = 0
    decode_kv_bytes_read: int = 0
    decode_kv_bytes_requested: int = 0
    decode_kv_mb_per_step: float = 0.0
    decode_read_reduction: float = 0.0  # requested / read: how many times less than per-agent reads
    cost: RoundCost | None = None  # the prefill's compute by kind and its bound (modes that prepare KV)
    # The machine's account (model/roofline.py): every forward run while the round ran, by kind,
    # against the measured peaks. roofline: the least time the machine needs for that work;
    # efficiency: roofline / round_seconds; the rest of the round is the sampler's and "other"
    # (Python per step: scheduling, the round's bookkeeping, detokenization).
    work: Account | None = None
    peaks: Peaks | None = None
    roofline_seconds: float = 0.0
    forward_seconds: float = 0.0
    sampling_seconds: float = 0.0
    other_seconds: float = 0.0
    efficiency: float = 0.0
    # members whose reply says the same words as another member's (a speaker's leading label
    # dropped): agents converging on one text, what approximate reuse can add (tokendance.convergence)
    repeated_replies: int = 0
    # --fidelity auto: the setting the round ran at, its probe's reading (agent, KL, agreement,
    # pull), whether it breached the target and the move it made (round_core/fidelity_control.Step)
    fidelity: dict | None = None
    agents: list[AgentKVStats] = field(default_factory=list)


def fill_times(stats: RoundStats, report: PrefillReport, outputs: list[RequestOutput], started: float,
               prepared: bool) -> None:
    """`prepared`: a round prefill prepared all but each prompt's last token."""
    stats.prefill_seconds, stats.round_seconds = _times(outputs, started)
    stats.decode_seconds = stats.round_seconds - stats.prefill_seconds
    stats.lookup_seconds = report.lookup_seconds
    stats.selection_seconds = report.selection_seconds
    stats.recompute_seconds = report.recompute_seconds
    stats.private_prefill_seconds = max(
        0.0, stats.prefill_seconds - report.lookup_seconds - report.selection_seconds - report.recompute_seconds
    )
    stats.prompt_tokens = sum(o.num_prompt_tokens for o in outputs)
    if prepared:
        scheduler_side = len(outputs)
    else:
        scheduler_side = sum(o.num_prompt_tokens - o.num_cached_tokens for o in outputs)
    stats.computed_tokens = report.computed_tokens + scheduler_side
    stats.reused_tokens = report.reused_tokens
    stats.recomputed_tokens = report.recomputed_tokens
    stats.cost = report.cost


def _times(outputs: list[RequestOutput], started: float) -> tuple[float, float]:
    """(round TTFT, round latency); aborted agents may have no first token and no finish time."""
    first = max((o.first_token_time or started for o in outputs), default=started) - started
    last = max((o.finish_time or started for o in outputs), default=started) - started
    return first, last


def fill_kv(stats: RoundStats, kv: KVCacheManager, bytes_per_block: int, table_ids: Sequence[str],
            tokenized: Sequence[TokenizedTurn]) -> None:
    """KV accounting over the round's tables (one per turn; a table reclaimed under memory
    pressure is skipped). A block held by several tables counts once, split evenly for per-agent
    bytes."""
    present = [(t, turn) for t, turn in zip(table_ids, tokenized) if kv.has(t)]
    holders: dict[int, int] = {}
    for table_id, _ in present:
        for block in kv.get_block_ids(table_id):
            holders[block] = holders.get(block, 0) + 1
    shared_slots: set[int] = set()
    for table_id, turn in present:
        slots = kv.get_slots(table_id)
        span_slots = [slots[p] for s in turn.shared_spans for p in range(s.start, min(s.end, len(slots)))]
        stats.shared_logical_tokens += len(span_slots)
        shared_slots.update(span_slots)
        blocks = kv.get_block_ids(table_id)
        private = {b for b in blocks if holders[b] == 1}
        stats.agents.append(AgentKVStats(
            agent_id=turn.agent_id,
            logical_tokens=len(slots),
            private_blocks=len(private),
            diff_blocks=len({kv.block_of(s) for s in span_slots} & private),
            kv_bytes=sum(bytes_per_block / holders[b] for b in blocks),
        ))
    stats.logical_kv_tokens = sum(a.logical_tokens for a in stats.agents)
    stats.physical_kv_blocks = len(holders)
    stats.physical_kv_tokens = len(holders) * kv.block_size
    stats.kv_bytes = len(holders) * bytes_per_block
    stats.shared_physical_tokens = len(shared_slots)
    stats.diff_blocks = sum(a.diff_blocks for a in stats.agents)
    derive(stats)


def fill_reads(stats: RoundStats, before, after, row_bytes: int) -> None:
    """Decode traffic between two snapshots of the model's `DecodeReads`."""
    stats.decode_steps = after.steps - before.steps
    stats.decode_kv_bytes_read = (after.rows_loaded - before.rows_loaded) * row_bytes
    stats.decode_kv_bytes_requested = (after.rows_requested - before.rows_requested) * row_bytes
    derive(stats)


def fill_work(stats: RoundStats, work: Account, peaks: Peaks) -> None:
    stats.work, stats.peaks = work, peaks
    derive(stats)


def derive(stats: RoundStats) -> None:
    """The ratios, from the counts."""
    if stats.work is not None:
        whole = stats.work.total()
        stats.roofline_seconds = sum(w.roofline_seconds(stats.peaks) for w in stats.work.kinds.values())
        stats.forward_seconds, stats.sampling_seconds = whole.seconds, stats.work.sampling_seconds
        stats.other_seconds = max(0.0, stats.round_seconds - stats.forward_seconds - stats.sampling_seconds)
        stats.efficiency = stats.roofline_seconds / stats.round_seconds if stats.round_seconds > 0 else 0.0
    stats.decode_kv_mb_per_step = stats.decode_kv_bytes_read / max(1, stats.decode_steps) / 2**20
    stats.decode_read_reduction = stats.decode_kv_bytes_requested / max(1, stats.decode_kv_bytes_read)
    stats.kv_bytes_per_agent = stats.kv_bytes / max(1, len(stats.agents))
    stats.compression = stats.logical_kv_tokens / max(1, stats.physical_kv_tokens)
    stats.shared_compression = stats.shared_logical_tokens / max(1, stats.shared_physical_tokens)


SUMMED = ("lookup_seconds", "selection_seconds", "recompute_seconds", "private_prefill_seconds", "prompt_tokens",
          "computed_tokens", "reused_tokens", "recomputed_tokens", "logical_kv_tokens", "physical_kv_blocks",
          "physical_kv_tokens", "kv_bytes", "shared_logical_tokens", "shared_physical_tokens", "diff_blocks",
          "decode_steps", "decode_kv_bytes_read", "decode_kv_bytes_requested")


def merge_waves(waves: list[tuple[list[RequestOutput], RoundStats]], started: float) -> RoundStats:
    """One round's statistics from the waves it ran in: times from the start of the first wave,
    counts summed (each wave had its own masters, so physical KV adds up)."""
    outputs = [o for wave_outputs, _ in waves for o in wave_outputs]
    first = waves[0][1]
    stats = RoundStats(first.round_index, first.mode, len(outputs), num_waves=len(waves))
    stats.prefill_seconds, stats.round_seconds = _times(outputs, started)
    stats.decode_seconds = stats.round_seconds - stats.prefill_seconds
    for name in SUMMED:
        setattr(stats, name, sum(getattr(w, name) for _, w in waves))
    stats.agents = [a for _, w in waves for a in w.agents]
    if all(w.work is not None for _, w in waves):
        stats.work, stats.peaks = Account(), first.peaks
        for _, w in waves:
            stats.work.merge(w.work)
    if all(w.cost is not None for _, w in waves):
        stats.cost = RoundCost()
        for _, w in waves:
            stats.cost.add(w.cost)
    derive(stats)
    return stats
