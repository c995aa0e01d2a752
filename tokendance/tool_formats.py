"""How a model family writes tool calls, as vLLM's tool parsers name them:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Qwen2.5, Qwen3,
  Hermes; the generic format for models whose template knows no tools, SmolLM2 among them);
- `llama3_json`: the reply is the call, `{"name": ..., "parameters": {...}}` (several joined by
  "; "), optionally after `<|python_tag|>` (Llama 3.1-3.3);
- `mistral`: `[TOOL_CALLS]` then a JSON list of `{"name": ..., "arguments": {...}}` (Mistral).

A format is picked from the model's chat template (`detect`) or named with `--tool-call-format`.
It writes the tools' description for the model, an assistant's earlier calls, the grammar of a
forced call, and parses a reply. Calls here are plain `(name, arguments dict)` pairs; turning
them into OpenAI's shape is tools.py's.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from tokendance.structured import regex_escape

Call = tuple[str, dict]  # (name, arguments)

TOOL_CALL_FORMATS = ("hermes", "llama3_json", "mistral")


class ToolFormat:
    name: str
    marker: str | None  # text that starts the calls wherever it appears (None: only the reply's start)

    def preamble(self, functions: list[dict]) -> str:
        raise NotImplementedError

    def render(self, calls: list[tuple[str, object]]) -> str:
        """Earlier calls (arguments a dict, or the string a client sent) as the model writes them."""
        raise NotImplementedError

    def grammar(self, call_schemas: list[dict], parallel: bool, tokens: Mapping[str, int] = {}) -> str:
        """Lark (llguidance) for a reply made of calls, each matching one of `call_schemas`
        (JSON schemas of {name, arguments}); this format's key replaces "arguments". `tokens`: a
        marker the tokenizer has as one added token (Qwen's <tool_call>) -> its id, which the
        grammar then accepts beside the marker's text."""
        raise NotImplementedError

    def parse(self, text: str, names: set[str]) -> tuple[str | None, list[Call]] | None:
        """(content outside the calls or None, calls) of a whole reply; None when it holds no
        call of a known tool in this format."""
        raise NotImplementedError

    def text_grammar(self) -> str:
        """Lark (llguidance) for a reply in words only, that never starts a call: what a request
        with no tools to call (tool_choice "none", or tools gone from a conversation that has
        calls) is held to, so the model answers instead of stopping where it wanted to call."""
        return f"start: TEXT\nTEXT: /(?s:.*)/ & ~/(?s:.*){regex_escape(self.marker)}(?s:.*)/\n"


class Hermes(ToolFormat):
    name, marker = "hermes", "<tool_call>"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)

    def preamble(self, functions: list[dict]) -> str:
        return ("You can call the following tools. To call one, answer with its name and arguments as JSON "
                f"inside {self.OPEN}{self.CLOSE} tags, for example:\n"
                f'{self.OPEN}{{"name": "tool_name", "arguments": {{"arg": "value"}}}}{self.CLOSE}\n'
                "Tools:\n" + _lines(functions))

    def render(self, calls) -> str:
        return "".join(self.OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + self.CLOSE
                       for name, arguments in calls)

    def grammar(self, call_schemas, parallel, tokens={}) -> str:
        calls = " | ".join(f"%json {json.dumps(s)}" for s in call_schemas)
        open_, close = (_literal(marker, tokens) for marker in (self.OPEN, self.CLOSE))
        return f'start: call{"+" if parallel else ""}\ncall: {open_} ({calls}) {close}\n'

    def parse(self, text, names):
        calls, kept, last = [], [], 0
        for match in self.BLOCK.finditer(text):
            call = _call(match.group(1), names, "arguments")
            if call is None:
                continue
            kept.append(text[last:match.start()].rstrip())
            last = match.end()
            while last < len(text) and text[last].isspace():
                last += 1
            calls.append(call)
        if not calls:
            return None
        kept.append(text[last:])
        return "".join(kept) or None, calls


class Llama3Json(ToolFormat):
    name, marker = "llama3_json", None
    PYTHON_TAG = "<|python_tag|>"
    SEPARATOR = "; "

    def preamble(self, functions: list[dict]) -> str:
        return ("Given the following functions, please respond with a JSON for a function call with its proper "
                "arguments that best answers the given prompt.\n\nRespond in the format {\"name\": function name, "
                "\"parameters\": dictionary of argument name and its value}. Do not use variables.\n\n"
                + _lines(functions))

    def render(self, calls) -> str:
        return self.SEPARATOR.join(json.dumps({"name": name, "parameters": arguments}, ensure_ascii=False)
                                   for name, arguments in calls)

    def grammar(self, call_schemas, parallel, tokens={}) -> str:
        calls = " | ".join(f"%json {json.dumps(_renamed(s, 'parameters'))}" for s in call_schemas)
        more = f' ("{self.SEPARATOR}" call)*' if parallel else ""
        return f"start: call{more}\ncall: {calls}\n"

    def text_grammar(self) -> str:  # a call is the whole reply: the reply does not start as one
        return f"start: TEXT\nTEXT: /(?s:.*)/ & ~/\\s*(\\{{|{regex_escape(self.PYTHON_TAG)})(?s:.*)/\n"

    def parse(self, text, names):
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        if not body.startswith("{"):
            return None
        calls, decoder, position = [], json.JSONDecoder(), 0
        while position < len(body):
            try:
                value, end = decoder.raw_decode(body, position)
            except ValueError:
                return None
            call = _call(value, names, "parameters")
            if call is None:
                return None
            calls.append(call)
            position = end
            rest = body[position:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return None
            position = len(body) - len(rest)
        return None, calls


class Mistral(ToolFormat):
    name, marker = "mistral", "[TOOL_CALLS]"

    def preamble(self, functions: list[dict]) -> str:
        return (f"You can call the following tools. To call tools, answer with {self.marker} followed by a JSON list "
                f'of calls, for example:\n{self.marker}[{{"name": "tool_name", "arguments": {{"arg": "value"}}}}]\n'
                "Tools:\n" + _lines(functions))

    def render(self, calls) -> str:
        return self.marker + json.dumps([{"name": name, "arguments": arguments} for name, arguments in calls],
                                        ensure_ascii=False)

    def grammar(self, call_schemas, parallel, tokens={}) -> str:
        calls = " | ".join(f"%json {json.dumps(s)}" for s in call_schemas)
        more = ' (", " call)*' if parallel else ""
        return f'start: "{self.marker}[" call{more} "]"\ncall: {calls}\n'

    def parse(self, text, names):
        start = text.find(self.marker)
        if start < 0:
            return None
        try:
            value = json.loads(text[start + len(self.marker):])
        except ValueError:
            return None
        calls = [_call(item, names, "arguments") for item in (value if isinstance(value, list) else [value])]
        if not calls or None in calls:
            return None
        return text[:start].rstrip() or None, calls


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Hermes(), Llama3Json(), Mistral())}


def detect(chat_template: str | None) -> ToolFormat:
    """The format a chat template's model was trained on: Mistral's marker, Llama 3.1's python tag
    or JSON calls, else hermes (Qwen's own, and the generic one)."""
    template = chat_template or ""
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and '"parameters"' in template):
        return FORMATS["llama3_json"]
    return FORMATS["hermes"]


def _literal(marker: str, tokens: Mapping[str, int]) -> str:
    """A marker in Lark: its text, or its one token where the tokenizer has it (llguidance then
    reads the token as special, never as the text)."""
    return f'("{marker}" | <[{tokens[marker]}]>)' if marker in tokens else f'"{marker}"'


def _lines(functions: list[dict]) -> str:
    return "\n".join(json.dumps(f, ensure_ascii=False) for f in functions)


def _renamed(schema: dict, key: str) -> dict:
    """A call schema with its "arguments" property under another key."""
    properties = {(key if k == "arguments" else k): v for k, v in schema["properties"].items()}
    required = [key if k == "arguments" else k for k in schema["required"]]
    return {**schema, "properties": properties, "required": required}


def _call(value, names: set[str], key: str) -> Call | None:
    """(name, arguments) of a known tool's call written as `value` (JSON text or decoded)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = value.get(key, {})
    return (value["name"], arguments) if isinstance(arguments, dict) else None
