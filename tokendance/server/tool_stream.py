"""A streamed reply with tools attached, cut into content deltas and tool-call deltas as it grows.

Content streams as it comes, except what may still become a call: a tail that could be the start
of `<tool_call>`, and trailing whitespace (whitespace next to a call is dropped). Inside a
`<tool_call>` block, the call opens (id, name) as soon as `{"name": "NAME", "arguments": {` has
arrived with a known name, and the arguments then stream as they are generated, up to the brace
that closes them; a block that turns out not to be a call of a known tool is sent as content
when it closes, as `parse_tool_calls` keeps it in the content of a whole reply.
"""

from __future__ import annotations

import re
import uuid

from tokendance.server.tools import CLOSE, OPEN, Tools, parse_tool_calls, tool_call

HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"arguments"\s*:\s*\{')


class ArgumentsScanner:
    """Finds where a JSON object ends, one character at a time (strings and escapes respected)."""

    def __init__(self):
        self.depth, self.in_string, self.escaped = 0, False, False

    def step(self, char: str) -> bool:
        """Take the next character; True when it closes the object that was opened first."""
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
        elif char == '"':
            self.in_string = True
        elif char in "{[":
            self.depth += 1
        elif char in "}]":
            self.depth -= 1
            return self.depth == 0
        return False


class ToolCallStream:
    """One choice's reply. Invariant: text[:done] is handled (sent, or whitespace dropped next to
    a call); `held` is whitespace before the open block, sent with it unless it is a call; `block`
    is where the open `<tool_call>` block's body starts (None outside a block); `scanner` is set
    while the open call's arguments stream, `arguments_end` once they closed."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.names = {f["name"] for f in tools.functions}
        self.text, self.done, self.held = "", 0, ""
        self.block: int | None = None
        self.scanner: ArgumentsScanner | None = None
        self.arguments_end: int | None = None
        self.num_calls = 0
        self.after_call = False  # whitespace right after a call is dropped

    def feed(self, text: str, finished: bool) -> dict:
        """The delta for `text` (new text of the reply): {"content": ..., "tool_calls": [...]},
        either key absent when it has nothing."""
        self.text += text
        content, calls = [], []
        while self._content(content, finished) if self.block is None else self._call(content, calls, finished):
            pass
        text = "".join(content)
        delta = {"content": text} if text and not self.tools.forced else {}  # forced: only ever call markup
        if calls:
            delta["tool_calls"] = merge(calls)
        return delta

    def _content(self, content: list[str], finished: bool) -> bool:
        if self.after_call:
            rest = self.text[self.done:]
            self.done += len(rest) - len(rest.lstrip())
            self.after_call = self.done == len(self.text)
        start = self.text.find(OPEN, self.done)
        if start >= 0:
            segment = self.text[self.done:start]
            content.append(segment.rstrip())
            self.held = segment[len(segment.rstrip()):]
            self.block = self.done = start + len(OPEN)
            return True
        segment = self.text[self.done:]
        if not finished:  # hold back what may start a call, and trailing whitespace
            segment = segment[:len(segment) - held_back(segment)].rstrip()
        content.append(segment)
        self.done += len(segment)
        return False

    def _call(self, content: list[str], calls: list[dict], finished: bool) -> bool:
        if self.scanner is None:
            header = HEADER.match(self.text, self.block)
            if header is not None and header.group(1) in self.names:
                calls.append({"index": self.num_calls, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                              "function": {"name": header.group(1), "arguments": ""}})
                self.num_calls += 1
                self.scanner, self.done = ArgumentsScanner(), header.end() - 1
                return True
            return self._close_block(content, calls, finished)
        if self.arguments_end is None:
            start = self.done
            for position in range(start, len(self.text)):
                if self.scanner.step(self.text[position]):
                    self.arguments_end = position + 1
                    break
            self.done = self.arguments_end or len(self.text)
            if self.done > start:
                calls.append({"index": self.num_calls - 1, "function": {"arguments": self.text[start:self.done]}})
        close = self.text.find(CLOSE, self.done) if self.arguments_end is not None else -1
        if close < 0:
            return False
        self._end_call(close + len(CLOSE))
        return True

    def _close_block(self, content: list[str], calls: list[dict], finished: bool) -> bool:
        """A block whose body did not open as a call: once it closes, a call written another way
        (keys in another order) is sent whole, anything else as content."""
        close = self.text.find(CLOSE, self.block)
        if close < 0 and not finished:
            return False
        end = len(self.text) if close < 0 else close + len(CLOSE)
        call = tool_call(self.text[self.block:close], self.tools) if close >= 0 else None
        if call is not None:
            calls.append({"index": self.num_calls, **call})
            self.num_calls += 1
            self._end_call(end)
        else:
            content.append(self.held + self.text[self.block - len(OPEN):end])
            self.done, self.block, self.held = end, None, ""
        return close >= 0

    def _end_call(self, end: int) -> None:
        self.done, self.block, self.scanner, self.arguments_end = end, None, None, None
        self.held, self.after_call = "", True


def held_back(text: str) -> int:
    """How many trailing characters of `text` could be the beginning of `<tool_call>`."""
    for size in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-size:]):
            return size
    return 0


def merge(calls: list[dict]) -> list[dict]:
    """One entry per call index: a call's opening and its argument pieces of one delta joined."""
    merged: dict[int, dict] = {}
    for call in calls:
        entry = merged.get(call["index"])
        if entry is None:
            merged[call["index"]] = {**call, "function": dict(call["function"])}
        else:
            entry["function"]["arguments"] += call["function"]["arguments"]
    return list(merged.values())


def tool_stream(tools: Tools) -> "ToolCallStream | HeldCallStream":
    """The stream for the tools' format: hermes calls stream as they are written; the others are
    held from where they start and sent whole when the reply ends."""
    return ToolCallStream(tools) if tools.format.name == "hermes" else HeldCallStream(tools)


class HeldCallStream:
    """A reply in a format without closing tags (`llama3_json`, `mistral`). Content streams until
    the calls may have started: the format's marker (a tail that may begin it is held back), or
    for `llama3_json` a reply whose first text is `{` or the python tag; from there the text is
    held and parsed when the reply ends (calls, or content if it holds none)."""

    def __init__(self, tools: Tools):
        self.tools = tools
        self.text, self.done = "", 0
        self.start: int | None = None  # where the held calls begin
        self.num_calls = 0

    def feed(self, text: str, finished: bool) -> dict:
        self.text += text
        content = ""
        if self.start is None:
            start, safe = self._find_start()
            if start is not None:
                content, self.start = self.text[self.done:start].rstrip(), start
                self.done = start
            else:
                end = len(self.text) if finished else safe
                content, self.done = self.text[self.done:end], max(self.done, end)
        delta = {"content": content} if content else {}
        if finished and self.start is not None:
            content, calls = parse_tool_calls(self.text[self.start:], self.tools)
            if calls:
                delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
                self.num_calls = len(calls)
            elif content:
                delta["content"] = delta.get("content", "") + content
        if self.tools.forced:  # only ever call markup
            delta.pop("content", None)
        return delta

    def _find_start(self) -> tuple[int | None, int]:
        """(where the calls start or None, how far the text is surely content)."""
        marker = self.tools.format.marker
        if marker is not None:
            found = self.text.find(marker, self.done)
            if found >= 0:
                return found, found
            for size in range(min(len(marker) - 1, len(self.text)), 0, -1):
                if marker.startswith(self.text[-size:]):
                    return None, len(self.text) - size
            return None, len(self.text)
        stripped = self.text.lstrip()  # llama3_json: only a reply that is a call
        if self.done > 0 or (stripped and not _may_open_call(stripped)):
            return None, len(self.text)
        if stripped.startswith(("{", PYTHON_TAG)):
            return len(self.text) - len(stripped), 0
        return None, 0  # whitespace, or a beginning of the python tag: undecided


PYTHON_TAG = "<|python_tag|>"


def _may_open_call(text: str) -> bool:
    return text.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(text)
