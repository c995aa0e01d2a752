"""Transparent rounds at the plugin's front door (`transparent_rounds: true` in the connector's
settings): chat requests that name no round are gathered into rounds, by `tokendance serve`'s rule
(`tokendance/round_core/gathering.py`), and tagged for the connector as declared members are.

- Candidates. A lone request is held only as the first of a burst (`Door`): one that comes while no
  other chat request is at the endpoint (held, or sent on and not answered yet) goes on at once,
  unless the endpoint emptied less than `NEXT_BURST_S` ago after a burst that formed a round (an
  app's next step). Otherwise the connector's
  `transparent_rule` says which are held: `shared` (`AnyText`), every one, whoever wrote the text
  it may share; `quotes` (`RecentReplies`), one that quotes a recent reply: a line of one of its
  non-assistant messages holds the start (`MIN_SHARED_CHARS` characters from its first word) of a
  line that a chat reply of this server wrote lately (content, or a tool call's string arguments).
  Every other request goes on at once, as a round of one (computed whole; the connector keeps its
  conversation's session). A prompt with a part other than text (an image, audio) goes on untouched.
- Gathering. Candidates wait until none has come for `gather_window_s`, `round_timeout_s` at most
  after the first; one that overlaps no other a window after it came goes on alone then (a
  request sharing nothing waits a window, however busy the endpoint). Those that overlap another
  (a line in common outside their common prefix) form one round per cache namespace and model (or
  adapter); the rest go on alone.
- Agents and salts. A member is its client's `agent_id` (salted as a declared agent), else its
  conversation: a hash of its namespace, model and first message (an agent's persona, which stays while
  the rest of its prompt changes). A conversation's member keeps its request's cache salt: vLLM's
  block hashes chain every token from position 0 (and the client's salt), so the KV a mirror
  reuses is found again only by a request whose tokens agree with it up to there (the same
  conversation by every sign the server has: its next turn finds its history, as in plain vLLM),
  and requests that are never held keep vLLM's prefix caching as it is. Of two members of one round
  with the same first message, the later is an anonymous agent with a salt of its own (their
  prompts could agree up to a reused piece).
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Iterable

from tokendance.registry import DEFAULT_TRANSPARENT_RULE, TRANSPARENT_RULES, load
from tokendance.round_core.protocol import agent_salt
from tokendance.round_core.gathering import (MIN_SHARED_CHARS, ChatTurn, Door, HeldTurns, ReadyWork, chat_lines,
                                             conversation_id)

logger = logging.getLogger("tokendance.vllm")
WORD_START = re.compile(r"(?<!\w)\w")
MAX_REPLY_BYTES = 4 << 20  # a reply longer than this is not read for quotes


def line_key(line: str) -> str | None:
    """What a quote of this reply line is recognised by: its first MIN_SHARED_CHARS characters from
    its first word (a prompt may prefix it with a name, a bullet or a quote), None if shorter."""
    start = WORD_START.search(line)
    if start is None or len(line.rstrip()) - start.start() < MIN_SHARED_CHARS:
        return None
    return line[start.start():start.start() + MIN_SHARED_CHARS]


def strings(value) -> Iterable[str]:
    """Every string inside a JSON value (a tool call's arguments: what an action wrote)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from strings(v)


def reply_texts(body: bytes, stream: bool) -> list[str]:
    """What a chat reply wrote, per choice: its content and its tool calls' string arguments; the
    reply whole (JSON) or as server-sent events (deltas joined per choice and call)."""
    if stream:
        chunks = []
        for line in body.decode(errors="replace").split("\n"):
            try:
                chunks.append(json.loads(line[5:]) if line.startswith("data:") else None)
            except ValueError:
                pass
        choices, part = [c for chunk in chunks if isinstance(chunk, dict) for c in chunk.get("choices") or []], "delta"
    else:
        try:
            reply = json.loads(body)
        except ValueError:
            return []
        choices, part = (reply.get("choices") or [] if isinstance(reply, dict) else []), "message"
    texts: dict = {}
    arguments: dict = {}
    for choice in choices:
        message = choice.get(part) if isinstance(choice, dict) else None
        if not isinstance(message, dict):
            continue
        index = str(choice.get("index", 0))
        if isinstance(message.get("content"), str):
            texts.setdefault(index, []).append(message["content"])
        for j, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function") if isinstance(call, dict) else None
            if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                arguments.setdefault((index, str(call.get("index", j))), []).append(function["arguments"])
    out = ["".join(parts) for parts in texts.values()]
    for parts in arguments.values():
        try:
            out += list(strings(json.loads("".join(parts))))
        except (ValueError, RecursionError):
            out.append("".join(parts))
    return [text for text in out if text]


class AnyText:
    """`transparent_rule: "shared"`: any chat request may share text with another, whoever wrote it
    (a feed, a seed post, a world state): each is held, and the gatherer's overlap rule decides."""

    reads_replies = False

    def is_candidate(self, messages: list[dict]) -> bool:
        return True


class RecentReplies:
    """`transparent_rule: "quotes"`: a request is held only if it quotes what a reply of this server
    wrote lately (`quoted_in`). The keys (`line_key`) of those lines: an LRU of `capacity` keys."""

    reads_replies = True

    def __init__(self, capacity: int = 1 << 16):
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()

    def add(self, text: str) -> None:
        for line in text.split("\n"):
            key = line_key(line)
            if key is not None:
                self._keys[key] = None
                self._keys.move_to_end(key)
        while len(self._keys) > self.capacity:
            self._keys.popitem(last=False)

    def quoted_in(self, text: str) -> bool:
        return any(line[m.start():m.start() + MIN_SHARED_CHARS] in self._keys
                   for line in text.split("\n") for m in WORD_START.finditer(line))

    def is_candidate(self, messages: list[dict]) -> bool:
        return any(self.quoted_in(m["content"]) for m in messages if m["role"] != "assistant")


class Gathering:
    """The front door's gatherer (one per API server process, on its event loop): `admit` holds a
    candidate until its round forms and returns the body to send on (a member's with its tag for
    the connector, in `kv_transfer_params.tokendance`); `rule` says which requests are candidates
    (and, for `quotes`, learns what the server answered). `door`: the chat requests inside
    `serving` (held, or sent on and not answered yet), and whether one more is held (`Door`). `counts`: requests by outcome (passed,
    member, alone, left while held) and rounds formed."""

    def __init__(self, window_s: float, round_timeout_s: float, rule: str = DEFAULT_TRANSPARENT_RULE, metric=None):
        self.held = HeldTurns(window_s, round_timeout_s, self._close, self._left)
        self.rule = load(TRANSPARENT_RULES[rule])()
        self.door = Door()
        self.counts: Counter[str] = Counter()
        self.metric = metric  # a labelled Prometheus counter (outcome), or None
        self._bodies: dict[str, tuple[dict, str]] = {}  # a held turn's key -> (its body, cache namespace)

    @staticmethod
    def may_join(body: dict) -> bool:
        """A chat request a round can serve: one choice, no prompt scoring, no round of its own."""
        params = body.get("kv_transfer_params")
        return (body.get("round_id") is None and (params is None or isinstance(params, dict) and "tokendance" not in params)
                and body.get("n") in (1, None) and body.get("prompt_logprobs") is None and not body.get("echo")
                and (body.get("agent_id") is None or isinstance(body.get("agent_id"), str)))

    @contextlib.contextmanager
    def serving(self):
        """Around one chat request at the endpoint, from before `admit` to its answer's end (or its
        client leaving): while it is inside, another request is not lone."""
        self.door.enter()
        try:
            yield
        finally:
            self.door.leave()

    @property
    def num_at_door(self) -> int:
        return self.door.at_door

    async def admit(self, body: dict) -> dict:
        """The body to send on: this one as it came, or a new one tagged as a round member. Called
        inside `serving`: a request the door does not hold (`Door.holds`) goes on at once."""
        messages = chat_lines(body.get("messages"))
        if messages is None or not self.may_join(body):
            return body
        salt = body.get("cache_salt")
        namespace = salt if isinstance(salt, str) else ""
        if not self.door.holds() or not self.rule.is_candidate(messages):
            self._count("passed")
            return self._own_turn(body, namespace, messages)
        key = f"gather-{uuid.uuid4().hex}"
        self._bodies[key] = (body, namespace)
        namespace = json.dumps([namespace, str(body.get("model"))])  # a round runs on one model (or adapter)
        return await self.held.hold(ChatTurn(key, messages, None, None, None, namespace=namespace,
                                             agent_id=body.get("agent_id"), arrival=time.monotonic()))

    def _left(self, turn: ChatTurn) -> None:
        """Its client left while it was held."""
        self._bodies.pop(turn.key, None)
        self._count("left")

    def _count(self, outcome: str) -> None:
        self.counts[outcome] += 1
        if self.metric is not None:
            self.metric.labels(outcome).inc()

    def _close(self, work: ReadyWork) -> None:
        for turns in work.rounds:  # one round per cache namespace and model
            by_namespace: dict[str, list[ChatTurn]] = {}
            for turn in turns:
                by_namespace.setdefault(turn.namespace, []).append(turn)
            for members in by_namespace.values():
                self._form(members) if len(members) > 1 else self._send_alone(members[0])
        for turn in work.ordinary:
            self._send_alone(turn)

    def _form(self, members: list[ChatTurn]) -> None:
        round_id, conversations = f"transparent-{uuid.uuid4().hex}", set()
        self._count("rounds")
        self.door.formed_round()
        for turn in members:
            body, namespace = self._bodies.pop(turn.key)
            body = {k: v for k, v in body.items() if k != "agent_id"}
            tag = {"round_id": round_id, "round_size": len(members), "namespace": namespace}
            conversation = conversation_id(namespace, turn.messages, body.get("model"))
            if turn.agent_id is None and conversation not in conversations:
                conversations.add(conversation)
                tag.update(agent_id=conversation, transparent=True)
            else:  # the client's agent, or a second member with the same first message: salted
                tag["agent_id"] = turn.agent_id or f"anonymous-{uuid.uuid4().hex}"
                body["cache_salt"] = agent_salt(tag["agent_id"], namespace or None)
            params = body.get("kv_transfer_params")
            body["kv_transfer_params"] = {**(params if isinstance(params, dict) else {}), "tokendance": tag}
            self._count("member")
            self.held.answer(turn.key, body)

    def _send_alone(self, turn: ChatTurn) -> None:
        body, namespace = self._bodies.pop(turn.key)
        self._count("alone")
        self.held.answer(turn.key, self._own_turn(body, namespace, turn.messages))

    @staticmethod
    def _own_turn(body: dict, namespace: str, messages: list[dict]) -> dict:
        """A conversation's turn outside any round: a round of one (computed whole, nothing held),
        so that the connector keeps its session for the rounds to come. A client's own agent
        goes as it came (its session is the declared agent's)."""
        if body.get("agent_id") is not None:
            return body
        tag = {"round_id": f"turn-{uuid.uuid4().hex}", "round_size": 1, "namespace": namespace,
               "agent_id": conversation_id(namespace, messages, body.get("model")), "transparent": True}
        params = body.get("kv_transfer_params")
        return {**body, "kv_transfer_params": {**(params if isinstance(params, dict) else {}), "tokendance": tag}}

    def reading_replies(self, send):
        """`send`, also feeding a successful chat reply's text to the rule where it reads replies."""
        if not self.rule.reads_replies:
            return send
        chunks, state = [], {"ok": False, "stream": False, "size": 0}

        async def reading(message):
            if message["type"] == "http.response.start":
                headers = {k.lower(): v for k, v in message.get("headers", [])}
                state["ok"] = message["status"] == 200
                state["stream"] = b"event-stream" in headers.get(b"content-type", b"")
            elif message["type"] == "http.response.body" and state["ok"]:
                body = message.get("body", b"")
                state["size"] += len(body)
                if state["size"] <= MAX_REPLY_BYTES:
                    chunks.append(body)
                else:
                    chunks.clear()
                if not message.get("more_body", False) and state["size"] <= MAX_REPLY_BYTES:
                    try:
                        for text in reply_texts(b"".join(chunks), state["stream"]):
                            self.rule.add(text)
                    except Exception:  # a reply it cannot read teaches nothing; the client still gets it
                        logger.warning("transparent rounds: a reply could not be read for quotes", exc_info=True)
            await send(message)

        return reading
