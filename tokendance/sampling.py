"""Sampling parameters (validated at the edge) and the batched sampler."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tokendance.errors import InvalidRequestError
from tokendance.structured import GrammarCompiler, Guide, StructuredOutput, allowed_tokens

MAX_TOP_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop. Invalid values raise `InvalidRequestError`.

    temperature 0 (or below 1e-5, where logits / temperature would overflow) is greedy; top_k <= 0
    and top_p == 1 disable those filters; max_tokens None
    means "until the context window is full"; `seed` makes a sampled output reproducible
    whatever else shares its batches.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    ignore_eos: bool = False
    return_logits: bool | int = False  # attach float32 logits: True = every generated position, k = the first k
    # Log-probabilities of each sampled token under the model (before temperature, top-k/p and
    # grammar masks), plus the `logprobs` most likely alternatives: None = off, 0 = the token's own.
    logprobs: int | None = None
    structured: StructuredOutput | None = None  # constrain the output (JSON schema, regex, ...)
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check(_is_number(self.temperature) and 0 <= self.temperature < math.inf,
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check(_is_number(self.top_p) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(_is_int(self.top_k) and self.top_k >= -1,
               f"top_k must be an integer >= -1 (0 or -1 disable it), got {self.top_k!r}")
        _check(self.seed is None or (_is_int(self.seed) and -(2**63) <= self.seed < 2**64),
               f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        _check(self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
               f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        stop = [self.stop] if isinstance(self.stop, str) else _as_list(self.stop)
        _check(stop is not None and all(isinstance(s, str) and s for s in stop),
               f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_strings = tuple(stop)
        ids = _as_list(self.stop_token_ids)
        _check(ids is not None and all(_is_int(i) and i >= 0 for i in ids),
               f"stop_token_ids must be a list of non-negative integers, got {self.stop_token_ids!r}")
        self.stop_token_ids = tuple(ids)
        _check(isinstance(self.return_logits, bool) or (_is_int(self.return_logits) and self.return_logits >= 0),
               f"return_logits must be a bool or a count >= 0, got {self.return_logits!r}")
        _check(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
               f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}")
        _check(self.structured is None or isinstance(self.structured, StructuredOutput),
               f"structured must be a StructuredOutput, got {type(self.structured).__name__}")
        _check(self.structured is None or not self.ignore_eos,
               "ignore_eos cannot be combined with structured output (a complete output ends with EOS)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW or self.top_k == 1


GREEDY_BELOW = 1e-5  # temperatures this small sample the argmax anyway; dividing by them overflows


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)


def _as_list(value) -> list | None:
    """None -> [], a list/tuple -> list, anything else -> None (invalid)."""
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else None


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


@dataclass
class TokenLogprobs:
    """One generated token's log-probability and the most likely alternatives, best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], counts: Sequence[int]) -> list[TokenLogprobs]:
    """logits: [B, vocab] (model dtype); one entry per row, with counts[row] alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, torch.tensor(tokens, dtype=torch.int64, device=logits.device)[:, None])[:, 0].tolist()
    k = max(counts)
    top_values, top_ids = (logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long()))
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [TokenLogprobs(t, c, list(zip(top_ids[row][:n], top_values[row][:n])))
            for row, (t, c, n) in enumerate(zip(tokens, chosen, counts))]


class Sampler:
    """Turns a batch of logits into one token per row. Seeded requests own a generator for their
    whole life, so their draws do not depend on batch composition; guided requests (structured
    output) own a grammar matcher, advanced by each token they sample."""

    def __init__(self, device, grammars: GrammarCompiler | None = None):
        self.device = device
        self.grammars = grammars
        self._generators: dict[str, torch.Generator] = {}
        self._guides: dict[str, Guide] = {}

    def sample(
        self, logits: torch.Tensor, request_ids: Sequence[str], params: Sequence[SamplingParams]
    ) -> list[int]:  # logits: [B, vocab]
        guides = [self._guide(request_id, p) for request_id, p in zip(request_ids, params)]
        guided = [row for row, guide in enumerate(guides) if guide is not None]
        if guided:  # one bitmask for all guided rows, applied to a copy of those rows
            allowed = allowed_tokens([guides[row] for row in guided], logits.shape[-1])
            masked = logits[guided].masked_fill(~allowed, float("-inf"))
        # max().indices: same choice as argmax, measured 5x faster on bf16 rows on CPU
        tokens = logits.max(dim=-1).indices.tolist()
        if guided:
            for row, token in zip(guided, masked.max(dim=-1).indices.tolist()):
                tokens[row] = token
        for row, (request_id, p) in enumerate(zip(request_ids, params)):
            if not p.is_greedy:
                row_logits = masked[guided.index(row)] if guides[row] is not None else logits[row]
                tokens[row] = self._sample_row(row_logits, request_id, p)
        for row in guided:
            guides[row].consume(tokens[row])
        return tokens

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        self._guides.pop(request_id, None)

    def snapshot(self) -> dict:
        """The seeded generators' states and the matchers' positions, to rewind a step that failed
        half way."""
        return {"generators": {request_id: g.get_state() for request_id, g in self._generators.items()},
                "guides": {request_id: g.num_consumed for request_id, g in self._guides.items()}}

    def restore(self, snapshot: dict) -> None:
        states = snapshot["generators"]
        for request_id, state in states.items():
            if request_id in self._generators:
                self._generators[request_id].set_state(state)
        for request_id in self._generators.keys() - states.keys():  # created by the failed step
            del self._generators[request_id]
        positions = snapshot["guides"]
        for request_id in list(self._guides):
            if request_id in positions:
                self._guides[request_id].rollback_to(positions[request_id])
            else:
                del self._guides[request_id]

    def _guide(self, request_id: str, p: SamplingParams) -> Guide | None:
        if p.structured is None:
            return None
        guide = self._guides.get(request_id)
        if guide is None:
            if self.grammars is None:
                raise InvalidRequestError("this sampler has no grammar compiler for structured output")
            guide = self._guides[request_id] = Guide(self.grammars.matcher(p.structured))
        return guide

    def _sample_row(self, logits: torch.Tensor, request_id: str, p: SamplingParams) -> int:
        logits = logits.float() / p.temperature
        if p.top_k > 0 and p.top_k < logits.numel():
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # keep the smallest prefix whose mass reaches top_p (always at least one token)
            drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            drop[0] = False  # a top_p below float32's range (1e-300) compares as 0: the top token stays
            sorted_probs[drop] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator(request_id, p)))

    def _generator(self, request_id: str, p: SamplingParams) -> torch.Generator | None:
        if p.seed is None:
            return None
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=self.device).manual_seed(p.seed)
            self._generators[request_id] = generator
        return generator
