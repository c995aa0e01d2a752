"""A small multi-agent simulation against `tokendance serve`, using only the official `openai` client.

Every round, each agent sees what every agent said in the previous round (an All-Gather) and
answers; the agents speak concurrently, one OpenAI chat request each. Run a server, then:

    tokendance serve &                        # http://127.0.0.1:8000/v1
    python examples/multi_agent_client.py --agents 4 --rounds 3
    python examples/multi_agent_client.py --transparent   # plain requests: the server forms the rounds

By default the requests declare their rounds (`agent_id`, `round_id`, `round_size` in
`extra_body`), so each round starts as soon as its last agent has spoken; with --transparent they
are ordinary chat requests and the server gathers them by the messages they share. Either way the
shared messages are computed once per round and stored once (see the printed /metrics lines).
"""

from __future__ import annotations

import argparse
import random
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

from openai import OpenAI

NAMES = ["Ada", "Bo", "Cy", "Di", "Eve", "Fay", "Gus", "Hal"]
TRADES = ["baker", "ferryman", "blacksmith", "teacher", "fisher", "weaver", "miller", "guard"]
OPENING = "The river has flooded the lower market overnight and the bridge is closed."


def persona(i: int) -> dict:
    return {"role": "system",
            "content": f"You are {NAMES[i]}, the village {TRADES[i]}. Speak in one or two short sentences."}


def prompt(i: int, history: list[list[str]]) -> list[dict]:
    """Persona, then for every past round all agents' lines (in this agent's own order), then the task."""
    messages = [persona(i), {"role": "user", "content": f"News: {OPENING}"}]
    order = random.Random(i)
    for lines in history:
        lines = list(lines)
        order.shuffle(lines)
        messages += [{"role": "user", "content": line} for line in lines]
    messages.append({"role": "user", "content": f"{NAMES[i]}, what do you say to the others now?"})
    return messages


def run(args: argparse.Namespace) -> None:
    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    session = uuid.uuid4().hex[:8]
    history: list[list[str]] = []
    for r in range(args.rounds):
        def speak(i: int) -> str:
            extra = {} if args.transparent else {
                "agent_id": f"{session}-{NAMES[i]}", "round_id": f"{session}-{r}", "round_size": args.agents}
            reply = client.chat.completions.create(
                model=model, messages=prompt(i, history), max_tokens=args.max_tokens,
                temperature=0, extra_body=extra)
            usage, text = reply.usage, reply.choices[0].message.content.strip()
            cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
            return f"  {NAMES[i]:>4} ({usage.prompt_tokens} prompt tokens, {cached} reused): {text}", text

        with ThreadPoolExecutor(args.agents) as pool:
            replies = list(pool.map(speak, range(args.agents)))
        print(f"round {r + 1}\n" + "\n".join(line for line, _ in replies))
        history.append([f"{NAMES[i]} says: {text}" for i, (_, text) in enumerate(replies)])
    show_metrics(args.base_url, args.api_key)


def show_metrics(base_url: str, api_key: str) -> None:
    root = base_url.rstrip("/").removesuffix("/v1")
    request = urllib.request.Request(f"{root}/metrics", headers={"Authorization": f"Bearer {api_key}"})
    text = urllib.request.urlopen(request).read().decode()
    wanted = ("tokendance_rounds_total", "tokendance_round_agents_sum", "tokendance_last_round_agents",
              "tokendance_round_shared_compression", "tokendance_round_kv_bytes_per_agent", "tokendance_agent_sessions")
    print("\n".join(line for line in text.splitlines() if line.startswith(wanted)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--api-key", default="none", help="the server's --api-key, if it has one")
    parser.add_argument("--model", default=None, help="default: the first model the server lists")
    parser.add_argument("--agents", type=int, default=4, choices=range(2, len(NAMES) + 1))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--transparent", action="store_true", help="send plain chat requests (no round fields)")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
