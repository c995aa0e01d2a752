"""What holding costs a chat request at the vLLM plugin's endpoint with transparent rounds (the
`shared` rule): time to first token through vLLM + plugin with `transparent_rounds` off, then on,
one server after the other, the same requests to both:

- lone: unrelated chat requests one at a time, no round formed before them. Each is alone at the
  endpoint: never held.
- busy: the same kind of requests one at a time while another chat decodes (a long streamed reply).
  Each is held, shares nothing, and goes on alone a gather window after it came.
- burst: N agents' chats sharing a feed the server never wrote, sent together, nothing else in
  flight, 1 s apart. The first burst's first request goes on at once (no round formed before it),
  later bursts' first requests are held with the rest (`Door`: within 5 s of a burst that formed a
  round); the others wait for the gathering to close and form a round (their TTFT also holds what
  the round saves).
- after: lone requests one at a time right after the last burst (within 5 s): each held one gather
  window, as the first request of a step would be, and sent alone.

    python benchmarks/transparent_hold.py --samples 40 --agents 16 --repeat 2

Needs .venv-vllm (`make vllm`). Prints p50 / p99 TTFT per scenario and server, what the gathering
did (the endpoint's counters), and what holding added; writes benchmarks/results/transparent_hold.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.servers import ROOT, serving  # noqa: E402

from tokendance.bench.target import Client  # noqa: E402
from tokendance.model.platform import probe_cpu  # noqa: E402
from tokendance.registry import DEFAULT_RECOMPUTE_RATIO  # noqa: E402

SERVERS = {"vllm+tokendance": "transparent off", "vllm+transparent": "transparent on"}
THINGS = ("fruit", "river", "city", "bird", "tree", "metal", "planet", "dance", "tool", "colour", "insect", "cheese")
TOPICS = ("the bridge repairs", "the winter festival", "the new bakery", "the library's hours", "the lost cat",
          "the harbour cleanup", "the school play", "the night market", "the bus timetable", "the park benches",
          "the choir rehearsal", "the flooded cellar")
OUTCOMES = ("passed", "member", "alone", "rounds")


def unrelated(i: int) -> list[dict]:
    """A short chat sharing nothing with any other (a different question each time)."""
    return [{"role": "user", "content": f"Question {i}: name one {THINGS[i % len(THINGS)]} whose name starts with "
                                        f"the letter {chr(65 + i * 7 % 26)}. One word."}]


def burst(rep: int, agents: int, lines: int) -> list[list[dict]]:
    """Each agent's prompt: its persona, then the same feed of `lines` posts (which no server wrote)
    in an order of its own, then its task."""
    feed = [f"Post {rep}.{j} by user_{(j * 37 + rep) % 101}: I think {TOPICS[j % len(TOPICS)]} matters more than "
            f"anything else this week, and the council should decide on it before day {j + 2}." for j in range(lines)]
    prompts = []
    for i in range(agents):
        order = feed[i % len(feed):] + feed[:i % len(feed)]
        prompts.append([{"role": "system", "content": f"You are agent {i}, a resident of Willow Creek who "
                                                      f"likes {THINGS[i % len(THINGS)]}s."},
                        {"role": "user", "content": "Your feed:\n" + "\n".join(order) +
                                                    "\nWrite a one-sentence reply to one post."}])
    return prompts


class Decoding:
    """A long streamed chat decoding on a thread while the block runs (the endpoint is busy); its
    client leaves at the end."""

    def __init__(self, client: Client):
        self.client, self.started, self.stop = client, threading.Event(), threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {"model": self.client.model, "messages": [{"role": "user", "content": "Tell a very long story."}],
                "max_tokens": 3500, "ignore_eos": True, "temperature": 0, "stream": True}
        with self.client._request("/chat/completions", body) as response:
            for line in response:
                if line.startswith(b"data: "):
                    self.started.set()
                if self.stop.is_set():
                    break
        self.started.set()

    def __enter__(self) -> "Decoding":
        self.thread.start()
        self.started.wait(120)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(120)


def counters(client: Client) -> dict[str, float]:
    found = dict.fromkeys(OUTCOMES, 0.0)
    for name, labels, value in client.metrics() or []:
        if name == "vllm:tokendance_transparent_requests_total":
            found[labels.split('"')[1]] = found.get(labels.split('"')[1], 0.0) + value
    return found


def measure(name: str, args) -> dict:
    """Every scenario's TTFTs (seconds) on a fresh server `name`, and the endpoint's counters."""
    with serving(name, args) as port:
        client = Client(f"http://127.0.0.1:{port}/v1", "unused", None)
        for i in range(3):  # warm up
            client.chat(unrelated(10_000 + i), 2, {})
        result = {}

        def run(scenario: str, send) -> None:
            before = counters(client)
            ttfts = send()
            after = counters(client)
            result[scenario] = {"ttft": ttfts, "counts": {k: after[k] - before[k] for k in OUTCOMES}}

        def one_at_a_time(start: int) -> list[float]:
            return [(lambda r: r.first_token - r.submitted)(client.chat(unrelated(start + i), 2, {}))
                    for i in range(args.samples)]

        def bursts() -> list[float]:
            ttfts = []
            for rep in range(args.bursts):
                time.sleep(1.0)  # nothing else in flight: the last scenario's long chat has left
                with ThreadPoolExecutor(args.agents) as pool:
                    replies = list(pool.map(lambda m: client.chat(m, 8, {}), burst(rep, args.agents, args.feed_lines)))
                ttfts += [r.first_token - r.submitted for r in replies]
            return ttfts

        run("lone", lambda: one_at_a_time(0))

        def busy() -> list[float]:
            with Decoding(client):
                return one_at_a_time(args.samples)
        run("busy", busy)
        run("burst", bursts)
        run("after", lambda: one_at_a_time(2 * args.samples))
        return result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=40, help="requests per one-at-a-time scenario")
    parser.add_argument("--agents", type=int, default=16, help="requests per burst")
    parser.add_argument("--bursts", type=int, default=3)
    parser.add_argument("--feed-lines", type=int, default=24, help="posts in a burst's shared feed (~30 tokens each)")
    parser.add_argument("--dtype", default=None, help="bfloat16 where the CPU has native bf16, else float32")
    parser.add_argument("--kv-gib", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="run the pair of servers this many times, one after the "
                                                               "other (off, on, off, on, ...): samples pooled")
    args = parser.parse_args()
    cpu = probe_cpu()
    args.dtype = args.dtype or ("bfloat16" if cpu.native_bf16 else "float32")
    args.ratio, args.store_gib = DEFAULT_RECOMPUTE_RATIO, 0  # the connector's defaults, as `serving` reads them
    results: dict = {}
    for _ in range(args.repeat):
        for name in SERVERS:
            for scenario, found in measure(name, args).items():
                pooled = results.setdefault(name, {}).setdefault(scenario, {"ttft": [], "counts": {}})
                pooled["ttft"] += found["ttft"]
                for outcome, count in found["counts"].items():
                    pooled["counts"][outcome] = pooled["counts"].get(outcome, 0) + count
    off, on = (results[name] for name in SERVERS)
    print(f"\nTTFT in ms, {args.dtype}, CPU {cpu.capability}; gather window 0.05 s (the connector's default)")
    print(f"{'scenario':<10}{'off p50':>9}{'off p99':>9}{'on p50':>9}{'on p99':>9}{'added p50':>11}{'added p99':>11}"
          f"   endpoint (on)")
    for scenario in on:
        a, b = off[scenario]["ttft"], on[scenario]["ttft"]
        row = [percentile(a, 0.5), percentile(a, 0.99), percentile(b, 0.5), percentile(b, 0.99)]
        counts = ", ".join(f"{k} {v:.0f}" for k, v in on[scenario]["counts"].items() if v)
        print(f"{scenario:<10}" + "".join(f"{v * 1e3:>9.1f}" for v in row)
              + f"{(row[2] - row[0]) * 1e3:>11.1f}{(row[3] - row[1]) * 1e3:>11.1f}   {counts}")
    out = ROOT / "benchmarks" / "results" / "transparent_hold.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"cpu": cpu.capability, "dtype": args.dtype, "samples": args.samples,
                               "agents": args.agents, "bursts": args.bursts, "repeat": args.repeat,
                               "servers": results}, indent=2))
    print(f"results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
