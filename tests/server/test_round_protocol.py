"""The round protocol both front doors speak (`tokendance/round_protocol.py`): refused fields, the
agent's salt over the round's, the answer's usage and round object; the plugin's endpoint reading
a body as `tokendance serve` does (no server needed)."""

import pytest

from tokendance.round_protocol import REFUSED, refusal, refused_field, round_answer, sum_usage, turn_salt
from tokendance.vllm_plugin.endpoint import FieldError, round_requests, tag_body


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


def field_of(call) -> str | None:
    with pytest.raises(FieldError) as refused:
        call()
    return refused.value.param


def test_the_plugins_endpoint_names_a_bad_round_field_as_tokendance_serve_does():
    hi = [{"role": "user", "content": "hi"}]
    assert field_of(lambda: tag_body({"prompt": "x", "agent_id": "a"}, chat=False)) == "agent_id"
    assert field_of(lambda: tag_body({"messages": hi, "agent_id": "a", "round_size": 2})) == "round_size"
    assert field_of(lambda: tag_body({"messages": hi, "agent_id": "a", "round_id": "r", "round_size": 4097})) == "round_size"
    tag = {"round_id": "r", "agent_id": "a"}
    assert field_of(lambda: tag_body({"messages": hi, "kv_transfer_params": {"tokendance": {"round_id": "r"}},
                                      "cache_salt": "s"})) == "kv_transfer_params.tokendance"
    assert field_of(lambda: tag_body({"messages": hi, "kv_transfer_params": {"tokendance": tag}})) == "cache_salt"
    assert field_of(lambda: tag_body({"messages": hi, "kv_transfer_params": {"tokendance": tag}, "cache_salt": "s",
                                      "round_id": "r"})) == "kv_transfer_params.tokendance"
    one = {"agent_id": "a", "messages": hi}
    assert field_of(lambda: round_requests({"agents": [one], "round_id": "mine"})) == "round_id"
    assert field_of(lambda: round_requests({"agents": [{**one, "round_size": 2}]})) == "agents.0.round_size"
    assert field_of(lambda: round_requests({"agents": [{"messages": hi}]})) == "agents.0.agent_id"


def test_a_round_member_without_an_agent_id_is_an_agent_of_its_own():
    """As in `tokendance serve`: it joins the round, under a salt no other request has."""
    hi = [{"role": "user", "content": "hi"}]
    first, second = (tag_body({"messages": hi, "round_id": "r", "round_size": 2, "cache_salt": "t"}) for _ in range(2))
    assert first["kv_transfer_params"]["tokendance"]["round_id"] == "r"
    assert first["kv_transfer_params"]["tokendance"]["namespace"] == "t"
    assert first["cache_salt"].startswith("t:") and first["cache_salt"] != second["cache_salt"]
    assert tag_body({"messages": hi, "kv_transfer_params": {"tokendance": {"round_id": "r", "agent_id": "a"}},
                     "cache_salt": "s"})["kv_transfer_params"]["tokendance"] == {"round_id": "r", "agent_id": "a"}


def test_the_plugins_endpoint_refuses_what_nests_too_deeply_for_vllm():
    """vLLM answered 500 for a tool call's arguments nesting past the JSON parser's recursion (it
    parses them to render the prompt): the endpoint names the field first."""
    from tokendance.vllm_plugin.endpoint import too_deep

    deep = "[" * 100_000
    call = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": deep}}]}
    assert too_deep({"messages": [{"role": "user", "content": deep}, call]}) == "messages.1.tool_calls.0.function.arguments"
    assert too_deep({"agents": [{"messages": [call]}]}) == "agents.0.messages.0.tool_calls.0.function.arguments"
    assert too_deep({"input": [{"type": "function_call", "arguments": '{"a": [1, {"b": 2}]}'}]}) is None


def test_a_clients_own_round_tag_is_checked_on_every_route():
    """The check is keyed on the field, not on a list of paths: vLLM forwards `kv_transfer_params`
    from `/v1/messages`, `/cohere/v2/chat`, `/inference/v1/generate` and will from routes it adds;
    a tag the connector could not use (`transparent`, the server's own; no `cache_salt`) is a 400
    on each, before vLLM sees it. A usable one, a body without one and a form pass untouched."""
    import asyncio
    import json

    from tokendance.vllm_plugin.endpoint import RoundFields

    def status(path: str, body, method: str = "POST", content_type: bytes = b"application/json") -> tuple[int, bytes]:
        reached = []

        async def app(scope, receive, send):
            reached.append((await receive())["body"])
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

        async def run():
            raw = body if isinstance(body, bytes) else json.dumps(body).encode()
            messages = [{"type": "http.request", "body": raw, "more_body": False}]
            statuses = []

            async def receive():
                return messages.pop(0) if messages else {"type": "http.disconnect"}

            async def send(message):
                if message["type"] == "http.response.start":
                    statuses.append(message["status"])
            scope = {"type": "http", "method": method, "path": path, "headers": [(b"content-type", content_type)]}
            await RoundFields(app)(scope, receive, send)
            return statuses[0]
        code = asyncio.run(run())
        assert (code == 200) == bool(reached)  # a refused body never reaches vLLM
        return code, reached[0] if reached else b""

    tag = {"round_id": "r", "agent_id": "a", "round_size": 2}
    transparent = {"messages": [], "kv_transfer_params": {"tokendance": {**tag, "transparent": True}}}
    unsalted = {"messages": [], "kv_transfer_params": {"tokendance": tag}}
    for path in ("/v1/messages", "/cohere/v2/chat", "/inference/v1/generate", "/v1/responses", "/v2/a/future/route"):
        assert status(path, transparent)[0] == 400
        assert status(path, {**transparent, "cache_salt": "s"})[0] == 400
        assert status(path, unsalted)[0] == 400
        usable = {**unsalted, "cache_salt": "s"}
        assert status(path, usable) == (200, json.dumps(usable).encode())
    assert status("/v1/messages", transparent, method="PUT")[0] == 400
    assert status("/v1/messages", {"messages": [], "kv_transfer_params": {"do_remote_prefill": True}})[0] == 200
    form = b"--x\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nm\r\n--x--\r\n"
    assert status("/v1/audio/transcriptions", form, content_type=b"multipart/form-data; boundary=x") == (200, form)
