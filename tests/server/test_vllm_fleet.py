"""`tokendance serve --engine vllm --replicas 2`: two real vLLM servers with the connector, each a
Ray Serve replica on one core, behind the round-aware router, as clients see it through the
official openai client:

- a round runs whole on one replica, or split into groups as its answer announces, each agent's
  reply that of exact computation (ratio 1.0, float32);
- declared chat rounds and agents' next turns stay on their replica; chat requests that name no
  round but share text meet on one;
- a restarted router rebuilds its placement from the replicas;
- an agent whose replica died is answered by another, exactly.

`slow` (`make test-slow`): about three minutes of `make test`'s budget where a second pytest worker
runs beside it (110 s to start the fleet, the model folder made on a fresh clone). `make test-slow`
names the vLLM environment (TOKENDANCE_VLLM_PYTHON); elsewhere the module runs where `.venv-vllm`
exists, and is skipped otherwise."""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("ray.serve", reason="the Ray Serve extra is not installed: pip install 'tokendance[ray]'")

from tests.helpers import Server, wait_until  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("TOKENDANCE_VLLM_PYTHON") or str(ROOT / ".venv-vllm" / "bin" / "python")
if not os.environ.get("TOKENDANCE_VLLM_PYTHON") and not Path(VLLM_PYTHON).exists():
    pytest.skip("no vLLM environment (make vllm)", allow_module_level=True)

pytestmark = [pytest.mark.ray, pytest.mark.slow]
MODEL = "smollm2"
MOST = 3  # --max-round-agents
TOKENS = 8
FEED = "Breaking on the village board: the old mill by the river burned down last night and nobody knows why."


@pytest.fixture(scope="module")
def fleet(model_weights):
    from tokendance.vllm_plugin.model_folder import default_model_folder

    folder = default_model_folder(ROOT / ".venv-vllm" / "smollm2-hf")
    s = Server("--engine", "vllm", "--replicas", "2", "--num-threads", "1", "--model", str(folder),
               "--served-model-name", MODEL, "--vllm-python", VLLM_PYTHON, "--dtype", "float32",
               "--vllm-arg=--enforce-eager", "--max-model-len", "4096", "--kv-cache-bytes", "1G",
               "--recompute-ratio", "1.0", "--max-round-agents", str(MOST), "--gather-window-ms", "2000",
               start_timeout_s=900)
    wait_until(lambda: len(listed(s)["data"]) == 2, timeout=300)
    yield s
    servers = [r["server_pid"] for r in listed(s)["data"]]
    s.stop()
    wait_until(lambda: not any(alive(pid) for pid in servers), timeout=90)  # no vLLM process left behind


def listed(s: Server) -> dict:
    return json.loads(s.request("GET", "/v1/replicas")[2])


def alive(server: int) -> bool:
    """Whether a process of a vLLM server's session (the server, its engine core) still runs."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[3]) == server and fields[0] != "Z":  # its session id, not a zombie
            return True
    return False


def persona(agent: str) -> dict:
    return {"role": "system", "content": f"You are {agent}, a villager who answers in one short sentence."}


def agents(names, question: str = "What do you do now?") -> list[dict]:
    return [{"agent_id": a, "messages": [persona(a), {"role": "user", "content": f"{FEED}\n{question}"}]}
            for a in names]


def chat(s: Server, messages, **extra) -> tuple[str, str, dict]:
    """(reply, replica that served it, headers)."""
    raw = s.client().chat.completions.with_raw_response.create(model=MODEL, messages=messages, temperature=0,
                                                                max_tokens=TOKENS, extra_body=extra)
    return raw.parse().choices[0].message.content, raw.headers["x-tokendance-replica"], dict(raw.headers)


def exact(s: Server, messages) -> str:
    """The reply computed from scratch: a cache salt no other request used."""
    return chat(s, messages, cache_salt=f"exact-{time.monotonic_ns()}")[0]


def test_a_round_runs_on_one_replica_or_split_in_groups_as_its_answer_says(fleet):
    small = agents(["ann", "bob", "cid"])
    status, headers, body = fleet.request("POST", "/v1/rounds", {"model": MODEL, "agents": small,
                                                                 "max_tokens": TOKENS, "temperature": 0})
    answer = json.loads(body)
    assert status == 200 and "split" not in answer and answer["round"]["num_agents"] == 3
    large = agents([f"v{i}" for i in range(5)])
    status, _, body = fleet.request("POST", "/v1/rounds", {"model": MODEL, "agents": large, "max_tokens": TOKENS,
                                                           "temperature": 0}, timeout=300)
    answer = json.loads(body)
    assert status == 200, answer
    groups = [s["agents"] for s in answer["split"]]  # new agents: each joins the group with the most room
    assert sorted(map(len, groups)) == [2, 3] and sorted(sum(groups, [])) == [a["agent_id"] for a in large]
    names = {r["replica"] for r in listed(fleet)["data"]}
    assert {s["replica"] for s in answer["split"]} == names  # the groups ran side by side
    assert [o["agent_id"] for o in answer["outputs"]] == [a["agent_id"] for a in large]
    assert answer["usage"]["completion_tokens"] == sum(o["usage"]["completion_tokens"] for o in answer["outputs"])
    for agent, output in zip(large, answer["outputs"]):
        assert output["message"]["content"] == exact(fleet, agent["messages"])


def test_declared_rounds_and_agents_next_turns_stay_on_their_replica(fleet):
    turns = agents(["dan", "eve", "fay"])
    with ThreadPoolExecutor(3) as pool:
        first = list(pool.map(lambda t: chat(fleet, t["messages"], agent_id=t["agent_id"], round_id="r1",
                                             round_size=3), turns))
    assert len({replica for _, replica, _ in first}) == 1
    home = first[0][1]
    heard = "\n".join(f"{t['agent_id']}: {reply}" for t, (reply, _, _) in zip(turns, first))
    nxt = [chat(fleet, [*t["messages"], {"role": "assistant", "content": reply}, {"role": "user", "content": heard}],
                agent_id=t["agent_id"]) for t, (reply, _, _) in zip(turns, first)]
    assert {replica for _, replica, _ in nxt} == {home}
    # a declared round larger than a replica takes: groups of at most MOST, each on one replica
    five = agents([f"w{i}" for i in range(5)])
    with ThreadPoolExecutor(5) as pool:
        replies = list(pool.map(lambda t: chat(fleet, t["messages"], agent_id=t["agent_id"], round_id="r2",
                                               round_size=5), five))
    groups: dict[str, set] = {}
    for _, replica, headers in replies:
        groups.setdefault(headers["x-tokendance-round-group"], set()).add(replica)
    assert sorted(groups) == ["0/2", "1/2"] and all(len(r) == 1 for r in groups.values())


def members(s: Server) -> float:
    """Chat requests the replicas' endpoints gathered into transparent rounds, over the fleet."""
    text = s.request("GET", "/metrics")[2].decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:tokendance_transparent_requests_total{") and 'outcome="member"' in line)


def test_requests_that_share_text_but_name_no_round_meet_on_one_replica(fleet):
    """Undeclared chat requests sharing a feed: held at the endpoint while another chat is there and
    sent to one replica together. There the first to arrive is alone at its endpoint and goes on
    alone, the others form a round; the next burst, right after, is held whole at both doors (the
    first of a burst after one that formed a round, `Door`), so all of it is one round."""
    people = ["gus", "hal", "ida"]  # at most MOST: one group
    prompts = [[persona(p), {"role": "user", "content": f"Morning, {p}. Your neighbour {q} says hello."},
                {"role": "user", "content": f"{FEED}\nWhat do you say?"}] for p, q in zip(people, people[1:] + people[:1])]
    clients = [fleet.client() for _ in prompts]

    def burst() -> tuple[set, float]:
        before, start = members(fleet), threading.Barrier(len(prompts))

        def send(i: int):
            start.wait()
            raw = clients[i].chat.completions.with_raw_response.create(model=MODEL, messages=prompts[i], temperature=0,
                                                                        max_tokens=TOKENS)
            return raw.headers["x-tokendance-replica"]

        with ThreadPoolExecutor(len(prompts)) as pool:
            replicas = set(pool.map(send, range(len(prompts))))
        return replicas, members(fleet) - before

    busy = threading.Thread(target=lambda: fleet.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me a long story about a river."}], max_tokens=96))
    busy.start()
    time.sleep(0.5)  # another chat request at the endpoint: these are held and gathered
    first, gathered = burst()
    busy.join()
    assert len(first) == 1 and gathered >= len(prompts) - 1, (first, gathered)
    second, gathered = burst()  # nothing else at the endpoint now
    assert second == first and gathered == len(prompts)
    metrics = fleet.request("GET", "/metrics")[2].decode()
    assert set(re.findall(r'replica="([^"]+)"', metrics)) == {r["replica"] for r in listed(fleet)["data"]}


def test_a_restarted_router_finds_every_agent_on_its_replica(fleet):
    turns = agents(["kim", "lou", "max", "ned", "oda", "pia"])
    homes = {}
    for group in (turns[:3], turns[3:]):  # two declared rounds: the second on the other replica
        with ThreadPoolExecutor(3) as pool:
            done = list(pool.map(lambda t: chat(fleet, t["messages"], agent_id=t["agent_id"],
                                                round_id=f"restart-{group[0]['agent_id']}", round_size=3), group))
        homes.update({t["agent_id"]: replica for t, (_, replica, _) in zip(group, done)})
    router = listed(fleet)["router"]["pid"]
    os.kill(router, signal.SIGKILL)

    def restarted() -> bool:
        try:
            return listed(fleet)["router"]["pid"] != router
        except (OSError, ValueError, KeyError):
            return False

    wait_until(restarted, timeout=120)
    assert listed(fleet)["router"]["restored_keys"] >= len(turns)
    for t in turns:
        assert chat(fleet, t["messages"], agent_id=t["agent_id"])[1] == homes[t["agent_id"]]


def test_an_agent_whose_replica_died_is_answered_exactly_by_another(fleet):
    turn = agents(["quinn"])[0]
    _, home, _ = chat(fleet, turn["messages"], agent_id="quinn")
    server = next(r["server_pid"] for r in listed(fleet)["data"] if r["replica"] == home)
    os.killpg(server, signal.SIGKILL)  # the server and its engine core
    follow = [*turn["messages"], {"role": "user", "content": "And then?"}]
    reply, replica, _ = chat(fleet, follow, agent_id="quinn")
    assert replica != home
    assert reply == exact(fleet, follow)
