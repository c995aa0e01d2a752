"""Transparent rounds at the vLLM plugin's front door (`tokendance/vllm_plugin/http/gathering.py`): which
chat requests wait (never a lone one; under the `quotes` rule only those quoting a reply), how they
become a round's members, whose salt they take, what a reply teaches the gatherer; no server needed
(the middleware is driven as ASGI)."""

import asyncio
import contextlib
import json

import pytest

from tokendance.round_core.gathering import NEXT_BURST_S, SERVER_AGENT_PREFIXES, Door, conversation_id
from tokendance.round_core.protocol import RESERVED_AGENT_PREFIXES, RoundFieldError
from tokendance.vllm_plugin.http.endpoint import RoundFields, connector_settings, tag_body
from tokendance.vllm_plugin.http.gathering import Gathering, RecentReplies, reply_texts

SAID = ["Abigail thinks the library should stay open until nine every evening.",
        "Viktor wants the broken bridge repaired before the winter festival begins.",
        "Hana says the new bakery sells the best sourdough in Willow Creek."]


def turn(name: str, order: list[int], **extra) -> dict:
    """An agent's next prompt: its persona, then what the others said (in its own order)."""
    feed = "\n".join(f"{'ABH'[i]}: {SAID[i]}" for i in order)
    return {"model": "m", "messages": [{"role": "system", "content": f"You are {name}, who lives in Willow Creek."},
                                       {"role": "user", "content": f"Yesterday:\n{feed}\nWhat do you do now?"}],
            **extra}


def gathering_with_replies() -> Gathering:
    """The `quotes` rule, having answered SAID."""
    gathering = Gathering(window_s=0.02, round_timeout_s=0.5, rule="quotes")
    for text in SAID:
        gathering.rule.add(text)
    return gathering


def admit_all(gathering: Gathering, bodies: list[dict], busy: bool = True) -> list[dict]:
    """The bodies admitted together, each inside `serving` as the middleware admits it; `busy`:
    while another request is at the endpoint (else the first of them is alone)."""
    async def one(body):
        with gathering.serving():
            return await gathering.admit(body)

    async def run():
        with gathering.serving() if busy else contextlib.nullcontext():
            return await asyncio.gather(*(one(b) for b in bodies))
    return asyncio.run(run())


def test_a_reply_is_read_whole_or_streamed_with_its_tool_calls():
    whole = {"choices": [{"index": 0, "message": {"content": "First line.\nSecond line.", "tool_calls": [
        {"function": {"name": "create_post", "arguments": json.dumps({"content": "A post about the bridge."})}}]}}]}
    assert reply_texts(json.dumps(whole).encode(), stream=False) == ["First line.\nSecond line.", "A post about the bridge."]
    deltas = [{"choices": [{"index": 0, "delta": {"content": "First "}}]},
              {"choices": [{"index": 0, "delta": {"content": "line."}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"content": "A po'}}]}}]},
              {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 'st."}'}}]}}]}]
    events = "".join(f"data: {json.dumps(d)}\n\n" for d in deltas) + "data: [DONE]\n\n"
    assert reply_texts(events.encode(), stream=True) == ["First line.", "A post."]
    assert reply_texts(b"not json", stream=False) == []


def test_a_quote_is_found_behind_a_name_and_short_lines_are_not_keys():
    replies = RecentReplies()
    replies.add(SAID[0] + "\nOK.")
    assert replies.is_candidate([{"role": "user", "content": f"- {SAID[0]}"}])
    assert not replies.is_candidate([{"role": "assistant", "content": SAID[0]}])  # its own turn quotes nothing
    assert replies.quoted_in(f"Others said:\n- Abigail: {SAID[0]}")
    assert not replies.quoted_in("OK.\nAbigail thinks the town hall should stay open")
    assert not replies.quoted_in(SAID[1])


def own_turn(body: dict) -> dict:
    """The body as the gathering sends on a conversation's turn outside any round, less its id."""
    tag = body["kv_transfer_params"]["tokendance"]
    assert tag.pop("round_id").startswith("turn-")
    return body


def test_requests_quoting_nothing_pass_at_once_as_rounds_of_one():
    gathering = gathering_with_replies()
    body = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story about a cat."}]}
    assert own_turn(admit_all(gathering, [body])[0]) == {**body, "kv_transfer_params": {"tokendance": {
        "round_size": 1, "namespace": "", "agent_id": conversation_id("", body["messages"], "m"), "transparent": True}}}
    assert gathering.counts == {"passed": 1} and len(gathering.held) == 0
    declared_agent = {**body, "agent_id": "alice"}  # the client's own agent: as it came (tag_body salts it)
    assert admit_all(gathering, [declared_agent]) == [declared_agent]


def test_requests_quoting_replies_at_different_positions_form_one_round_per_namespace():
    gathering = gathering_with_replies()
    bodies = [turn("Abigail", [0, 1, 2]), turn("Viktor", [1, 0, 2]), turn("Hana", [2, 0, 1]),
              turn("Rosa", [0, 2, 1], cache_salt="tenant-b"), turn("Omar", [2, 1, 0], cache_salt="tenant-b")]
    sent = admit_all(gathering, bodies)
    assert all(s["messages"] == b["messages"] for s, b in zip(sent, bodies))
    tags = [s["kv_transfer_params"]["tokendance"] for s in sent]
    rounds = [{t["round_id"] for t in tags[:3]}, {t["round_id"] for t in tags[3:]}]
    assert all(len(r) == 1 for r in rounds) and rounds[0] != rounds[1]  # one round per namespace
    assert [t["round_size"] for t in tags] == [3, 3, 3, 2, 2]
    assert [t["namespace"] for t in tags] == ["", "", "", "tenant-b", "tenant-b"]
    assert [t["agent_id"] for t in tags] == [conversation_id(b.get("cache_salt", ""), b["messages"], "m") for b in bodies]
    assert all(t["transparent"] for t in tags)
    # a conversation keeps its own salt: its history stays where plain prefix caching put it
    assert [s.get("cache_salt") for s in sent] == [b.get("cache_salt") for b in bodies]
    assert gathering.counts == {"member": 5, "rounds": 2}


def test_under_the_shared_rule_text_no_reply_wrote_forms_a_round_and_a_lone_request_is_never_held():
    """The default rule: a feed the server never wrote (SAID, unanswered here) shared at different
    positions makes a round of the requests that come together; the next burst soon after makes
    one too, its first request (alone at the endpoint) held with the rest; long after, the same
    requests one by one (each alone) pass at once; no reply is read."""
    gathering, now = Gathering(window_s=0.02, round_timeout_s=0.5), [0.0]
    gathering.door = Door(clock=lambda: now[0])
    bodies = [turn("Abigail", [0, 1, 2]), turn("Viktor", [1, 0, 2]), turn("Hana", [2, 0, 1])]
    tags = [s["kv_transfer_params"]["tokendance"] for s in admit_all(gathering, bodies)]
    assert len({t["round_id"] for t in tags}) == 1 and [t["round_size"] for t in tags] == [3, 3, 3]
    assert gathering.counts == {"member": 3, "rounds": 1}
    now[0] += NEXT_BURST_S - 0.1  # the door emptied a moment ago: the first of a burst is held
    tags = [s["kv_transfer_params"]["tokendance"] for s in admit_all(gathering, bodies, busy=False)]
    assert len({t["round_id"] for t in tags}) == 1 and [t["round_size"] for t in tags] == [3, 3, 3]
    assert gathering.counts == {"member": 6, "rounds": 2}
    now[0] += NEXT_BURST_S + 0.1
    alone = [s["kv_transfer_params"]["tokendance"] for s in admit_all(gathering, bodies, busy=False)]
    assert [t["round_size"] for t in alone] == [1, 1, 1] and gathering.counts["passed"] == 3
    chatting = {"model": "m", "messages": [{"role": "user", "content": "What is the capital of France, in one word?"}]}
    assert own_turn(admit_all(gathering, [chatting])[0])["messages"] == chatting["messages"]  # shares nothing
    assert gathering.counts["alone"] == 1 and len(gathering.held) == 0 and gathering.num_at_door == 0

    async def send(message):
        pass
    assert gathering.reading_replies(send) is send


def test_a_request_sharing_nothing_waits_one_window_while_a_burst_keeps_the_gathering_open():
    """`release_unshared` (the plugin's gatherer): a held turn that overlaps no other a window after
    it came leaves alone then, not when the burst around it closes; `tokendance serve`'s gatherer
    keeps it to the end."""
    from tokendance.round_core.gathering import ChatTurn, RoundGatherer

    def chat(key: str, lines: list[str], arrival: float) -> ChatTurn:
        return ChatTurn(key, [{"role": "user", "content": "\n".join(lines)}], None, None, None, arrival=arrival)

    lonely = ["What is the capital of France? Answer in a single word."]
    burst = [[f"You are agent {i} of Willow Creek.", *SAID[i % 3:], *SAID[:i % 3]] for i in range(8)]
    released, kept = RoundGatherer(0.05, 0.3, release_unshared=True), RoundGatherer(0.05, 0.3)
    for g in (released, kept):
        g.add(chat("lonely", lonely, 0.0))
        g.add(chat("agent-0", burst[0], 0.01))
    assert released.next_deadline() == pytest.approx(0.05)  # the lonely turn's window
    work = released.pop_ready(0.05)
    assert [t.key for t in work.ordinary] == ["lonely"] and work.rounds == []
    for g in (released, kept):
        for i, lines in enumerate(burst[1:], 1):  # one every 40 ms: the burst lasts 280 ms
            g.add(chat(f"agent-{i}", lines, 0.01 + 0.04 * i))
    assert released.next_deadline() == pytest.approx(0.06)  # agent 0's window: is it sharing yet?
    assert released.pop_ready(released.next_deadline()).ordinary == []
    assert released.next_deadline() == pytest.approx(0.31)  # every agent seen sharing: the round timeout
    assert [[t.key for t in r] for r in released.pop_ready(0.31).rounds] == [[f"agent-{i}" for i in range(8)]]
    assert len(released) == 0
    assert kept.next_deadline() == pytest.approx(0.3) and kept.pop_ready(0.05).ordinary == []
    assert [t.key for t in kept.pop_ready(0.3).ordinary] == ["lonely"]


def test_images_other_models_and_scored_prompts_are_kept_apart():
    gathering = gathering_with_replies()
    image = {**turn("Abigail", [0, 1]), "messages": [{"role": "user", "content": [
        {"type": "text", "text": SAID[0]}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}
    assert admit_all(gathering, [image]) == [image]  # its token ids do not say what the image holds
    assert not gathering.may_join({**image, "prompt_logprobs": 0})
    assert not gathering.may_join({**image, "kv_transfer_params": "junk"})  # vLLM's to refuse
    sent = admit_all(gathering, [turn("A", [0, 1, 2]), turn("B", [1, 0, 2]), turn("C", [2, 0, 1], model="lora-1"),
                                 turn("D", [0, 2, 1], model="lora-1")])
    rounds = [s["kv_transfer_params"]["tokendance"]["round_id"] for s in sent]
    assert rounds[0] == rounds[1] and rounds[2] == rounds[3] and rounds[0] != rounds[2]  # one round per model


def test_two_members_with_one_first_message_are_two_agents():
    gathering = gathering_with_replies()
    sent = admit_all(gathering, [turn("Abigail", [0, 1, 2]), turn("Abigail", [1, 0, 2]),
                                 turn("Viktor", [2, 1, 0], agent_id="viktor")])
    tags = [s["kv_transfer_params"]["tokendance"] for s in sent]
    assert len({t["round_id"] for t in tags}) == 1
    assert tags[0]["agent_id"].startswith("conversation-") and "cache_salt" not in sent[0]
    # the second Abigail could agree with the first up to a reused piece: a salt of its own
    assert tags[1]["agent_id"].startswith("anonymous-") and sent[1]["cache_salt"] == f"tokendance:{tags[1]['agent_id']}"
    # the client's own agent: salted as a declared agent is
    assert tags[2]["agent_id"] == "viktor" and sent[2]["cache_salt"] == "tokendance:viktor" and "agent_id" not in sent[2]
    assert "transparent" not in tags[1] and "transparent" not in tags[2]


def test_a_held_request_that_overlaps_no_other_goes_alone_and_a_declared_round_is_not_held():
    gathering = gathering_with_replies()
    alone = turn("Abigail", [0])
    declared = {**turn("Viktor", [1, 0]), "round_id": "r1", "agent_id": "viktor"}
    assert not gathering.may_join(declared) and not gathering.may_join({**alone, "n": 2})
    sent = own_turn(admit_all(gathering, [alone])[0])
    assert sent["messages"] == alone["messages"] and sent["kv_transfer_params"]["tokendance"]["round_size"] == 1
    assert gathering.counts == {"alone": 1}


def test_a_request_cancelled_while_it_waits_leaves_the_gathering():
    gathering = gathering_with_replies()

    async def run():
        with gathering.serving(), gathering.serving():  # another request at the endpoint, and this one
            waiting = asyncio.ensure_future(gathering.admit(turn("Abigail", [0, 1])))
            await asyncio.sleep(0)
            assert len(gathering.held) == 1
            waiting.cancel()
            await asyncio.sleep(0)
    asyncio.run(run())
    assert len(gathering.held) == 0 and gathering.num_at_door == 0


class Endpoint:
    def __init__(self, gathering):
        self.gathering = gathering


def call(middleware, body: dict, reply: dict) -> tuple[dict, int]:
    """POST body to /v1/chat/completions through the middleware; the app behind it records what it
    received and answers `reply`."""
    received = {}

    async def app(scope, receive, send):
        received.update(json.loads((await receive())["body"]))
        data = json.dumps(reply).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": data})

    async def run():
        statuses = []
        messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive():  # the body, then nothing until the client leaves (as a server's)
            if messages:
                return messages.pop(0)
            await asyncio.Event().wait()

        async def send(message):
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
        middleware.app = app
        await middleware({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive, send)
        return statuses[0]
    status = asyncio.run(run())
    return received, status


def test_the_middleware_learns_replies_and_tags_the_rounds_it_gathers():
    gathering = Gathering(window_s=0.01, round_timeout_s=0.5, rule="quotes")
    middleware = RoundFields(None, endpoint=Endpoint(gathering))
    for said in SAID:
        received, status = call(middleware, {"model": "m", "messages": [{"role": "user", "content": "Speak."}]},
                                {"choices": [{"index": 0, "message": {"content": said}}]})
        assert status == 200 and "cache_salt" not in received  # quoted nothing: sent on as a round of one
        assert received["kv_transfer_params"]["tokendance"]["round_size"] == 1
    assert gathering.counts == {"passed": 3} and gathering.num_at_door == 0
    received, status = call(middleware, turn("Abigail", [0, 1, 2]), {"choices": []})
    assert status == 200 and gathering.counts == {"passed": 4}  # it quoted the replies, but came alone: never held
    with gathering.serving():  # another chat request at the endpoint
        received, status = call(middleware, turn("Abigail", [0, 1, 2]), {"choices": []})
    assert status == 200 and gathering.counts["alone"] == 1  # it quoted the replies, waited, overlapped none
    assert "cache_salt" not in received and "round_id" not in received
    bad, status = call(middleware, {**turn("Viktor", [1, 0]), "agent_id": ""}, {"choices": []})
    assert status == 400 and bad == {}  # refused before it waits
    assert gathering.num_at_door == 0


def test_a_held_request_whose_client_leaves_is_never_sent_and_its_round_forms_without_it():
    """Three chats quote the same replies; one client leaves while held: it never reaches vLLM, and
    the other two form a round of two (none waits for a member that will never come)."""
    gathering = Gathering(window_s=0.05, round_timeout_s=1.0, rule="quotes")
    for said in SAID:
        gathering.rule.add(said)
    middleware = RoundFields(None, endpoint=Endpoint(gathering))
    received = []

    async def app(scope, receive, send):
        received.append(json.loads((await receive())["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})

    async def client(body: dict, leave_after: float | None):
        messages = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

        async def receive():
            if messages:
                return messages.pop(0)
            if leave_after is not None:
                await asyncio.sleep(leave_after)
                return {"type": "http.disconnect"}
            await asyncio.Event().wait()

        async def send(message):
            pass
        await middleware({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}, receive, send)

    async def run():
        middleware.app = app
        with gathering.serving():  # another chat request at the endpoint: none of the three is alone
            await asyncio.gather(client(turn("Abigail", [0, 1, 2]), None), client(turn("Viktor", [1, 2, 0]), 0.01),
                                 client(turn("Hana", [2, 0, 1]), None))
    asyncio.run(run())
    assert [r["messages"][0]["content"] for r in received] == ["You are Abigail, who lives in Willow Creek.",
                                                                "You are Hana, who lives in Willow Creek."]
    tags = [r["kv_transfer_params"]["tokendance"] for r in received]
    assert [t["round_size"] for t in tags] == [2, 2] and tags[0]["round_id"] == tags[1]["round_id"]
    assert gathering.counts == {"left": 1, "member": 2, "rounds": 1} and len(gathering.held) == 0


def test_the_setting_is_read_from_vllms_transfer_config():
    config = {"kv_connector": "TokenDanceConnector", "kv_connector_extra_config": {"transparent_rounds": True,
                                                                                   "gather_window_s": 0.1}}
    settings = connector_settings(json.dumps(config))
    assert settings.transparent_rounds and settings.gather_window_s == 0.1 and settings.transparent_rule == "shared"
    assert connector_settings({"kv_connector": "OffloadingConnector"}) is None and connector_settings(None) is None
    for extra, name in (({"transparent_rounds": "yes"}, "transparent_rounds"), ({"transparent_rule": "all"}, "transparent_rule"),
                        ({"transparent_rule": ["quotes"]}, "transparent_rule")):
        try:
            connector_settings({**config, "kv_connector_extra_config": extra})
        except ValueError as exc:
            assert name in str(exc)
        else:
            raise AssertionError(f"{extra} was accepted")
    assert connector_settings({**config, "kv_connector_extra_config": {"transparent_rule": "quotes"}}).transparent_rule == "quotes"


def test_a_client_cannot_write_a_gathered_members_tag():
    tag = {"round_id": "r", "agent_id": "a", "round_size": 2, "transparent": True}
    body = {**turn("Abigail", [0]), "kv_transfer_params": {"tokendance": tag}, "cache_salt": "s"}
    try:
        tag_body(body)
    except RoundFieldError as exc:
        assert exc.param == "kv_transfer_params.tokendance" and "transparent" in str(exc)
    else:
        raise AssertionError("a client-written transparent tag was accepted")


def test_a_client_cannot_name_its_agent_as_the_server_names_conversations():
    assert set(SERVER_AGENT_PREFIXES) <= set(RESERVED_AGENT_PREFIXES)  # the round protocol refuses what it names
    for name in ("conversation-0123", "anonymous-x"):
        for extra in ({"agent_id": name}, {"agent_id": name, "round_id": "r", "round_size": 2}):
            try:
                tag_body(turn("Abigail", [0], **extra))
            except RoundFieldError as exc:
                assert exc.param == "agent_id" and "conversation-" in str(exc)
            else:
                raise AssertionError(f"agent_id {name!r} was accepted")
    tag = {"round_id": "r", "agent_id": "conversation-0123", "round_size": 2}
    try:
        tag_body({**turn("Abigail", [0]), "kv_transfer_params": {"tokendance": tag}, "cache_salt": "s"})
    except RoundFieldError as exc:
        assert exc.param == "kv_transfer_params.tokendance" and "conversation-" in str(exc)
    else:
        raise AssertionError("a client-written tag naming a conversation was accepted")
    assert tag_body(turn("Abigail", [0], agent_id="my-conversation-1", round_id="r"))["cache_salt"]


def test_the_overlap_index_agrees_with_trying_every_pair_and_tries_about_one_per_turn(monkeypatch):
    import itertools
    import random

    from tokendance.round_core import gathering as round_gathering
    from tokendance.round_core.gathering import ChatTurn, overlapping, overlaps

    long = [f"line {i}: " + "words that are long enough to be a shared piece" for i in range(6)]
    rng = random.Random(0)
    for _ in range(300):  # random prompts: shared prefixes, lines repeated inside a prompt, two namespaces
        turns = []
        for i in range(rng.randint(2, 7)):
            lines = long[:rng.randint(0, 2)] + [rng.choice(long + ["short"]) for _ in range(rng.randint(0, 4))]
            turns.append(ChatTurn(f"k{i}", [{"role": "user", "content": "\n".join(lines)}], None, None, None,
                                  namespace=rng.choice(["a", "b"])))
        pairs = {i for a, b in itertools.combinations(range(len(turns)), 2) if overlaps(turns[a], turns[b])
                 for i in (a, b)}
        assert overlapping(turns) == pairs

    calls = []
    monkeypatch.setattr(round_gathering, "overlaps", lambda a, b: calls.append(1) or overlaps(a, b))
    said = [f"Agent {i} says the bridge over the creek needs repairs before the festival." for i in range(256)]
    turns = []
    for i in range(256):  # each agent: its persona, then every reply in an order of its own
        order = said[:]
        random.Random(i).shuffle(order)
        turns.append(ChatTurn(f"k{i}", [{"role": "system", "content": "You live in Willow Creek, a quiet town."},
                                        {"role": "user", "content": "\n".join(order)}], None, None, None))
    assert overlapping(turns) == set(range(256))
    assert len(calls) <= 2 * 256  # the pairwise rule tries 256 * 255 / 2 = 32,640 pairs
