"""`--fidelity auto` in the engine: a probe per sharing round, its member computed exactly, a planted
fault caught within one round, and nothing of the probe left behind."""

from __future__ import annotations

from tokendance.kv.manager import SessionKey
from tokendance.reuse.collector import KVCollector
from tokendance.reuse.round_kv import RoundKV
from tokendance.reuse.selection import make_selector
from tokendance.sampling import SamplingParams
from tokendance.workloads import make_workload

PARAMS = SamplingParams(temperature=0, max_tokens=24)


class CollapsedMirrors(KVCollector):
    """A planted fault: every reused span reads its first token's KV at all its positions."""

    def finish(self, agent):
        super().finish(agent)
        slots = self.round_kv.kv.tables[agent.table_id].slots
        for index in agent.reused_spans:
            span = agent.turn.spans[index]
            slots[span.start:span.end] = [slots[span.start]] * (span.end - span.start)


def run(llm, workload, rounds):
    history, results = [], []
    for r in range(rounds):
        result = llm.run_round(workload.turns(r, history), PARAMS)
        history.append({o.agent_id: o.text for o in result.outputs})
        results.append(result)
    return results


def test_the_probed_member_gets_the_exact_reply_and_the_probe_leaves_nothing(make_llm):
    workload = make_workload("generative-agents", 4, seed=1)
    auto = make_llm(fidelity="auto", batch_invariant=True)
    exact = make_llm(fidelity="exact", batch_invariant=True)
    first = auto.run_round(workload.turns(0, []), PARAMS)
    step = first.stats.fidelity
    assert step["setting"] == "fast" and step["skipped"] is None and step["reading"]["positions"] > 0
    assert 0 <= step["reading"]["kl"] and 0 <= step["reading"]["agreement"] <= 1 and step["probe_tokens"] > 0
    probed = step["reading"]["agent_id"]
    expected = {o.agent_id: o.token_ids for o in exact.run_round(workload.turns(0, []), PARAMS).outputs}
    got = {o.agent_id: o.token_ids for o in first.outputs}
    assert got[probed] == expected[probed]
    second = auto.run_round(workload.turns(1, [{o.agent_id: o.text for o in first.outputs}]), PARAMS)
    assert second.stats.fidelity["reading"]["agent_id"] != probed  # every agent in turn
    # nothing but the agents' sessions holds KV: no shadow, no scoring table
    assert set(auto.engine.kv.tables) == {SessionKey(a) for a in workload.agents}


def test_a_planted_fault_is_caught_within_one_round_and_moves_toward_exact(make_llm):
    workload = make_workload("generative-agents", 4, seed=1)
    llm = make_llm(fidelity="auto", fidelity_ladder=("fast", "exact"))
    engine, config = llm.engine, llm.engine.config
    round_kv = RoundKV(engine.kv, engine.runner, make_selector("epic", 0.05), config.check_layer)
    llm.rounds.ladder["fast"] = CollapsedMirrors(round_kv, 1, "neutral")
    results = run(llm, workload, 3)
    steps = [r.stats.fidelity for r in results]
    assert steps[1]["breach"] and steps[1]["move"] == "fast -> exact"  # round 2: the first with others' replies
    assert steps[2]["setting"] == "exact" and steps[2]["reading"] is None and results[2].stats.mode == "prefix"


def test_a_probed_member_that_leaves_ends_its_probe_and_the_round(make_llm):
    workload = make_workload("generative-agents", 4, seed=1)
    llm = make_llm(fidelity="auto")
    for steps_before_leaving in (0, 3):  # before its wave starts, and while it runs
        job = llm.rounds.submit(workload.turns(0, []), PARAMS)
        probed = job.probe.exact.agent_id
        for _ in range(steps_before_leaving):
            llm.engine.step()
        llm.rounds.abort(probed, job)
        while not job.done:
            llm.engine.step()
        result = llm.rounds.collect(job)
        assert result.stats.fidelity["reading"] is None and result.stats.fidelity["skipped"]
        assert next(o for o in result.outputs if o.agent_id == probed).finish_reason == "abort"
        assert not [t for t in llm.engine.kv.tables if not isinstance(t, SessionKey)]
