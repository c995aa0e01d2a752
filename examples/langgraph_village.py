"""A LangGraph multi-agent graph against `tokendance serve`, unmodified framework code: tool
calling (`bind_tools`) and structured output (`with_structured_output`) through `ChatOpenAI`.

Each round, a reporter node calls a weather tool (forced tool choice) and the result goes into
the shared news; then the graph fans out to every villager, each of whom sees the news and all
that every villager said in the previous round, and answers with a typed `Turn` (what it says and
does). The villagers' requests run concurrently, so the server forms them into one round and
computes the messages they share once. At the end the script prints the share of prompt tokens
the server served from cache (the `/metrics` counters before and after).

    pip install langgraph langchain-openai      # not dependencies of tokendance
    tokendance serve &                          # http://127.0.0.1:8000/v1
    python examples/langgraph_village.py --agents 6 --rounds 3
"""

from __future__ import annotations

import argparse
import operator
import urllib.request
from typing import Annotated, Literal, TypedDict

from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import END, START, StateGraph
from langgraph.types import Send
from pydantic import BaseModel, Field

NAMES = ["Ada", "Bo", "Cy", "Di", "Eve", "Fay", "Gus", "Hal"]
TRADES = ["baker", "ferryman", "blacksmith", "teacher", "fisher", "weaver", "miller", "guard"]


class Turn(BaseModel):
    """What a villager says and does this round."""

    say: str = Field(description="one or two short sentences", max_length=200)
    action: Literal["talk", "work", "walk", "rest", "trade"]


@tool
def weather(town: str) -> str:
    """Today's weather in a town."""
    return f"Heavy rain over {town} since dawn; the river is rising."


class Village(TypedDict):
    round: int
    news: Annotated[list[str], operator.add]
    said: Annotated[list[dict], operator.add]  # {"round", "name", "say", "action"}


def build(llm: ChatOpenAI, num_agents: int, num_rounds: int):
    reporter = llm.bind_tools([weather], tool_choice="weather")
    speaker = llm.with_structured_output(Turn)

    def report(state: Village) -> dict:
        question = [HumanMessage(f"Round {state['round'] + 1}: report today's weather in Millbrook.")]
        call = reporter.invoke(question).tool_calls[0]
        return {"news": [ToolMessage(weather.invoke(call["args"]), tool_call_id=call["id"]).content]}

    def fan_out(state: Village) -> list[Send]:
        return [Send("villager", {**state, "me": i}) for i in range(num_agents)]

    def villager(state: dict) -> dict:
        me, current = state["me"], state["round"]
        heard = [f"{s['name']} ({s['action']}): {s['say']}" for s in state["said"] if s["round"] == current - 1]
        messages = [SystemMessage(f"You are {NAMES[me]}, the village {TRADES[me]} of Millbrook."),
                    HumanMessage("News: " + " ".join(state["news"])),
                    *(HumanMessage(line) for line in heard),
                    HumanMessage(f"What do you, {NAMES[me]}, say and do now?")]
        turn = speaker.invoke(messages)
        return {"said": [{"round": current, "name": NAMES[me], "say": turn.say, "action": turn.action}]}

    def next_round(state: Village) -> dict:
        return {"round": state["round"] + 1}

    def more(state: Village) -> str:
        return "report" if state["round"] < num_rounds else END

    graph = StateGraph(Village)
    graph.add_node("report", report)
    graph.add_node("villager", villager)
    graph.add_node("next_round", next_round)
    graph.add_edge(START, "report")
    graph.add_conditional_edges("report", fan_out, ["villager"])
    graph.add_edge("villager", "next_round")
    graph.add_conditional_edges("next_round", more, ["report", END])
    return graph.compile()


def counters(base_url: str) -> dict[str, float]:
    """/metrics, each metric summed over its labels."""
    text = urllib.request.urlopen(base_url.removesuffix("/v1") + "/metrics").read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]
            totals[name] = totals.get(name, 0.0) + float(value)
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--agents", type=int, default=6, choices=range(1, len(NAMES) + 1))
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    llm = ChatOpenAI(base_url=args.base_url, api_key="none", model="default", temperature=0, max_tokens=120)
    llm.model_name = urllib.request.urlopen(args.base_url + "/models").read().decode().split('"id":"')[1].split('"')[0]
    before = counters(args.base_url)
    final = build(llm, args.agents, args.rounds).invoke({"round": 0, "news": [], "said": []},
                                                        {"max_concurrency": args.agents})
    after = counters(args.base_url)
    for s in final["said"]:
        print(f"round {s['round'] + 1} {s['name']:>4} [{s['action']}] {s['say']}")
    prompt = after["tokendance_prompt_tokens_total"] - before["tokendance_prompt_tokens_total"]
    cached = after["tokendance_cached_prompt_tokens_total"] - before["tokendance_cached_prompt_tokens_total"]
    rounds = after.get("tokendance_rounds_total", 0) - before.get("tokendance_rounds_total", 0)
    print(f"{len(final['said'])} typed turns; prompt tokens {prompt:.0f}, served from cache or shared KV "
          f"{cached:.0f} ({100 * cached / max(1, prompt):.0f}%); rounds formed by the server: {rounds:.0f}")


if __name__ == "__main__":
    main()
