"""`--fidelity auto`: a simulation's rounds move along a ladder of reuse settings, from the
cheapest to exact, by what a probe in each round reads. Pure Python: the engine's round runner
and the vLLM plugin's scheduler side both hold one `Controller` per simulation.

A probe is one member of a sharing round, in rotation, computed exactly (what that member gets)
and also from the round's reused KV: the reused KV scored teacher-forced on the first tokens of
the exact reply (KL(exact || reused) per token, top-1 agreement), and a short greedy reply
decoded from it, to see whether reuse pulls the member toward what the others say (`pull`:
its likeness to their replies, reused minus exact). The controller goes up a rung at once when a
reading breaches the target, and back down after calm rounds; a rung that breached must stay
calm twice as long before it is tried again. Exact has nothing to probe: it only counts rounds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from tokendance import registry
from tokendance.convergence import reply_words
from tokendance.errors import InvalidRequestError


@dataclass(frozen=True)
class Target:
    """The most a probe may read: mean KL(exact || reused) per token, in nats, and pull."""

    kl: float
    pull: float


# Named bounds (docs/concepts.md#fidelity-auto). On the 135M at `fast` (AVX512-BF16, bf16), probes
# of rounds whose replies stay their own read KL 0.000-0.040 and pull <= 0.14; a shadow that
# repeats another member's reply reads pull 0.6-1.0.
TARGETS = {
    "strict": Target(kl=0.02, pull=0.1),
    "default": Target(kl=0.06, pull=0.3),
    "loose": Target(kl=0.15, pull=0.5),
}
DEFAULT_TARGET = "default"
DEFAULT_LADDER = ("fast", "balanced", "exact")  # names of registry.FIDELITY presets, cheapest first
EXACT = "exact"
DEFAULT_CALM_ROUNDS = 3
PROBE_TOKENS = 16  # the exact reply's first tokens scored under the reused KV
PULL_TOKENS = 24  # the reused reply decoded beside the exact one


@dataclass(frozen=True)
class Reading:
    """One round's probe. `kl`, `agreement`: over `positions` tokens of the exact reply; `pull`:
    likeness of the reused reply to the other members' replies minus the exact reply's."""

    agent_id: str
    setting: str
    kl: float
    agreement: float
    pull: float
    positions: int

    def breaches(self, target: Target) -> bool:
        return self.kl > target.kl or self.pull > target.pull


@dataclass
class Step:
    """What a round of a simulation ran and what it changed: `reading` None where nothing was
    probed (exact, a round of one, a probe that failed: `skipped` says why)."""

    setting: str
    level: int  # its rung: 0 the cheapest
    reading: Reading | None = None
    breach: bool = False
    move: str | None = None  # "fast -> balanced": the setting the next round runs at
    skipped: str | None = None
    probe_tokens: int = 0  # prompt tokens the probe computed beyond the round's own (the exact member, the scores)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Controller:
    """One simulation's rung on the ladder. Invariant: `ladder[-1]` is exact, `0 <= level <
    len(ladder)`; `patience[i]` >= 1 is how many times `calm_rounds` the rung above `i` must be
    calm before `i` is tried (doubled each time `i` breaches)."""

    ladder: tuple[str, ...] = DEFAULT_LADDER
    target: Target = TARGETS[DEFAULT_TARGET]
    calm_rounds: int = DEFAULT_CALM_ROUNDS
    level: int = 0
    calm: int = 0
    rounds: int = 0
    patience: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_ladder(self.ladder)
        self.patience = self.patience or [1] * len(self.ladder)

    @property
    def setting(self) -> str:
        return self.ladder[self.level]

    def probe_agent(self, agent_ids: Sequence[str]) -> str | None:
        """The member this round probes: every agent in turn (by sorted id), none at exact or
        in a round of one."""
        if self.setting == EXACT or len(agent_ids) < 2:
            return None
        ordered = sorted(agent_ids)
        return ordered[self.rounds % len(ordered)]

    def observe(self, setting: str, reading: Reading | None, skipped: str | None = None) -> Step:
        """A round ran at `setting` with this probe: the next round's setting."""
        self.rounds += 1
        step = Step(setting, self.ladder.index(setting), reading, skipped=skipped)
        before = self.setting
        if reading is not None and reading.breaches(self.target):
            step.breach = True
            at = self.ladder.index(setting)
            self.patience[at] *= 2
            self.level, self.calm = max(self.level, min(at + 1, len(self.ladder) - 1)), 0
        else:
            self.calm += 1
            if self.level > 0 and self.calm >= self.calm_rounds * self.patience[self.level - 1]:
                self.level, self.calm = self.level - 1, 0
        if self.setting != before:
            step.move = f"{before} -> {self.setting}"
        return step


def check_ladder(ladder: Sequence[str]) -> None:
    """A ladder names fidelity presets once each, cheapest first, ending at exact."""
    for name in ladder:
        registry.check("fidelity_ladder", name, registry.FIDELITY)
    if not ladder or ladder[-1] != EXACT or len(set(ladder)) != len(ladder):
        raise InvalidRequestError(f"fidelity_ladder must name each setting once and end at {EXACT!r}, got "
                                  f"{list(ladder)!r}", "fidelity_ladder")


def check_target(name: str) -> Target:
    return TARGETS[registry.check("fidelity_target", name, TARGETS)]


def pull(reused: str, exact: str, others: Sequence[str]) -> float:
    """How much more the reused reply is like another member's reply than the exact one is:
    likeness is the share of a reply's word pairs found in the other reply (the best over
    `others`); the exact reply is cut to the reused one's length first."""
    reused_words = reply_words(reused)
    exact_words = reply_words(exact)[: max(len(reused_words), 2)]
    return _likeness(reused_words, others) - _likeness(exact_words, others)


def _likeness(words: tuple[str, ...], others: Sequence[str]) -> float:
    pairs = set(zip(words, words[1:]))
    if not pairs:
        return 0.0
    best = 0.0
    for other in others:
        w = reply_words(other)
        best = max(best, len(pairs & set(zip(w, w[1:]))) / len(pairs))
    return best
