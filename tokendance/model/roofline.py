"""The work a forward pass does, against what the machine can do.

Work is counted from the scheduled items (plain arithmetic on their lengths, no timing inside the
model): the FLOPs of the linear layers (2 x weights x rows; the LM head for sampled rows only),
of attention (QK^T and PV: 4 x query width x keys attended, per layer), the bytes of weights
streamed (a forward reads every weight once, whatever its rows) and of KV read (each item's
context once per layer) and written. The peaks are measured once per machine, dtype and thread
count and cached: a large GEMM at the engine's dtype, and the memory's streaming read bandwidth.

A part's roofline time is max(FLOPs / GEMM peak, bytes / bandwidth): what the machine needs at
the least; its efficiency is that over the time it took. Attention counts against the GEMM peak
too (it is matrix products); a forward that mixes kinds (a round's preparation beside decoding
requests) has its time split between them in proportion to their roofline times.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch

from tokendance.batch import ScheduledRequest
from tokendance.config import ModelConfig

KINDS = ("prepare", "check", "prefill", "decode")  # a round's KV preparation, its check pass, requests' own
PEAKS_VERSION = 2  # 2: GEMM sized to the CPU (emulated bf16 measured at 256-512)


@dataclass(frozen=True)
class ModelShape:
    """What a forward costs per row and per key, from the model's config and dtype."""

    num_layers: int
    layer_params: int  # linear weights of one layer
    head_params: int  # the LM head's
    query_width: int  # num_heads x head_dim
    kv_row_bytes: int  # one token's K and V in one layer, all KV heads
    element_bytes: int

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype) -> ModelShape:
        h, q, kv = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        element = torch.empty((), dtype=dtype).element_size()
        return cls(num_layers=config.num_layers, layer_params=h * (2 * q + 2 * kv) + 3 * h * config.intermediate_size,
                   head_params=h * config.vocab_size, query_width=q, kv_row_bytes=2 * kv * element,
                   element_bytes=element)


@dataclass
class Work:
    """Counts of one kind of work (additive); `seconds` is the forward time it is given."""

    rows: int = 0
    linear_flops: float = 0.0
    attention_flops: float = 0.0
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    seconds: float = 0.0

    @property
    def flops(self) -> float:
        return self.linear_flops + self.attention_flops

    def roofline_seconds(self, peaks: Peaks) -> float:
        return max(self.flops / peaks.gemm_flops, (self.weight_bytes + self.kv_bytes) / peaks.bandwidth)

    def add(self, other: Work, sign: int = 1) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + sign * getattr(other, f.name))


def items_work(items: list[ScheduledRequest], shape: ModelShape, num_layers: int | None = None) -> Work:
    """The work of computing `items` through the first `num_layers` layers (all when None),
    weights not counted (a forward reads them once for all its items: `Account.record`)."""
    layers = shape.num_layers if num_layers is None else num_layers
    rows = keys = sampled = context = 0
    for item in items:
        positions = item.positions
        rows += len(positions)
        keys += sum(positions) + len(positions)  # the query at position p attends p + 1 keys
        context += positions[-1] + 1 if len(positions) else 0
        sampled += item.sample and num_layers is None
    return Work(rows=rows,
                linear_flops=2.0 * rows * shape.layer_params * layers + 2.0 * sampled * shape.head_params,
                attention_flops=4.0 * keys * shape.query_width * layers,
                kv_bytes=float((context + rows) * shape.kv_row_bytes * layers))  # read each context, write the rows


@dataclass
class Account:
    """Cumulative work by kind, the forward time given to each, the sampler's time and the steps;
    `snapshot` and `since` give a window (a round's)."""

    kinds: dict[str, Work] = field(default_factory=lambda: {k: Work() for k in KINDS})
    forwards: int = 0
    sampling_seconds: float = 0.0

    def record(self, parts: dict[str, Work], shape: ModelShape, num_layers: int | None, seconds: float,
               peaks: Peaks) -> None:
        """One forward of `parts` (kind -> items' work) that took `seconds`: every weight read once,
        split between the kinds by rows; the time split by their roofline times."""
        parts = {k: w for k, w in parts.items() if w.rows}
        rows = sum(w.rows for w in parts.values())
        if not rows:
            return
        layers = shape.num_layers if num_layers is None else num_layers
        weights = float(shape.layer_params * layers * shape.element_bytes)
        if num_layers is None:
            weights += shape.head_params * shape.element_bytes
        for work in parts.values():
            work.weight_bytes = weights * work.rows / rows
        shares = {k: w.roofline_seconds(peaks) for k, w in parts.items()}
        total = sum(shares.values()) or 1.0
        for kind, work in parts.items():
            work.seconds = seconds * shares[kind] / total
            self.kinds[kind].add(work)
        self.forwards += 1

    def snapshot(self) -> Account:
        return Account({k: Work(**asdict(w)) for k, w in self.kinds.items()}, self.forwards, self.sampling_seconds)

    def since(self, before: Account) -> Account:
        window = self.snapshot()
        for kind, work in before.kinds.items():
            window.kinds[kind].add(work, -1)
        window.forwards -= before.forwards
        window.sampling_seconds -= before.sampling_seconds
        return window

    def merge(self, other: Account) -> None:
        for kind, work in other.kinds.items():
            self.kinds[kind].add(work)
        self.forwards += other.forwards
        self.sampling_seconds += other.sampling_seconds

    def total(self) -> Work:
        whole = Work()
        for work in self.kinds.values():
            whole.add(work)
        return whole


# ---------------------------------------------------------------- the machine's peaks


@dataclass(frozen=True)
class Peaks:
    """Measured: FLOP/s of a large GEMM in `dtype`, bytes/s of a streaming read."""

    dtype: str
    num_threads: int
    gemm_flops: float
    bandwidth: float

    def describe(self) -> str:
        return (f"GEMM {self.gemm_flops / 1e9:.0f} GFLOP/s ({self.dtype}, {self.num_threads} threads), "
                f"memory {self.bandwidth / 1e9:.1f} GB/s")


def machine_peaks(dtype: torch.dtype, cpu_description: str, cache_dir: Path | None = None) -> Peaks:
    """The peaks for this CPU, dtype and thread count: from the cache, else measured (~1 s) and
    kept in `$XDG_CACHE_HOME/tokendance/peaks.json`."""
    threads = torch.get_num_threads()
    key = f"v{PEAKS_VERSION}|{cpu_description}|{dtype}|{threads}|torch {torch.__version__}"
    directory = cache_dir or Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokendance"
    path = directory / "peaks.json"
    try:
        known = json.loads(path.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return Peaks(**known[key])
    peaks = Peaks(str(dtype).removeprefix("torch."), threads, _gemm_flops(dtype), _bandwidth())
    known[key] = asdict(peaks)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known, indent=1))
    except OSError:
        pass  # measured again next time
    return peaks


def best_seconds(fn, repeats: int) -> float:
    """The fastest of `repeats` timed calls, after one untimed."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def _gemm_flops(dtype: torch.dtype, max_size: int = 2048, enough_seconds: float = 0.05) -> float:
    """Square GEMMs from 256 up, doubling until one takes `enough_seconds` (or `max_size`): bf16
    emulated on a CPU without bf16 dot products runs at a few GFLOP/s, where one 2048^3 product
    alone takes seconds."""
    size = 256
    while True:
        a = torch.randn(size, size).to(dtype)
        b = torch.randn(size, size).to(dtype)
        started = time.perf_counter()
        torch.mm(a, b)
        if size >= max_size or time.perf_counter() - started >= enough_seconds:
            return 2.0 * size**3 / best_seconds(lambda: torch.mm(a, b), 3)
        size *= 2


def _bandwidth(num_bytes: int = 512 * 2**20) -> float:
    x = torch.ones(num_bytes // 4, dtype=torch.float32)
    return num_bytes / best_seconds(lambda: x.sum(), 5)
