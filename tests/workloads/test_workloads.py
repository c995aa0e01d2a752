"""Workload generators: deterministic, the stated lengths, the All-Gather segment structure."""

from __future__ import annotations

import random
import statistics

import pytest

from tokendance.errors import InvalidRequestError
from tokendance.reuse.segments import tokenize_round
from tokendance.workloads import WORKLOADS, make_workload


def synthetic_history(workload, rounds: int) -> list[dict[str, str]]:
    return [workload.synthetic_outputs(r) for r in range(rounds)]


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_deterministic_by_seed(name):
    a, b, c = (make_workload(name, 4, seed=s) for s in (1, 1, 2))
    turns = [w.turns(2, synthetic_history(w, 2)) for w in (a, b, c)]
    assert [t.messages for t in turns[0]] == [t.messages for t in turns[1]]
    assert [t.messages for t in turns[0]] != [t.messages for t in turns[2]]
    assert a.synthetic_outputs(3) == b.synthetic_outputs(3)


def shared_texts(tokenizer, tokenized) -> list[str]:
    return [tokenizer.decode(tokenized.token_ids[s.start:s.end]) for s in tokenized.shared_spans]


def lengths(tokenizer, texts) -> list[int]:
    return [len(tokenizer.encode(t)) for t in texts]


def test_generative_agents_lengths_and_structure(tokenizer):
    w = make_workload("generative-agents", 12, seed=0)
    personas = lengths(tokenizer, w.personas.values())
    assert 120 <= statistics.median(personas) <= 220
    memories = [w.memories(a, r) for a in w.agents for r in range(4)]
    assert all(30 <= len(m) <= 45 for m in memories)
    assert 300 <= statistics.median(lengths(tokenizer, ["\n".join(m) for m in memories])) <= 550
    # about 30% of the memory lines change from one round to the next
    kept = [len(set(w.memories(a, 1)) & set(w.memories(a, 0))) / len(w.memories(a, 0)) for a in w.agents]
    assert 0.6 <= statistics.mean(kept) <= 0.8
    utterances = lengths(tokenizer, [w.synthetic_output(a, r) for a in w.agents for r in range(8)])
    assert 18 <= statistics.median(utterances) <= 36 and max(utterances) <= 90
    assert 55 <= statistics.median(lengths(tokenizer, [w.instruction(a, 0) for a in w.agents])) <= 85
    assert all(30 <= w.output_tokens(a, r) <= 60 for a in w.agents for r in range(5))

    history = synthetic_history(w, 1)
    turns = w.turns(1, history)
    for tok in tokenize_round(tokenizer, turns):
        # every agent's last utterance is a shared span of every prompt
        shared = shared_texts(tokenizer, tok)
        assert all(any(f"{w.names[a]}: {history[0][a]}" in text for text in shared) for a in w.agents)
    # per-agent shuffled order: not every agent sees the utterances in the same order
    orders = {tuple(m["content"] for m in t.messages[2:-1]) for t in turns}
    assert len(orders) > 1


def test_agent_society_structure(tokenizer):
    w = make_workload("agent-society", 10, seed=0)
    assert 180 <= statistics.median(lengths(tokenizer, w.profiles.values())) <= 260
    assert 30 <= statistics.median(lengths(tokenizer, [w.environment(r) for r in range(5)])) <= 50
    posts = lengths(tokenizer, [w.synthetic_output(a, r) for a in w.agents for r in range(5)])
    assert 14 <= statistics.median(posts) <= 30
    history = synthetic_history(w, 3)
    rounds = [tokenize_round(tokenizer, w.turns(r, history)) for r in range(3)]
    for r, tokenized in enumerate(rounds):
        # the environment and every agent's last post are shared, in the same order for everyone
        said = history[r - 1] if r else w.synthetic_outputs(-1)
        expected = [w.environment(r)] + [f"{w.names[a]}: {said[a]}" for a in w.agents]
        for tok in tokenized:
            shared = shared_texts(tokenizer, tok)
            found = [next(i for i, text in enumerate(shared) if line in text) for line in expected]
            assert found == sorted(found)
    # the chat history grows every round and the earlier prompt stays a prefix up to the environment
    growth = [len(rounds[r + 1][0].token_ids) - len(rounds[r][0].token_ids) for r in range(2)]
    assert all(g > 0 for g in growth)


def test_debate_excludes_own_answers(tokenizer):
    w = make_workload("debate", 4, seed=0)
    history = synthetic_history(w, 2)
    turns = w.turns(2, history)
    for turn in turns:
        seen = [m["content"] for m in turn.messages if m["role"] == "user"]
        own = w.names[turn.agent_id]
        others = [a for a in w.agents if a != turn.agent_id]
        assert all(f"{w.names[a]}: {history[r][a]}" in seen for a in others for r in range(2))
        assert not any(s.startswith(f"{own}: ") for s in seen)
        assert [m["content"] for m in turn.messages if m["role"] == "assistant"] == [history[r][turn.agent_id] for r in range(2)]
    assert w.turns(0, [])[0].messages[-1]["content"] == w.question
    assert all(150 <= w.output_tokens(a, r) <= 300 for a in w.agents for r in range(3))


def test_fact_recall_asks_a_fact_another_agent_stated_and_grades_it(tokenizer):
    w = make_workload("fact-recall", 8, seed=3)
    for r in range(3):
        facts, turns = w.facts(r), w.turns(r, synthetic_history(w, r))
        for attribute in {a for agent_facts in facts.values() for a in agent_facts}:
            values = [f[attribute] for f in facts.values() if attribute in f]
            assert len(values) == len(set(values))  # an answer names one agent's fact
        for turn in turns:
            subject, attribute = w.question(turn.agent_id, r)
            answer = facts[subject][attribute]
            assert subject != turn.agent_id and w.answer(turn.agent_id, r) == answer
            statement = f"{w.names[subject]}: {w.synthetic_output(subject, r)}"
            assert statement in [m["content"] for m in turn.messages] and answer in statement
            assert w.names[subject] in turn.messages[-1]["content"]
            assert w.grade(turn.agent_id, r, f" {answer.upper()}.\nMore text") is True
            assert w.grade(turn.agent_id, r, f"I do not know.\n{answer}") is False
            assert w.grade(turn.agent_id, r, f"{answer}0") is False  # a whole word only
        tokenized = tokenize_round(tokenizer, turns)
        assert all(len(t.shared_spans) >= len(w.agents) for t in tokenized)  # every statement, and the header
    assert make_workload("generative-agents", 2).grade("agent000", 0, "x") is None


def test_bad_parameters_are_rejected():
    with pytest.raises(InvalidRequestError):
        make_workload("town-hall")
    with pytest.raises(InvalidRequestError):
        make_workload("generative-agents", 0)
    with pytest.raises(InvalidRequestError):
        make_workload("generative-agents", 3, order="random")
    with pytest.raises(InvalidRequestError):
        make_workload("debate", 12)
    w = make_workload("generative-agents", 3)
    with pytest.raises(InvalidRequestError):
        w.turns(2, synthetic_history(w, 1))  # round 2 needs the outputs of rounds 0 and 1


def test_chat_segments_cut_one_rendering_as_prefix_renderings_would(tokenizer):
    """The linear cut of a chat into message segments (one rendering with sentinels) gives the
    same ids as rendering every prefix of the conversation and taking the differences."""
    from tokendance.reuse.segments import chat_segments, split_lines

    def by_prefixes(messages):
        rendered = [""] + [tokenizer.apply_chat_template(messages[:end], add_generation_prompt=False)
                           for end in range(1, len(messages) + 1)]
        rendered.append(tokenizer.apply_chat_template(messages, add_generation_prompt=True))
        pieces = [b[len(a):] for a, b in zip(rendered, rendered[1:])]
        contents = [m["content"] for m in messages] + [""]
        return [tokenizer.encode(line) for piece, content in zip(pieces, contents)
                for line in split_lines(piece, content)]

    rng = random.Random(0)
    texts = ["hi", "a\nb\n  c", " x ", "", "line1\nline2\n", '{\n  "a": 1\n}', "tab\there"]
    for _ in range(40):
        messages = [{"role": rng.choice(["system", "user", "assistant", "tool"]), "content": rng.choice(texts)}
                    for _ in range(rng.randint(1, 10))]
        assert chat_segments(tokenizer, messages) == by_prefixes(messages), messages
