"""`tokendance serve --replicas 2` on Ray Serve, as clients see it: two simulations at once, each
round's agents on one replica (from the `x-tokendance-replica` header and the merged /metrics),
answers equal to a single engine's, a replica killed mid-round (every client gets an answer
or a clear 503, and the endpoint keeps serving), and a fleet stopped by SIGTERM to its whole process
group leaving none of its processes running."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray.serve", reason="the Ray Serve extra is not installed: pip install 'tokendance[ray]'")

from tests.helpers import Server, disconnect, kv_bytes, long_chat, open_stream, wait_until  # noqa: E402
from tokendance import AgentTurn, SamplingParams  # noqa: E402
from tokendance.server.fleet.supervise import alive, descendants  # noqa: E402

pytestmark = pytest.mark.ray
AGENTS = 4
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def replicas(model_weights):
    s = Server("--replicas", "2", "--num-threads", "1", "--gather-window-ms", "0", "--dtype", "float32",
               "--kv-cache-bytes", kv_bytes(8192), "--round-timeout-ms", "5000", new_session=True)
    deadline = time.monotonic() + 300  # Ray says the app is ready before its router knows every replica
    while len(json.loads(s.request("GET", "/v1/replicas")[2])["data"]) < 2:
        assert time.monotonic() < deadline, s.output()
        time.sleep(0.5)
    yield s
    s.stop()


def messages(sim: str, agent: int, history: list[str]) -> list[dict]:
    persona = {"role": "system", "content": f"You are {sim} villager {agent}, who keeps {['goats', 'bees', 'hens', 'cows'][agent]}."}
    heard = [{"role": "user", "content": line} for line in history]
    return [persona, *heard, {"role": "user", "content": f"Villager {agent}, what do you do next?"}]


def turn(server: Server, sim: str, round_index: int, agent: int, history: list[str], max_tokens=MAX_TOKENS):
    """One agent's turn of a declared round: (answer, replica that served it)."""
    client = server.client()
    raw = client.chat.completions.with_raw_response.create(
        model=server.model, messages=messages(sim, agent, history), temperature=0, max_tokens=max_tokens,
        extra_body={"cache_salt": sim, "agent_id": f"agent{agent}", "round_id": f"{sim}-{round_index}",
                    "round_size": AGENTS})
    return raw.parse().choices[0].message.content, raw.headers["x-tokendance-replica"]


def simulation(server: Server, sim: str, rounds: int) -> list[list[tuple[str, str]]]:
    history, results = [], []
    with ThreadPoolExecutor(AGENTS) as pool:
        for r in range(rounds):
            answers = list(pool.map(lambda a: turn(server, sim, r, a, history), range(AGENTS)))
            results.append(answers)
            history = [f"Villager {a} says: {text}" for a, (text, _) in enumerate(answers)]
    return results


def test_rounds_and_sessions_stay_on_one_replica_and_answer_as_one_engine(replicas, make_llm):
    runs = {}
    threads = [threading.Thread(target=lambda s=s: runs.__setitem__(s, simulation(replicas, s, 2))) for s in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    homes = {}
    for sim, rounds in runs.items():
        served = {replica for answers in rounds for _, replica in answers}
        assert len(served) == 1, f"simulation {sim} was split over {served}"  # both rounds, every agent
        homes[sim] = served.pop()
    assert homes["a"] != homes["b"]  # independent simulations spread over the replicas
    metrics = replicas.metrics()
    for home in homes.values():
        assert metrics[f'tokendance_rounds_total{{source="declared",replica="{home}"}}'] == 2
        assert metrics[f'tokendance_round_agents_sum{{replica="{home}"}}'] == 2 * AGENTS  # no round split
    # the second round reused its agents' sessions on their replica
    assert metrics[f'tokendance_cached_prompt_tokens_total{{replica="{homes["a"]}"}}'] > 0
    # a single engine (float32, one thread, as each replica) says the same
    torch_threads = __import__("torch").get_num_threads()
    try:
        llm = make_llm(dtype="float32", reuse="tokendance", num_threads=1)
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
        history = []
        for answers in runs["a"]:
            expected = llm.run_round([AgentTurn(f"agent{a}", messages("a", a, history)) for a in range(AGENTS)], params)
            assert [o.text for o in expected.outputs] == [text for text, _ in answers]
            history = [f"Villager {a} says: {text}" for a, (text, _) in enumerate(answers)]
    finally:
        __import__("torch").set_num_threads(torch_threads)


def test_a_client_that_leaves_aborts_its_request_on_the_replica(replicas):
    def aborted() -> float:
        return sum(v for k, v in replicas.metrics().items()
                   if k.startswith('tokendance_requests_finished_total{finish_reason="abort"'))

    before = aborted()
    connection = open_stream(replicas, long_chat(replicas.model), events=3)
    disconnect(connection)
    wait_until(lambda: aborted() == before + 1, timeout=60)
    wait_until(lambda: sum(v for k, v in replicas.metrics().items()
                           if k.startswith("tokendance_engine_running_requests")) == 0, timeout=60)


def test_a_non_finite_number_anywhere_in_a_body_is_refused_by_name_at_the_endpoint(replicas):
    """Python's JSON parser takes NaN and Infinity, JSON has no such numbers: the endpoint answers
    400 naming the field, and never forwards the body (a replica's vLLM could leave it unanswered)."""
    chat = {"model": replicas.model, "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    for raw, field in (('"guided_json": {"type": "number", "maximum": NaN}', "guided_json.maximum"),
                       ('"logit_bias": {"42": -Infinity}', "logit_bias.42"),
                       ('"messages": [{"role": "user", "content": "Hi", "weight": Infinity}]', "messages.0.weight")):
        body = {k: v for k, v in chat.items() if k != raw.split('"')[1]}
        status, _, answer = replicas.request("POST", "/v1/chat/completions", json.dumps(body)[:-1].encode() + b", " + raw.encode() + b"}")
        error = json.loads(answer)["error"]
        assert status == 400 and error["param"] == field and "NaN and Infinity" in error["message"], answer
    status, _, _ = replicas.request("POST", "/v1/chat/completions", chat)
    assert status == 200  # the endpoint serves on


@pytest.mark.slow  # ~40 s of killing and Ray's restart (make test-slow)
def test_a_replica_killed_mid_round_fails_nobody_silently(replicas):
    listed = json.loads(replicas.request("GET", "/v1/replicas")[2])["data"]
    assert len(listed) == 2 and all(r["healthy"] for r in listed)
    pids = {r["replica"]: r["pid"] for r in listed}
    outcomes = []

    def agent(a: int) -> None:
        try:
            outcomes.append(("ok", *turn(replicas, "kill", 0, a, [], max_tokens=48)))
        except Exception as exc:  # noqa: BLE001 - the test sorts what came back
            outcomes.append(("error", getattr(exc, "status_code", None), str(exc)[:200]))

    threads = [threading.Thread(target=agent, args=(a,)) for a in range(AGENTS)]
    for t in threads:
        t.start()
    time.sleep(2.0)  # the round is running on its replica
    home = _home_of(replicas, "kill")
    os.kill(pids[home], signal.SIGKILL)
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "a client hung"
    assert len(outcomes) == AGENTS
    for outcome in outcomes:  # an answer (retried on the other replica) or a clear 503
        assert outcome[0] == "ok" or outcome[1] == 503, outcome
    assert any(o[0] == "ok" for o in outcomes) or all(o[1] == 503 for o in outcomes)
    # the endpoint keeps serving, and Ray brings the replica back
    reply = replicas.client().chat.completions.create(model=replicas.model, max_tokens=4, temperature=0,
                                                      messages=[{"role": "user", "content": "hello"}])
    assert reply.choices[0].finish_reason in ("stop", "length")
    deadline = time.monotonic() + 240
    while True:
        listed = json.loads(replicas.request("GET", "/v1/replicas")[2])["data"]
        if len(listed) == 2 and pids[home] not in {r["pid"] for r in listed}:
            break
        assert time.monotonic() < deadline, f"the killed replica was not restarted: {listed}"
        time.sleep(2)


def _home_of(server: Server, sim: str) -> str:
    """The replica running the round of `sim` (the one with requests in flight)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        metrics = server.metrics()
        for key, value in metrics.items():
            if key.startswith("tokendance_requests_in_flight{") and value > 0:
                return key.split('replica="')[1].split('"')[0]
        time.sleep(0.2)
    raise AssertionError("no replica ran the round")


def test_a_vllm_fleet_refuses_a_kv_cache_vllm_cpu_cannot_size_before_starting_ray():
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "tokendance.cli", "serve", "--engine", "vllm", "--port", "0",
                           "--kv-cache-bytes", "512M"], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "whole GiB" in done.stderr and "0.50 GiB" in done.stderr, done.stderr


def test_sigterm_to_the_fleets_process_group_leaves_none_of_its_processes(replicas):
    """Last in the module: it stops the fleet. A signal to the whole group also stops Ray's own
    daemons at once (the raylet, the GCS), whose replicas then have init as their parent; the
    fleet still finds and stops every one within 30 s."""
    started = descendants(replicas.process.pid)
    replica_pids = [r["pid"] for r in json.loads(replicas.request("GET", "/v1/replicas")[2])["data"]]
    assert set(replica_pids) <= set(started) and len(started) >= 4, started
    os.killpg(replicas.process.pid, signal.SIGTERM)
    assert replicas.process.wait(timeout=30) == 0, replicas.output()
    wait_until(lambda: not any(alive(pid) for pid in started), timeout=30)
