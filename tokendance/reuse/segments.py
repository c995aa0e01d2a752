"""Agent turns as segments: each chat message is tokenized on its own, so a message that recurs
across a round's agents has the same token ids in every prompt wherever it sits."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import jinja2

from tokendance.errors import InvalidRequestError
from tokendance.model.tokenizer import ChatTokenizer
from tokendance.round_core.spans import Span, segment_key


@dataclass
class Segment:
    """A piece of a prompt: text or token ids. `shared=None` lets the round decide (a segment is
    shared when its tokens recur in another agent's prompt of the round)."""

    text: str | None = None
    token_ids: Sequence[int] | None = None
    shared: bool | None = None


@dataclass
class AgentTurn:
    """One agent's prompt in a round: chat `messages` or explicit `segments` (not both)."""

    agent_id: str
    messages: Sequence[dict] | None = None
    segments: Sequence[Segment | str] | None = None
    namespace: str = ""
    tools: Sequence[dict] | None = None  # with messages: rendered by a template that knows tools


@dataclass
class TokenizedTurn:
    agent_id: str
    namespace: str
    token_ids: list[int]
    spans: list[Span] = field(default_factory=list)
    # prompt_logprobs asked: the scheduler computes the prompt's private tail (the tokens after
    # its last shared segment) and the token before it, for their logits
    score_tail: bool = False

    @property
    def num_prepared(self) -> int:
        """Tokens a round prepares before the scheduler takes the prompt over: all but the last
        (its logits give the first output token), or all before the scored tail."""
        last = len(self.token_ids) - 1
        if not self.score_tail:
            return last
        tail = max((s.end for s in self.spans if s.key is not None), default=0)
        return max(0, min(last, tail - 1))

    @property
    def shared_spans(self) -> list[Span]:
        """Shared spans that can be served from shared KV: those within the prepared tokens."""
        end = self.num_prepared
        return [s for s in self.spans if s.key is not None and s.end <= end]


def chat_segments(tokenizer: ChatTokenizer, messages: Sequence[dict],
                  tools: Sequence[dict] | None = None) -> list[list[int]]:
    """Token ids of each message as the chat template renders it, one segment per line of its
    content, plus the generation prompt. Linear in the conversation's size (the template is
    rendered twice, whatever the number of messages); falls back to one segment if the template
    does not render messages one after the other. `tools` go to the template (one that knows
    them writes them into a message, Qwen's after the first system message's content)."""
    full = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)
    pieces = _message_pieces(tokenizer, messages, full, tools)
    if pieces is None:
        return [tokenizer.encode(full)]
    contents = [m["content"] for m in messages] + [""]
    return [tokenizer.encode(line) for piece, content in zip(pieces, contents) for line in split_lines(piece, content)]


def chat_token_ids(tokenizer: ChatTokenizer, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[int]:
    """A chat's prompt: its segments' ids in a row. The one translation of messages to ids, for
    the offline API and the server alike (a message has the same ids wherever it sits)."""
    validate_messages(messages)
    return [t for segment in chat_segments(tokenizer, messages, tools) for t in segment]


def _sentinel(index: int) -> str:
    return f"\x00\x01td{index}\x01\x00"


def _message_pieces(tokenizer: ChatTokenizer, messages: Sequence[dict], full: str,
                    tools: Sequence[dict] | None = None) -> list[str] | None:
    """The rendering of each message (header, content, trailer) and the generation prompt, such
    that they concatenate to `full`; None if the template does not allow that cut.

    The messages are rendered once with sentinels for their contents: the text between two
    sentinels is one message's trailer followed by the next one's header; the trailer is what the
    template puts after a lone message of that role. Text the template writes between a content
    and its trailer (Qwen's tools) stays with that message."""
    marked = [{**m, "content": _sentinel(i)} for i, m in enumerate(messages)]
    rendered = tokenizer.apply_chat_template(marked, add_generation_prompt=True, tools=tools)
    between, position = [], 0
    for i in range(len(messages)):
        found = rendered.find(_sentinel(i), position)
        if found < 0:
            return None
        between.append(rendered[position:found])
        position = found + len(_sentinel(i))
    between.append(rendered[position:])
    trailers: dict[str, str | None] = {}
    pieces, carried = [], between[0]
    for i, message in enumerate(messages):
        role = message["role"]
        if role not in trailers:
            trailers[role] = _trailer(tokenizer, message)
        trailer = trailers[role]
        if trailer is None:
            return None
        if tools:  # the template may write the tools between this content and its trailer
            end = between[i + 1].find(trailer)
        else:
            end = 0 if between[i + 1].startswith(trailer) else -1
        if end < 0:
            return None
        end += len(trailer)
        pieces.append(carried + message["content"] + between[i + 1][:end])
        carried = between[i + 1][end:]
    pieces.append(carried)
    if "".join(pieces) != full:  # the template changed a content (trimmed it, say): no cut
        return None
    return pieces


def _trailer(tokenizer: ChatTokenizer, message: dict) -> str | None:
    """What the template puts after a message of this role: rendered alone, or after a user
    message where the template insists that roles alternate from a user (Mistral's)."""
    marked = {**message, "content": _sentinel(0)}
    for conversation in ([marked], [{"role": "user", "content": _sentinel(1)}, marked]):
        try:
            rendered = tokenizer.apply_chat_template(conversation, add_generation_prompt=False)
        except jinja2.TemplateError:
            continue
        end = rendered.find(_sentinel(0))
        return None if end < 0 else rendered[end + len(_sentinel(0)):]
    return None


def split_lines(piece: str, content: str) -> list[str]:
    """A rendered message cut after each line of its content (a memory list, a feed): lines that
    recur elsewhere become segments of their own. The template's header stays with the first
    line and its trailer with the last."""
    start = piece.find(content) if content else -1
    if start < 0 or "\n" not in content.rstrip("\n"):
        return [piece] if piece else []
    cuts = [start + i + 1 for i, ch in enumerate(content[:-1]) if ch == "\n"]
    bounds = [0, *cuts, len(piece)]
    return [piece[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def tokenize_round(tokenizer: ChatTokenizer, turns: Sequence[AgentTurn]) -> list[TokenizedTurn]:
    """Tokenize every turn by segments and mark the shared ones (explicitly marked, or recurring
    in at least two turns of the same namespace)."""
    raw: list[list[tuple[list[int], bool | None]]] = []
    for turn in turns:
        raw.append(_turn_segments(tokenizer, turn))
    occurrences: Counter = Counter()
    for turn, segments in zip(turns, raw):
        for key in {segment_key(ids, turn.namespace) for ids, _ in segments}:
            occurrences[key] += 1
    tokenized = []
    for turn, segments in zip(turns, raw):
        result = TokenizedTurn(turn.agent_id, turn.namespace, [])
        for ids, marked in segments:
            key = segment_key(ids, turn.namespace)
            shared = marked if marked is not None else occurrences[key] > 1
            start = len(result.token_ids)
            result.token_ids.extend(ids)
            result.spans.append(Span(start, len(result.token_ids), key if shared else None, key))
        tokenized.append(result)
    return tokenized


def _turn_segments(tokenizer: ChatTokenizer, turn: AgentTurn) -> list[tuple[list[int], bool | None]]:
    if (turn.messages is None) == (turn.segments is None):
        raise InvalidRequestError(f"agent {turn.agent_id!r}: give either messages or segments")
    if turn.messages is not None:
        validate_messages(turn.messages)
        return [(ids, None) for ids in chat_segments(tokenizer, turn.messages, turn.tools)]
    segments = []
    for segment in turn.segments:
        if isinstance(segment, str):
            segment = Segment(text=segment)
        if segment.token_ids is not None:
            ids = list(segment.token_ids)
        elif segment.text is not None:
            ids = tokenizer.encode(segment.text)
        else:
            raise InvalidRequestError(f"agent {turn.agent_id!r}: a segment needs text or token_ids")
        if ids:
            segments.append((ids, segment.shared))
    return segments


def with_continuation(tokenizer: ChatTokenizer, turn: AgentTurn, token_ids: Sequence[int]) -> AgentTurn:
    """The turn with `token_ids` appended as its last, private segment, to be scored in a round
    (`SamplingParams(prompt_logprobs=k)`: teacher forcing over the round's reused KV). Its other
    segments are the ones the turn itself has, so they are shared exactly as in the turn."""
    if turn.messages is not None:
        validate_messages(turn.messages)
        pieces = [Segment(token_ids=ids) for ids in chat_segments(tokenizer, turn.messages)]
    else:
        pieces = [Segment(text=s) if isinstance(s, str) else s for s in turn.segments]
    return AgentTurn(turn.agent_id, segments=[*pieces, Segment(token_ids=list(token_ids), shared=False)],
                     namespace=turn.namespace)


def validate_messages(messages) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} dicts")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise InvalidRequestError(f"each message needs string 'role' and 'content', got {m!r}")
