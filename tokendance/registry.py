"""Every name a user chooses, in one place, with its default: reuse policies, token selections,
dtypes. Cheap to import (the CLIs build their parsers from it); the class behind a name is
imported when an engine is built (`load`).

Adding a reuse policy: a module with a `ReusePolicy` subclass (tokendance/reuse/policy.py says
what it implements) and one line in REUSE_POLICIES. `EngineConfig`, `LLM`, `tokendance serve`,
`tokendance bench` (its modes, table and plot order, capacity search) read the names from here.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from tokendance.errors import InvalidRequestError


class Choice(NamedTuple):
    target: str  # "module:Class" implementing it
    help: str
    reuses: bool = True  # a reuse policy that keeps or shares KV (the capacity search compares these)


REUSE_POLICIES = {  # in the order of tables and plots
    "full": Choice("tokendance.reuse.policy:FullRecompute", "no reuse: every prompt computed whole", False),
    "prefix": Choice("tokendance.reuse.policy:PrefixCaching", "prefix caching only (exact)"),
    "pic": Choice("tokendance.reuse.per_request:PerRequestReuse", "position-independent reuse, agent by agent"),
    "tokendance": Choice("tokendance.reuse.collector:KVCollector",
                         "collective reuse (KV Collector) and Master-Mirror storage"),
}
SELECTIONS = {  # which tokens of a reused span are recomputed in their new context
    "epic": Choice("tokendance.reuse.selection:EpicSelector", "the first tokens of each span"),
    "cacheblend": Choice("tokendance.reuse.selection:CacheBlendSelector",
                         "the tokens whose values deviate most at the check layer"),
    "anchor-spread": Choice("tokendance.reuse.selection:AnchorSpreadSelector",
                            "the tokens whose in-round anchors disagree most (anchors > 1)"),
}
MASTERS = {  # where the base KV of a round's shared spans is computed (tokendance)
    "neutral": "once, in a row of their own: no agent's private text colours the KV the others read",
    "agent": "in the context of an agent holding them (its persona, memories, ...), that agent exact",
}
TRANSPARENT_RULES = {  # which chat requests the vLLM plugin's endpoint holds for a transparent round
    "shared": Choice("tokendance.vllm_plugin.http.gathering:AnyText",
                     "any chat request that comes while another is at the endpoint; those sharing a line outside "
                     "their common prefix form a round, whoever wrote it"),
    "quotes": Choice("tokendance.vllm_plugin.http.gathering:RecentReplies",
                     "only chat requests quoting a line a reply of this server wrote lately"),
}
DTYPES = {
    "auto": "bfloat16 where the CPU has native bf16 (AVX512-BF16, AMX), else float32",
    "bfloat16": "bfloat16 weights, activations and KV",
    "float32": "float32 everywhere",
}

class Preset(NamedTuple):
    settings: dict  # EngineConfig fields it sets
    help: str


FIDELITY = {  # named trade-offs between exactness and reuse (docs/concepts.md#fidelity-presets)
    "exact": Preset({"reuse": "prefix"}, "prefix caching only (the default): outputs as full prefill's"),
    "floor": Preset({"reuse": "tokendance", "recompute_ratio": 0.95},
                    "collective reuse recomputing 95% of each span: KL ~2-4x the bf16 noise floor, no faster "
                    "than exact"),
    "balanced": Preset({"reuse": "tokendance", "recompute_ratio": 0.05, "anchors": 4, "selection": "anchor-spread"},
                       "collective reuse over 4 in-round anchors, recomputing the 5% they disagree on most: KL ~9x "
                       "the floor at 2.4x shared-span compression, ~1.07x the default's round TTFT"),
    "fast": Preset({"reuse": "tokendance", "recompute_ratio": 0.05},
                   "collective reuse recomputing 5% over neutral masters: the most reuse (round TTFT ~2.6x prefix "
                   "caching's at 16 agents); in closed loops agents repeat each other more than under full computation"),
}

# Exact by default: over closed-loop runs `fast` made agents repeat each other more than full computation
# does (docs/benchmarks.md#what-agents-say-in-the-closed-loop); collective reuse is `--fidelity fast`.
DEFAULT_REUSE = "prefix"
SHARING = ("pic", "tokendance")  # reuse modes that serve one agent's prompt from KV computed for another's
DEFAULT_SELECTION = "epic"
DEFAULT_MASTERS = "neutral"  # no agent's private text reaches another's (docs/concepts.md#where-masters-are-computed)
DEFAULT_DTYPE = "auto"
DEFAULT_TRANSPARENT_RULE = "shared"
DEFAULT_RECOMPUTE_RATIO = 0.05  # the fidelity sweep's choice (docs/benchmarks.md#the-recompute-ratio-sweep)


def check(kind: str, name: str, names) -> str:
    """`name` if it is one of `names`, else an InvalidRequestError naming the field `kind`."""
    if name not in names:
        raise InvalidRequestError(f"{kind} must be one of {', '.join(names)}, got {name!r}", kind)
    return name


def load(choice: Choice):
    """The class a registered name stands for."""
    module, name = choice.target.split(":")
    return getattr(importlib.import_module(module), name)


def describe(choices: dict) -> str:
    """'name: help; ...' for a CLI option's help (argparse formats it: a % is doubled)."""
    text = "; ".join(f"{name}: {c if isinstance(c, str) else c.help}" for name, c in choices.items())
    return text.replace("%", "%%")


MAX_ANCHORS = 8  # in-round anchors per span, at most


def valid_anchors(value) -> bool:
    """An in-round anchor count: an integer in [1, MAX_ANCHORS]."""
    return isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_ANCHORS
