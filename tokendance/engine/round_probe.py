"""A round's probe (`--fidelity auto`): one member computed exactly, which is what it gets, and
once more from the round's reused KV, which nobody gets (round_core/fidelity_control.py says what
the readings mean and what the controller does with them).

The exact member is a plain request of the round: the scheduler computes it from the prefix
cache, never from shared KV. Its shadow is one more agent of the round's prefill (the probed
agent's turn under another table id), decoded greedily for `PULL_TOKENS`. Once both have finished,
two scoring requests run the exact reply's first `PROBE_TOKENS` tokens: one on the shadow's table
cut back to the prompt (the reused KV), one on the prefix cache (the exact KV). Cost: the probed
member's prompt once more than its share of the round, plus those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokendance.engine.request import Request
from tokendance.kv.manager import KVCacheManager
from tokendance.outputs import RequestOutput
from tokendance.reuse.fidelity import ForcedScores
from tokendance.reuse.segments import TokenizedTurn
from tokendance.round_core.fidelity_control import PROBE_TOKENS, PULL_TOKENS, Controller, Reading, pull
from tokendance.sampling import SamplingParams

SHADOW = SamplingParams(temperature=0, max_tokens=PULL_TOKENS)
SCORE = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0, return_logits=True)


class RoundProbe:
    """The probed member's exact request (a member of the round), its shadow and, once both have
    finished, the two scoring requests. Invariant: it holds no table but the shadow's (from its
    release until scoring starts) and the scoring requests' (until they finish)."""

    def __init__(self, setting: str, turn: TokenizedTurn, exact: Request, shadow: Request):
        self.setting, self.turn, self.exact, self.shadow = setting, turn, exact, shadow
        self.outputs: dict[str, RequestOutput] = {}  # request id -> final output (shadow, scores)
        self.scoring: list[Request] = []
        self.skipped: str | None = None

    @property
    def request_ids(self) -> list[str]:
        return [self.shadow.request_id, *(r.request_id for r in self.scoring)]

    @property
    def done(self) -> bool:
        return self.skipped is not None or (bool(self.scoring) and all(r.request_id in self.outputs
                                                                        for r in self.scoring))

    def observe(self, output: RequestOutput, exact_output: RequestOutput | None, kv: KVCacheManager) -> list[Request]:
        """A finished output of the shadow or a scoring request (or of the exact member, passed as
        `exact_output`): the scoring requests to run once the exact reply and the shadow's are in."""
        if output.request_id in self.request_ids:
            self.outputs[output.request_id] = output
        if self.scoring or self.skipped or exact_output is None or self.shadow.request_id not in self.outputs:
            return []
        if exact_output.finish_reason in ("abort", "error") or self.outputs[self.shadow.request_id].finish_reason in (
                "abort", "error"):
            self.skip("the probed member or its shadow did not finish", kv)
            return []
        return self._score(exact_output, kv)

    def _score(self, exact_output: RequestOutput, kv: KVCacheManager) -> list[Request]:
        prompt = self.turn.token_ids
        # (an empty reply: its first token's distribution is scored all the same)
        reply = list(exact_output.token_ids[:PROBE_TOKENS]) or [prompt[-1]]
        tokens, start = prompt + reply, len(prompt) - 1
        ids = (f"{self.shadow.request_id}:reused", f"{self.shadow.request_id}:exact")
        self.scoring = [Request(i, tokens, SCORE, 1, self.exact.eos_token_ids, self.exact.namespace,
                                group=self.exact.group, score_from=start) for i in ids]
        shadow = self.shadow.request_id
        kv.truncate(shadow, start)  # the reused KV of the prompt but its last token
        kv.rename(shadow, ids[0])
        kv.mark_prepared(ids[0], start, 0)
        return self.scoring

    def skip(self, reason: str, kv: KVCacheManager) -> None:
        """No reading this round; the shadow's table, if still held, is freed."""
        self.skipped = self.skipped or reason
        if kv.has(self.shadow.request_id):
            kv.free(self.shadow.request_id)

    def reading(self, exact_output: RequestOutput, others: list[RequestOutput]) -> Reading | None:
        """The round's reading (None if skipped): the forced scores and the shadow's pull toward
        the other members' replies."""
        if self.skipped is not None:
            return None
        reused, exact = (self.outputs[r.request_id] for r in self.scoring)
        if not reused.prompt_logits or set(reused.prompt_logits) != set(exact.prompt_logits or {}):
            self.skipped = "the scoring requests returned no logits"
            return None
        positions = sorted(exact.prompt_logits)
        scores = ForcedScores()
        scores.add(torch.stack([exact.prompt_logits[p] for p in positions]),
                   torch.stack([reused.prompt_logits[p] for p in positions]))
        summary = scores.summary()
        shadow = self.outputs[self.shadow.request_id]
        return Reading(self.exact.agent_id, self.setting, summary["kl_mean"], summary["top1_agreement"],
                       pull(shadow.text, exact_output.text, [o.text for o in others]), summary["positions"])


@dataclass
class AutoRound:
    """A round of `--fidelity auto`: its simulation's controller, the setting it runs at and its
    probe (None where the setting is exact or the round has one member)."""

    controller: Controller
    setting: str
    probe: RoundProbe | None = None
