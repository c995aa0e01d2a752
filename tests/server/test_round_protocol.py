"""The round protocol both front doors speak (`tokendance/round_core/protocol.py`): its checks of the
round fields and a round's shape (one message per mistake, naming the field), refused fields, the
agent's salt over the round's, the answer's usage, round object and stats; the plugin's endpoint
reading a body and assembling an answer as `tokendance serve` does (no server needed; the two
servers answering alike is tests/vllm_plugin/test_vllm_server.py's contract test)."""

import pytest

from tokendance.round_core.protocol import (MAX_AGENTS, MAX_SALT_CHARS, REFUSED, STATS_FIELDS, RoundFieldError,
                                       check_chat_fields, check_completion_fields, check_round_request, refusal,
                                       refused_field, round_answer, sum_usage, turn_salt)
from tokendance.vllm_plugin.http.endpoint import agent_refusal, round_requests, round_response, tag_body


def test_a_round_refuses_the_fields_it_does_not_serve_and_names_them():
    assert refused_field({"stream": False, "tools": [], "logprobs": False, "temperature": 0}) is None
    assert refused_field({"tool_choice": "auto", "stream": True}) == "tool_choice"  # in REFUSED order
    assert [refused_field({name: True}) for name in REFUSED] == list(REFUSED)
    assert "stream each agent's chat request" in refusal("stream") and refusal("tools").startswith("/v1/rounds")


def test_an_agents_own_salt_wins_over_the_rounds():
    assert turn_salt("tenant", "mine") == "mine"
    assert turn_salt("tenant", None) == "tenant" and turn_salt(None, None) is None


def test_the_answer_sums_usage_as_chat_reports_it_and_has_every_stat():
    outputs = [{"agent_id": a, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop",
                "usage": {"prompt_tokens": p, "completion_tokens": 2, "total_tokens": p + 2,
                          "prompt_tokens_details": {"cached_tokens": c}}} for a, p, c in (("a", 10, 4), ("b", 7, 0))]
    answer = round_answer("round-1", "m", outputs, {"mode": "x"}, index=3)
    assert answer["object"] == "round" and answer["id"] == "round-1"
    assert answer["round"] == {"round_id": "round-1", "num_agents": 2, "index": 3}
    assert answer["usage"] == sum_usage([o["usage"] for o in outputs]) == {
        "prompt_tokens": 17, "completion_tokens": 4, "total_tokens": 21, "prompt_tokens_details": {"cached_tokens": 4}}
    assert list(answer["stats"]) == list(STATS_FIELDS) and answer["stats"]["num_waves"] is None
    assert round_answer("round-1", "m", outputs, {})["round"]["index"] is None  # a door that keeps no count


def refused(check, body) -> tuple[str | None, str]:
    """(param, code) of the one mistake `check` finds in `body`."""
    with pytest.raises(RoundFieldError) as caught:
        check(body)
    assert caught.value.message and str(caught.value) == caught.value.message
    return caught.value.param, caught.value.code


HI = [{"role": "user", "content": "hi"}]
ONE = {"agent_id": "a", "messages": HI}


@pytest.mark.parametrize("fields,param,code", [
    ({"agent_id": ""}, "agent_id", "invalid_value"),
    ({"agent_id": 7}, "agent_id", "invalid_value"),
    ({"agent_id": "x" * 257}, "agent_id", "invalid_value"),
    ({"agent_id": "anonymous-1"}, "agent_id", "invalid_value"),  # the plugin's names for its own agents
    ({"round_id": ""}, "round_id", "invalid_value"),
    ({"round_size": 2}, "round_size", "invalid_value"),  # no round_id
    ({"round_id": "r", "round_size": "two"}, "round_size", "invalid_value"),
    ({"round_id": "r", "round_size": True}, "round_size", "invalid_value"),
    ({"round_id": "r", "round_size": MAX_AGENTS + 1}, "round_size", "invalid_value"),
    ({"cache_salt": ""}, "cache_salt", "invalid_value"),
    ({"cache_salt": "x" * (MAX_SALT_CHARS + 1)}, "cache_salt", "invalid_value"),
    ({"agent_id": "a", "n": 2}, "n", "invalid_value"),
    ({"round_id": "r", "prompt_logprobs": 1}, "prompt_logprobs", "unsupported_parameter"),
])
def test_a_chat_requests_round_fields_are_checked_once_for_both_doors(fields, param, code):
    assert refused(check_chat_fields, {"messages": HI, **fields}) == (param, code)
    # the plugin's middleware checks with the same function
    assert refused(tag_body, {"messages": HI, **fields}) == (param, code)


def test_well_formed_round_fields_pass():
    for body in ({"messages": HI}, {"messages": HI, "agent_id": "a", "round_id": "r", "round_size": MAX_AGENTS,
                                    "cache_salt": "x" * MAX_SALT_CHARS, "n": 1}, {"n": 3, "prompt_logprobs": 0}, [1]):
        check_chat_fields(body)
    check_completion_fields({"prompt": "x", "cache_salt": "s"})
    check_round_request({"model": "m", "agents": [{**ONE, "model": "m", "n": 1}], "n": None, "stream": False})


def test_a_completion_takes_no_round_field():
    assert refused(check_completion_fields, {"prompt": "x", "agent_id": "a"}) == ("agent_id", "unsupported_parameter")
    assert refused(check_completion_fields, {"prompt": "x", "cache_salt": 3}) == ("cache_salt", "invalid_value")
    assert refused(lambda b: tag_body(b, chat=False), {"prompt": "x", "round_id": "r"})[0] == "round_id"


@pytest.mark.parametrize("body,param,code", [
    ([ONE], None, "invalid_value"),
    ({"agents": []}, "agents", "invalid_value"),
    ({"agents": ONE}, "agents", "invalid_value"),
    ({"agents": [ONE] * (MAX_AGENTS + 1)}, "agents", "invalid_value"),
    ({"agents": [ONE, ONE]}, "agents", "invalid_value"),  # ids not distinct
    ({"agents": ["a"]}, "agents.0", "invalid_value"),
    ({"agents": [{"messages": HI}]}, "agents.0.agent_id", "invalid_value"),
    ({"agents": [ONE, {"agent_id": "conversation-1", "messages": HI}]}, "agents.1.agent_id", "invalid_value"),
    ({"agents": [{**ONE, "messages": []}]}, "agents.0.messages", "invalid_value"),
    ({"agents": [ONE], "round_id": "mine"}, "round_id", "unsupported_parameter"),
    ({"agents": [{**ONE, "round_size": 2}]}, "agents.0.round_size", "unsupported_parameter"),
    ({"agents": [ONE], "stream": True}, "stream", "unsupported_parameter"),
    ({"agents": [{**ONE, "tools": [{}]}]}, "agents.0.tools", "unsupported_parameter"),
    ({"agents": [ONE], "n": 2}, "n", "unsupported_parameter"),
    ({"agents": [{**ONE, "n": 2}]}, "agents.0.n", "unsupported_parameter"),
    ({"agents": [{**ONE, "model": "other"}]}, "agents.0.model", "unsupported_parameter"),
    ({"agents": [ONE], "cache_salt": ""}, "cache_salt", "invalid_value"),
    ({"agents": [{**ONE, "cache_salt": "x" * (MAX_SALT_CHARS + 1)}]}, "agents.0.cache_salt", "invalid_value"),
])
def test_a_rounds_shape_is_checked_once_for_both_doors(body, param, code):
    if isinstance(body, dict):
        body = {"model": "m", **body}
    assert refused(check_round_request, body) == (param, code)
    assert refused(round_requests, body) == (param, code)  # the plugin's /v1/rounds


def test_the_plugins_own_round_tag_is_checked_in_its_door():
    """`kv_transfer_params.tokendance` (vLLM's field, not `tokendance serve`'s): refused where the
    connector could not use it."""
    tag = {"round_id": "r", "agent_id": "a"}
    assert refused(tag_body, {"messages": HI, "kv_transfer_params": {"tokendance": {"round_id": "r"}},
                              "cache_salt": "s"})[0] == "kv_transfer_params.tokendance"
    assert refused(tag_body, {"messages": HI, "kv_transfer_params": {"tokendance": tag}})[0] == "cache_salt"
    assert refused(tag_body, {"messages": HI, "kv_transfer_params": {"tokendance": tag}, "cache_salt": "s",
                              "round_id": "r"})[0] == "kv_transfer_params.tokendance"
    agent = {**ONE, "kv_transfer_params": {"tokendance": tag}}  # beside the round's own fields
    assert refused(round_requests, {"agents": [agent]})[0] == "agents.0.kv_transfer_params.tokendance"


def test_the_plugins_round_answer_has_serves_shape_and_keeps_a_failed_agent_alone():
    """An agent whose chat request failed (not refused: a 5xx, a dropped connection) fails alone, as
    in `tokendance serve`; the stats the plugin cannot know are null, the model the configured one."""
    requests = round_requests({"model": "alias", "agents": [ONE, {"agent_id": "b", "messages": HI}]})
    answer = {"model": "alias", "choices": [{"message": {"role": "assistant", "content": "hello", "tool_calls": []},
                                             "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                        "prompt_tokens_details": {"cached_tokens": 2}}}
    reply = round_response(requests[0]["round_id"], "smollm2", requests, [answer, "500: the engine died"], 0.5)
    assert reply["model"] == "smollm2" and reply["round"]["index"] is None
    ok, failed = reply["outputs"]
    assert ok["message"] == {"role": "assistant", "content": "hello"} and ok["finish_reason"] == "stop"
    assert failed["finish_reason"] == "error" and failed["error"]["code"] == "agent_failed"
    assert "the engine died" in failed["error"]["message"] and failed["usage"]["prompt_tokens"] is None
    assert reply["usage"]["prompt_tokens"] == 5 and reply["stats"]["prompt_tokens"] is None  # one count unknown
    assert reply["stats"]["num_agents"] == 2 and reply["stats"]["computed_tokens"] is None


def test_an_agents_refusal_names_the_field_where_the_client_wrote_it():
    body = {"model": "m", "max_tokens": 9, "agents": [ONE, {**ONE, "agent_id": "b", "temperature": 9}]}

    def param(field):
        return agent_refusal({"error": {"message": "no", "param": field}}, body, 1)["error"]["param"]

    assert param("temperature") == "agents.1.temperature" and param("messages.0.content") == "agents.1.messages.0.content"
    assert param("max_tokens") == "max_tokens" and param("model") == "model"  # the round's own fields
    assert param(None) == "agents.1" and param("input_tokens") == "agents.1.input_tokens"


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
    from tokendance.vllm_plugin.http.endpoint import too_deep

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

    from tokendance.vllm_plugin.http.endpoint import RoundFields

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
