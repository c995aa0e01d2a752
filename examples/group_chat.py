"""A sequential group chat (AutoGen's RoundRobinGroupChat shape) against `tokendance serve`.

Speakers take turns: each one reads the whole transcript and adds one message, then the next one
speaks. Nothing runs concurrently, so there is no round to gather: what a group chat reuses is the
prefix cache. Each speaker's prompt is its persona followed by the transcript (`persona-first`,
what AutoGen sends), so a speaker's prompt extends its own previous one, but not the others';
with `--layout transcript-first` the transcript comes first and the persona last, so every
speaker's prompt extends the previous speaker's and nearly all of it is served from the cache.
Run a server, then:

    tokendance serve &
    python examples/group_chat.py --speakers 4 --turns 12
    python examples/group_chat.py --speakers 4 --turns 12 --layout transcript-first

It prints, per turn, the prompt tokens and how many were served from the cache. For rounds (every
agent answering the same round at once, an All-Gather) see examples/multi_agent_client.py.
"""

from __future__ import annotations

import argparse
import uuid

from openai import OpenAI

NAMES = ["Ada", "Bo", "Cy", "Di", "Eve", "Fay"]
ROLES = ["planner", "critic", "engineer", "tester", "writer", "reviewer"]
TASK = "Plan a small website for the village bakery: pages, content and who does what."


def messages(speaker: int, transcript: list[tuple[int, str]], layout: str) -> list[dict]:
    persona = {"role": "system" if layout == "persona-first" else "user",
               "content": f"You are {NAMES[speaker]}, the team's {ROLES[speaker]}. Answer in two sentences."}
    lines = [{"role": "user", "content": f"Task: {TASK}"}]
    lines += [{"role": "user", "content": f"{NAMES[who]}: {text}"} for who, text in transcript]
    return [persona, *lines] if layout == "persona-first" else [*lines, persona]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--speakers", type=int, default=4, choices=range(2, len(NAMES) + 1))
    parser.add_argument("--turns", type=int, default=12)
    parser.add_argument("--layout", default="persona-first", choices=["persona-first", "transcript-first"])
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    client = OpenAI(base_url=args.base_url, api_key="none")
    model = client.models.list().data[0].id
    salt = uuid.uuid4().hex  # a fresh cache namespace: runs do not reuse each other's KV
    transcript: list[tuple[int, str]] = []
    prompt_total = cached_total = 0
    for turn in range(args.turns):
        speaker = turn % args.speakers
        reply = client.chat.completions.create(model=model, messages=messages(speaker, transcript, args.layout),
                                               max_tokens=args.max_tokens, temperature=0,
                                               extra_body={"cache_salt": salt})
        text = (reply.choices[0].message.content or "").strip()
        transcript.append((speaker, text))
        usage = reply.usage
        cached = usage.prompt_tokens_details.cached_tokens
        prompt_total, cached_total = prompt_total + usage.prompt_tokens, cached_total + cached
        print(f"turn {turn + 1:>2} {NAMES[speaker]:<4} prompt {usage.prompt_tokens:>5} cached {cached:>5}  {text[:60]}")
    print(f"{args.layout}: {cached_total} of {prompt_total} prompt tokens served from the cache "
          f"({cached_total / prompt_total:.0%})")


if __name__ == "__main__":
    main()
