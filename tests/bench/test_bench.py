"""Simulations, the bench command's results and the capacity search, on the real model."""

from __future__ import annotations

import argparse
import json

from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import kv_bytes, salt
from tokendance.bench.capacity import find_max_agents, run_trial
from tokendance.bench.cli import add_bench_arguments
from tokendance.bench.rounds import run_rounds
from tokendance.bench.simulation import Simulation
from tokendance.workloads import make_workload

MODES = ("full", "prefix", "pic", "tokendance")


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_arguments(parser)
    return parser.parse_args(list(argv))


@settings(max_examples=200, deadline=None)
@given(threshold=st.integers(0, 80), low=st.integers(1, 5), high=st.integers(5, 70))
def test_capacity_search_finds_the_threshold(threshold, low, high):
    calls = []

    def fits(n: int) -> bool:
        calls.append(n)
        return n <= threshold

    best, tried = find_max_agents(fits, low, high)
    expected = 0 if threshold < low else min(threshold, high)
    assert best == expected
    assert len(calls) == len(set(calls)) == len(tried)  # never the same n twice
    assert len(calls) <= 2 * high.bit_length() + 2
    assert all(tried[n] == (n <= threshold) for n in tried)


def test_closed_loop_round_trip_in_every_mode(make_llm):
    workload = make_workload("debate", 3, seed=3)  # three agents: each reads the two others' replies
    engines = {mode: make_llm(reuse=mode, kv_cache_bytes=96 * 2**20) for mode in MODES}
    simulation = Simulation(workload, engines, closed_loop=True, max_tokens=6)
    for _ in range(2):
        simulation.step()
    rows = simulation.rows()
    assert sorted((r["mode"], r["round"]) for r in rows) == sorted((m, r) for m in MODES for r in (1, 2))
    for mode, trace in simulation.traces.items():
        assert len(trace.results) == 2 and all(len(h) == len(workload.agents) for h in trace.history)
        assert all(0 < o.num_generated_tokens <= 6 for result in trace.results for o in result.outputs)
        # closed loop: round 2's prompts hold what this mode's agents said in round 1 (its own
        # answer, and the others' under their names)
        said = trace.history[0]
        for agent, output in zip(workload.agents, trace.results[1].outputs):
            prompt = engines[mode].tokenizer.decode(output.prompt_token_ids)
            assert said[agent] in prompt, (mode, agent)
            assert all(f"{workload.names[o]}: {said[o]}" in prompt for o in workload.agents if o != agent), (mode, agent)
    full = [r for r in rows if r["mode"] == "full"]
    assert all(r["trace"]["identical_outputs"] == 1.0 for r in full)
    at = {(r["mode"], r["round"]): r for r in rows}
    assert at[("tokendance", 2)]["shared_compression"] > 1.0
    # less KV per token of context (closed loop: each mode's prompts differ in length)
    per_token = {m: at[(m, 2)]["kv_bytes"] / at[(m, 2)]["logical_kv_tokens"] for m in ("tokendance", "prefix")}
    assert per_token["tokendance"] < per_token["prefix"]


def test_bench_writes_every_field_the_plots_use(tmp_path, model_weights):
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    args = bench_args("--workload", "fact-recall", "--agents", "2", "--rounds", "2", "--modes", "prefix", "tokendance",
                      "--max-tokens", "3",
                      "--sweep-ratios", "0", "1", "--sweep-selections", "epic", "--sweep-agents", "2",
                      "--no-warm-up", "--out", str(out), "--plots", str(plots))  # fields, not times
    assert run_rounds(args) == 0
    results = json.loads(out.read_text())
    assert len(results["rounds"]) == 2 * 2
    for row in results["rounds"]:
        for key in ("agents", "round", "mode", "round_seconds", "prefill_seconds", "decode_seconds",
                    "kv_bytes_per_agent", "compression", "shared_compression", "computed_tokens", "prompt_tokens"):
            assert key in row, key
        assert row["computed_tokens"] <= row["prompt_tokens"]
    sweep = results["sweep"]
    assert {(r["ratio"], r["round"]) for r in sweep} == {(0.0, 1), (0.0, 2), (1.0, 1), (1.0, 2)}
    for row in sweep:
        assert {"top1_agreement", "mean_kl"} <= row["fidelity"].keys()
    # recomputing every token reproduces full prefill, the sweep's anchor point, up to rounding: in
    # bf16 (batches cut differently) an output may part from full's at a near tie, none further
    for row in (r for r in sweep if r["ratio"] == 1.0):
        assert row["fidelity"]["confident_divergences"] == 0 and row["fidelity"]["mean_kl"] < 0.005, row
    assert (plots / "fact-recall-scaling.png").stat().st_size > 0
    assert (plots / "fact-recall-fidelity.png").stat().st_size > 0


def test_capacity_trial_judges_memory(loaded_model):
    debate = ("capacity", "--workload", "debate", "--rounds", "2", "--max-tokens", "3", "--slo-seconds", "1e9",
              "--no-warm-up")
    roomy = bench_args(*debate, "--kv-cache-bytes", "256M")
    trial = run_trial(loaded_model, "tokendance", 2, roomy)
    assert trial.fits and trial.preemptions == 0 and trial.evictions == 0 and len(trial.round_seconds) == 2
    # two agents' round-2 prompts (~500 tokens each) cannot both stay resident in 300-600 tokens of KV
    tight = bench_args(*debate, "--kv-budget-mb", "14")
    for mode in ("prefix", "tokendance"):
        trial = run_trial(loaded_model, mode, 2, tight)
        assert not trial.fits and trial.reason != "fits", mode


def test_noise_floor_report_scores_every_setting_on_fulls_tokens(tmp_path, model_weights):
    """`--fidelity` alone: every setting teacher-forced on full's output, at the same positions,
    beside full in the other dtype (the floor, its own ratio 1), with the task's accuracy."""
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    args = bench_args("--fidelity", "--workload", "fact-recall", "--rounds", "1", "--modes", "prefix", "tokendance",
                      "--max-tokens", "4", "--no-warm-up",
                      "--sweep-ratios", "0", "--sweep-selections", "epic", "--sweep-agents", "2", "--out", str(out), "--plots", str(plots))
    assert run_rounds(args) == 0
    results = json.loads(out.read_text())
    assert "rounds" not in results and "sweep" not in results
    rows = {r["setting"]: r for r in results["fidelity"]["rows"]}
    floor = results["fidelity"]["floor"]
    assert set(rows) == {floor, "prefix", "tokendance", "epic@0", "tokendance@0.95", "balanced", "tokendance@1"}
    assert {r["preset"] for r in rows.values()} >= {"exact", "floor", "balanced", "fast"}
    assert rows[floor]["kl_mean_ratio"] == 1.0
    for row in rows.values():
        assert row["positions"] == 1 * 2 * 4  # rounds x agents x forced tokens
        assert row["kl_mean"] >= 0 and 0 <= row["top1_agreement"] <= 1 and row["ttft_speedup"] > 0
        assert row["flips_over_2_nats"] <= row["flips_over_half_nat"]
    assert rows["tokendance"]["shared_compression"] > 1 and rows["tokendance@1"]["shared_compression"] == 1
    for exact in ("prefix", "tokendance@1"):  # exact up to numeric noise: no confident flip
        assert rows[exact]["flips_over_half_nat"] == 0 and rows[exact]["top1_agreement"] >= 0.9
    assert 0 <= results["fidelity"]["reference_accuracy"] <= 1
    low, high = results["fidelity"]["reference_accuracy_ci"]
    assert low <= results["fidelity"]["reference_accuracy"] <= high
    for row in rows.values():  # graded against the workload's ground truth, and against full's answers
        assert 0 <= row["task_accuracy"] <= 1 and 0 <= row["changed_answers"] <= 1
        low, high = row["task_accuracy_ci"]
        assert low <= row["task_accuracy"] <= high and high - low > 0  # 2 answers: a wide interval
        assert 0 <= row["loop_fraction"] <= 1 and 0 < row["distinct_2"] <= 1
    assert (plots / "fact-recall-noise-floor.png").stat().st_size > 0


def test_capacity_search_drives_a_server(tmp_path, plain_server):
    """`bench capacity --target`: the same search against a real server, judged on the SLO."""
    from tokendance.bench.capacity import run_capacity

    for slo, expected in ((1000.0, 2), (0.0, 0)):
        out = tmp_path / f"capacity-{slo}.json"
        args = bench_args("capacity", "--target", plain_server.url + "/v1", "--workload", "fact-recall", "--rounds",
                          "2", "--max-tokens", "2", "--max-agents", "2", "--slo-seconds", str(slo), "--out", str(out))
        assert run_capacity(args) == 0
        (found,) = json.loads(out.read_text())["modes"].values()
        assert found["max_agents"] == expected
        trials = found["trials"]
        assert [t["agents"] for t in trials] == ([1, 2] if expected else [1])
        assert all(len(t["round_seconds"]) == 2 and t["fits"] == bool(expected) for t in trials)
        assert all(t["preemptions"] == t["evictions"] == t["extra_waves"] == 0 for t in trials)


def test_bench_drives_a_server_and_reads_its_kv(tmp_path, plain_server):
    """`bench --target`: rounds sent as concurrent streamed chats; the server's KV is read from
    its /metrics while each round runs (declared rounds keep sessions: round 2 starts with KV held)."""
    from tokendance.bench.target import run_target

    out = tmp_path / "target.json"
    args = bench_args("--target", plain_server.url + "/v1", "--workload", "fact-recall", "--agents", "2", "--rounds",
                      "2", "--max-tokens", "2", "--declare-rounds", "--cache-salt", salt(), "--out", str(out))
    assert run_target(args) == 0
    rows = json.loads(out.read_text())["rounds"]
    assert [(r["agents"], r["round"]) for r in rows] == [(2, 1), (2, 2)]
    assert all(r["completion_tokens"] == 4 and r["prompt_tokens"] > 0 for r in rows)
    assert rows[1]["cached_tokens"] > 0  # the agents' sessions
    # a reply's own decode lies inside the round, after the round's first token
    assert all(0 <= r["reply_decode_seconds"] <= r["round_seconds"] - r["first_token_seconds"] for r in rows)
    block_bytes = 16 * int(kv_bytes(1))
    assert rows[1]["kv_peak_bytes"] >= block_bytes and rows[1]["kv_peak_bytes"] % block_bytes == 0
    # the same plots as the in-process modes', one line per server (benchmarks/scaling_plot.py)
    from tokendance.bench import report
    from tokendance.bench.target import as_bench_rows

    server_rows = as_bench_rows(json.loads(out.read_text()), "server")
    means = report.steady_state(server_rows, 2)[(2, "server")]
    assert means["kv_bytes_per_agent"] == rows[1]["kv_peak_bytes"] / 2 and means["shared_compression"] is None
    report.plot_scaling(server_rows, tmp_path / "scaling.png", "a server")
    assert (tmp_path / "scaling.png").stat().st_size > 0


def test_capacity_search_against_a_server_sees_its_memory_run_out(tmp_path):
    """With a pool that holds one agent's round, two agents' declared round makes the server
    preempt, evict or split the round: its /metrics counters say so, and two do not fit."""
    from tests.helpers import serving
    from tokendance.bench.capacity import run_capacity

    server = next(serving("--gather-window-ms", "0", "--kv-cache-bytes", kv_bytes(12 * 16)))
    try:
        out = tmp_path / "capacity.json"
        args = bench_args("capacity", "--target", server.url + "/v1", "--workload", "fact-recall", "--rounds", "2",
                          "--max-agents", "2", "--slo-seconds", "1e9", "--declare-rounds", "--out", str(out))
        assert run_capacity(args) == 0
        assert server.metrics()["tokendance_agent_sessions"] == 0  # each trial ended its agents
    finally:
        server.stop()
    (found,) = json.loads(out.read_text())["modes"].values()
    one, two = found["trials"]
    assert found["max_agents"] == 1 and one["fits"] and not two["fits"]
    assert two["preemptions"] + two["evictions"] + two["extra_waves"] > 0 or "request failed" in two["reason"]
