"""The round protocol both front doors speak (`tokendance/round_protocol.py`): refused fields, the
agent's salt over the round's, the answer's usage and round object (no server needed)."""

from tokendance.round_protocol import REFUSED, refusal, refused_field, round_answer, sum_usage, turn_salt


def test_a_round_refuses_the_fields_it_does_not_serve_and_names_them():
    assert refused_field({"stream": False, "tools": [], "logprobs": False, "temperature": 0}) is None
    assert refused_field({"tool_choice": "auto", "stream": True}) == "tool_choice"  # in REFUSED order
    assert [refused_field({name: True}) for name in REFUSED] == list(REFUSED)
    assert "stream each agent's chat request" in refusal("stream") and refusal("tools").startswith("/v1/rounds")


def test_an_agents_own_salt_wins_over_the_rounds():
    assert turn_salt("tenant", "mine") == "mine"
    assert turn_salt("tenant", None) == "tenant" and turn_salt(None, None) is None


def test_the_answer_sums_usage_as_chat_reports_it():
    outputs = [{"agent_id": a, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
                "usage": {"prompt_tokens": p, "completion_tokens": 2, "total_tokens": p + 2,
                          "prompt_tokens_details": {"cached_tokens": c}}} for a, p, c in (("a", 10, 4), ("b", 7, 0))]
    answer = round_answer("round-1", "m", outputs, {"mode": "x"}, index=3)
    assert answer["object"] == "round" and answer["id"] == "round-1"
    assert answer["round"] == {"round_id": "round-1", "num_agents": 2, "index": 3}
    assert answer["usage"] == sum_usage([o["usage"] for o in outputs]) == {
        "prompt_tokens": 17, "completion_tokens": 4, "total_tokens": 21, "prompt_tokens_details": {"cached_tokens": 4}}
