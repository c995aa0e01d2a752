"""Tool calling over models whose chat template knows no tools (SmolLM2's ChatML among them).

The generic format, documented in the README: the tool definitions go into one system message
placed first (identical for every agent that has the same tools, so it is a shared span like any
other message), and the model calls a tool by answering

    <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>

(several such blocks for parallel calls). With `tool_choice` "auto" the reply is free and parsed;
with "required" or a named function the reply is grammar-constrained to exactly such blocks, so
it always parses. An assistant message's `tool_calls` are written back in the same format, and
`role: "tool"` results are passed to the template as they are.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from tokendance.structured import JSON_OPTIONS, StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
PREAMBLE = (
    "You can call the following tools. To call one, answer with its name and arguments as JSON "
    f"inside {OPEN}{CLOSE} tags, for example:\n"
    f'{OPEN}{{"name": "tool_name", "arguments": {{"arg": "value"}}}}{CLOSE}\n'
    "Tools:\n"
)


class ToolError(ValueError):
    """A tools / tool_choice value that cannot be served; the message names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Tools:
    functions: list[dict]  # {"name", "description", "parameters"} per tool
    choice: str | None  # "auto" | "required" | a function's name (forced)

    @classmethod
    def from_request(cls, tools, tool_choice) -> Tools | None:
        """None when the request has no tools or `tool_choice` is "none"."""
        if tool_choice is not None and not (tool_choice in ("none", "auto", "required") or isinstance(tool_choice, dict)):
            raise ToolError('tool_choice must be "none", "auto", "required" or {"type": "function", ...}',
                            "tool_choice")
        if not tools or tool_choice == "none":
            if isinstance(tool_choice, dict) or tool_choice == "required":
                raise ToolError("tool_choice names a tool but the request has no tools", "tool_choice")
            return None
        functions = []
        for i, tool in enumerate(tools):
            function = tool.get("function") if isinstance(tool, dict) else None
            if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
                raise ToolError(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', f"tools.{i}")
            name = function.get("name")
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
                raise ToolError(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-'",
                                f"tools.{i}.function.name")
            parameters = function.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(parameters, dict):
                raise ToolError(f"tools[{i}].function.parameters must be a JSON schema object",
                                f"tools.{i}.function.parameters")
            functions.append({"name": name, "description": function.get("description", ""),
                              "parameters": parameters})
        names = [f["name"] for f in functions]
        if len(set(names)) != len(names):
            raise ToolError("tool names must be distinct", "tools")
        try:
            json.dumps(functions, ensure_ascii=False, allow_nan=False).encode("utf-8")
        except (ValueError, UnicodeEncodeError):
            raise ToolError("tools must be valid JSON in valid Unicode (no NaN, Infinity or lone surrogates)",
                            "tools") from None
        choice = tool_choice or "auto"
        if isinstance(choice, dict):
            function = choice.get("function") if choice.get("type") == "function" else None
            name = function.get("name") if isinstance(function, dict) else None
            if not isinstance(name, str) or name not in names:
                raise ToolError("tool_choice names no tool of this request", "tool_choice")
            choice = name
        return cls(functions, choice)

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    def system_message(self) -> dict:
        lines = [json.dumps(f, ensure_ascii=False) for f in self.functions]
        return {"role": "system", "content": PREAMBLE + "\n".join(lines)}

    def constraint(self, parallel: bool) -> StructuredOutput | None:
        """For a forced choice: the reply is one call (or, with `parallel`, several) of the
        allowed tool(s), as a Lark grammar with each call's arguments a JSON schema."""
        if not self.forced:
            return None
        allowed = [f for f in self.functions if self.choice in ("required", f["name"])]
        calls = []
        for f in allowed:
            # strict arguments: no properties beyond the declared ones (a small model adds some)
            arguments = {"additionalProperties": False, **f["parameters"]}
            schema = {"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": arguments},
                      "required": ["name", "arguments"], "additionalProperties": False,
                      "x-guidance": JSON_OPTIONS}  # compact JSON, as response_format's
            calls.append(f"%json {json.dumps(schema)}")
        call = f'"{OPEN}" ({" | ".join(calls)}) "{CLOSE}"'
        return StructuredOutput(grammar=f"start: call{'+' if parallel else ''}\ncall: {call}\n")


def render_messages(messages: list[dict], tools: Tools | None) -> list[dict]:
    """Template-ready messages: the tools' system message first, assistant tool calls written in
    the call format."""
    return ([tools.system_message()] if tools else []) + messages


def render_tool_calls(tool_calls: list[dict], param: str = "tool_calls") -> str:
    """An assistant message's earlier calls in the call format; ToolError if one is malformed."""
    parts = []
    for i, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolError(f'{param}[{i}] must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}',
                            f"{param}.{i}")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass  # written back as the string it was
        parts.append(OPEN + json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
                     + CLOSE)
    return "".join(parts)


def parse_tool_calls(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """(content outside the calls or None, OpenAI tool_calls) of a reply; whitespace next to a
    call is dropped. A block that is not a call of a known tool with object arguments stays in
    the content."""
    calls, kept, last = [], [], 0
    for match in CALL.finditer(text):
        call = tool_call(match.group(1), tools)
        if call is None:
            continue
        kept.append(text[last:match.start()].rstrip())
        last = match.end()
        while last < len(text) and text[last].isspace():
            last += 1
        calls.append(call)
    kept.append(text[last:])
    content = "".join(kept)
    return (content or None) if calls else text, calls


def tool_call(body: str, tools: Tools) -> dict | None:
    """The OpenAI tool call written in a block's body, or None if it is not a known tool's call."""
    try:
        call = json.loads(body)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in {f["name"] for f in tools.functions}:
        return None
    if not isinstance(call.get("arguments", {}), dict):
        return None
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}}
