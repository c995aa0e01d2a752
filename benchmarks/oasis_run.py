"""One OASIS simulation (CAMEL-AI's social-media simulation, PyPI `camel-oasis`) against an
OpenAI-compatible server, as its users run it: its own agents, profiles, Reddit platform and
tool calls, no source edits. Runs inside OASIS's own environment (`make oasis`: .venv-oasis), which
shares nothing with this package; `benchmarks/oasis_bench.py` starts the servers and runs this.

    .venv-oasis/bin/python benchmarks/oasis_run.py --url http://127.0.0.1:8000/v1 --agents 16 --steps 3 --out r.json

(OASIS writes its logs to ./log of the directory it runs in; `oasis_bench.py` runs it in a
temporary one.)

Step 0 seeds the forum with a few posts (OASIS's ManualAction, no LLM); every later step asks all
agents at once for their actions (LLMAction: one chat request with OASIS's 13 Reddit tools per
agent). Per step it reports the wall time, the chat requests by HTTP status (the `openai` client's
own log lines), OASIS's agent errors (a reply it could not act on: a tool call cut short or
malformed), the actions OASIS recorded (its database's trace), the agents that acted, and what the
server's /metrics counted meanwhile (prompt and cached tokens, rounds). Writes JSON to --out.

What the user configures, and why: `tool_choice: "required"` (without it the default 135M model
answers in prose and no agent acts; `--tool-choice auto` is OASIS's own default), replies capped by
`max_completion_tokens`, and a token counter of 4 characters a token (CAMEL's default downloads
tiktoken's table, and this machine is offline).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import re
import sqlite3
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path

from camel.models import ModelFactory
from camel.types import ModelPlatformType
from camel.utils import BaseTokenCounter

import oasis
from oasis import ActionType, LLMAction, ManualAction, generate_reddit_agent_graph

FIRST = ["Ava", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jun", "Kemal", "Lena", "Mateo",
         "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sami", "Tariq", "Uma", "Viktor", "Wen", "Ximena", "Yusuf", "Zoe"]
LAST = ["Novak", "Okafor", "Silva", "Tanaka", "Moreau", "Khan", "Larsen", "Rossi", "Kim", "Mendes", "Haddad", "Berg"]
JOBS = ["teacher", "nurse", "software developer", "farmer", "student", "journalist", "chef", "mechanic",
        "architect", "retired engineer", "shop owner", "musician"]
LIKES = ["local politics", "cycling", "cooking", "science news", "gardening", "football", "video games",
         "photography", "climate policy", "history", "personal finance", "movies"]
MBTI = ["INTJ", "ENFP", "ISTJ", "ESFJ", "INFP", "ENTP", "ISFP", "ESTJ"]
COUNTRIES = ["Canada", "Brazil", "Japan", "Germany", "Nigeria", "India", "Mexico", "Sweden"]
SEED_POSTS = [
    "Our city council wants to replace the old bus depot with a parking garage. Good idea or not?",
    "New study: people who cycle to work report being happier than people who drive. Does that match you?",
    "What is one cheap meal you cook every week? Mine is lentil soup with too much garlic.",
    "The library is cutting its weekend hours to save money. Would you pay a small fee to keep them?",
]
CHAT_PATH = "/chat/completions"


class CharTokenCounter(BaseTokenCounter):
    """Four characters a token: what CAMEL's memory needs to know of a prompt's size, offline."""

    def count_tokens_from_messages(self, messages) -> int:
        return len(json.dumps(messages, default=str)) // 4 + 1

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(map(chr, token_ids))


class AgentErrors(logging.Handler):
    """Counts OASIS's "Agent N error" log records: a reply it could not turn into an action (a tool
    call cut short or malformed, or a request that failed)."""

    def __init__(self):
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record) -> None:
        self.count += "error" in record.getMessage()


class HttpStatuses(logging.Handler):
    """Counts the chat requests' HTTP statuses from the `httpx` log lines the `openai` client makes."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.counts: Counter[str] = Counter()

    def emit(self, record) -> None:
        message = record.getMessage()
        status = re.search(r'"HTTP/[\d.]+ (\d{3})', message)
        if status and CHAT_PATH in message:
            self.counts[status.group(1)] += 1


def profiles(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        first, last = FIRST[i % len(FIRST)], rng.choice(LAST)
        job, likes = rng.choice(JOBS), rng.sample(LIKES, 2)
        out.append({"realname": f"{first} {last}", "username": f"{first.lower()}{i}",
                    "bio": f"{job.capitalize()} who posts about {likes[0]}.",
                    "persona": f"{first} {last} is a {rng.randint(19, 70)}-year-old {job} who cares about "
                               f"{likes[0]} and {likes[1]}, writes short, direct comments and likes a good argument.",
                    "age": rng.randint(19, 70), "gender": rng.choice(["female", "male"]),
                    "mbti": rng.choice(MBTI), "country": rng.choice(COUNTRIES)})
    return out


def server_counts(url: str) -> dict[str, float]:
    """The counters a step moves, summed over labels other than the server's own: prompt and cached
    tokens (vLLM's or `tokendance serve`'s names), rounds by how they formed, and the TokenDance
    servers' reused and computed tokens (the plugin's by reason, and its pass seconds by phase)."""
    base = url.rstrip("/").removesuffix("/v1")
    try:
        with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
            text = response.read().decode()
    except OSError:
        return {}
    names = {"vllm:prompt_tokens_total": "prompt_tokens", "tokendance_prompt_tokens_total": "prompt_tokens",
             "vllm:prompt_tokens_cached_total": "cached_tokens",
             "tokendance_cached_prompt_tokens_total": "cached_tokens"}
    out: Counter[str] = Counter()
    for line in text.splitlines():
        sample = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$", line)
        if not sample:
            continue
        name, labels, value = sample.group(1), sample.group(2) or "", float(sample.group(3))
        if name in names:
            out[names[name]] += value
        elif name in ("vllm:tokendance_rounds_total", "tokendance_rounds_total"):
            how = re.search(r'(?:formed|source)="([^"]+)"', labels)
            out[f"rounds.{how.group(1) if how else 'all'}"] += value
        elif name == "vllm:tokendance_transparent_requests_total":
            how = re.search(r'outcome="([^"]+)"', labels)
            out[f"gathered.{how.group(1) if how else 'all'}"] += value
        elif name in ("vllm:tokendance_computed_tokens_total", "vllm:tokendance_pass_seconds_total"):
            how = re.search(r'(?:reason|phase)="([^"]+)"', labels)
            out[f"{name.split('_', 1)[1].removesuffix('_total')}.{how.group(1) if how else 'all'}"] += value
        elif name in ("tokendance_round_computed_tokens_total", "vllm:tokendance_reused_tokens_total",
                      "tokendance_round_reused_tokens_total"):
            out[name.split(":")[-1].removeprefix("tokendance_").removeprefix("round_").removesuffix("_total")] += value
    return dict(out)


def trace_rows(db_path: str, after: int) -> tuple[list[tuple[int, str]], int]:
    """OASIS's recorded actions after row `after`: (user, action) each, and the last row id."""
    with sqlite3.connect(db_path) as db:
        rows = db.execute("SELECT rowid, user_id, action FROM trace WHERE rowid > ? ORDER BY rowid", (after,)).fetchall()
    return [(user, action) for _, user, action in rows], max([after] + [r[0] for r in rows])


async def simulate(args) -> dict:
    statuses, errors = HttpStatuses(), AgentErrors()
    logging.getLogger("httpx").addHandler(statuses)
    logging.getLogger("httpx").setLevel(logging.INFO)
    logging.getLogger("social.agent").addHandler(errors)
    config = {"temperature": 0.0, "max_completion_tokens": args.max_tokens}
    if args.tool_choice != "auto":
        config["tool_choice"] = args.tool_choice
    model = ModelFactory.create(model_platform=ModelPlatformType.OPENAI_COMPATIBLE_MODEL, model_type=args.model,
                                url=args.url, api_key="unused", model_config_dict=config,
                                token_counter=CharTokenCounter(), timeout=args.timeout)
    work = Path(tempfile.mkdtemp(prefix="oasis-"))
    profile_path = work / "profiles.json"
    profile_path.write_text(json.dumps(profiles(args.agents, args.seed)))
    db_path = str(work / "reddit.db")
    graph = await generate_reddit_agent_graph(profile_path=str(profile_path), model=model,
                                              available_actions=ActionType.get_default_reddit_actions())
    env = oasis.make(agent_graph=graph, platform=oasis.DefaultPlatformType.REDDIT, database_path=db_path)
    await env.reset()
    _, last_row = trace_rows(db_path, 0)
    agents = [agent for _, agent in env.agent_graph.get_agents()]
    seed = {agents[i % len(agents)]: ManualAction(action_type=ActionType.CREATE_POST, action_args={"content": text})
            for i, text in enumerate(SEED_POSTS)}
    await env.step(seed)
    _, last_row = trace_rows(db_path, last_row)
    steps = []
    for step in range(1, args.steps + 1):
        before, http_before, errors_before = server_counts(args.url), Counter(statuses.counts), errors.count
        started = time.perf_counter()
        await env.step({agent: LLMAction() for agent in agents})
        seconds = time.perf_counter() - started
        after = server_counts(args.url)
        rows, last_row = trace_rows(db_path, last_row)
        actions = Counter(action for _, action in rows if action not in ("refresh", "sign_up"))
        acted = {user for user, action in rows if action not in ("refresh", "sign_up")}
        by_agent: dict[str, list[str]] = {}
        for user, action in rows:
            if action not in ("refresh", "sign_up"):
                by_agent.setdefault(str(user), []).append(action)
        http = dict(statuses.counts - http_before)
        steps.append({"step": step, "seconds": seconds, "llm_calls": sum(http.values()), "http": http,
                      "failed_calls": sum(n for code, n in http.items() if code != "200"),
                      "agent_errors": errors.count - errors_before,
                      "actions": dict(actions), "agents_acted": len(acted),
                      "agents_without_action": len(agents) - len(acted), "agent_actions": by_agent,
                      "server": {k: after.get(k, 0) - before.get(k, 0) for k in after}})
        print(f"step {step}: {seconds:.1f} s, {steps[-1]['llm_calls']} calls ({http}), "
              f"{len(acted)}/{len(agents)} agents acted: {dict(actions)}", flush=True)
    await env.close()
    return {"url": args.url, "model": args.model, "agents": args.agents, "steps": steps,
            "tool_choice": args.tool_choice, "max_tokens": args.max_tokens}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the server's OpenAI base URL (…/v1)")
    parser.add_argument("--model", default=None, help="the served model (default: the server's first)")
    parser.add_argument("--agents", type=int, default=16)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--tool-choice", default="required", choices=("required", "auto"))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    if args.model is None:
        with urllib.request.urlopen(f"{args.url.rstrip('/')}/models", timeout=30) as response:
            args.model = json.loads(response.read())["data"][0]["id"]
    result = asyncio.run(simulate(args))
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
