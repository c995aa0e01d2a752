"""Tool calling: a request's `tools` and `tool_choice`, in the model family's call format
(tokendance/tool_formats.py: `hermes`, `llama3_json`, `mistral`).

The tool definitions go into one system message placed first (identical for every agent that has
the same tools, so it is a shared span like any other message) that describes the format, and the
model calls a tool by answering in it, e.g. in the `hermes` format (Qwen's, and the generic one
for models whose template knows no tools, SmolLM2's among them). A hermes template that renders
`tools` itself (Qwen's) is given them instead, with earlier calls as structured `tool_calls`, so
the model reads the prompt it was trained on, the one transformers and vLLM render:

    <tool_call>{"name": "NAME", "arguments": {...}}</tool_call>

(several such blocks for parallel calls). With `tool_choice` "auto" the reply is free and parsed;
with "required" or a named function the reply is grammar-constrained to exactly such calls, so
it always parses. An assistant message's `tool_calls` are written back in the same format, and
`role: "tool"` results are passed to the template as they are.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

from tokendance.tool_formats import FORMATS, Hermes, ToolFormat
from tokendance.structured import JSON_OPTIONS, StructuredOutput

OPEN, CLOSE = Hermes.OPEN, Hermes.CLOSE
HERMES = FORMATS["hermes"]


class ToolError(ValueError):
    """A tools / tool_choice value that cannot be served; the message names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class Tools:
    functions: list[dict]  # {"name", "description", "parameters"} per tool
    choice: str | None  # "auto" | "required" | a function's name (forced)
    format: ToolFormat = field(default=HERMES)

    @classmethod
    def from_request(cls, tools, tool_choice, format: ToolFormat = HERMES) -> Tools | None:
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
        return cls(functions, choice, format)

    @property
    def forced(self) -> bool:
        return self.choice != "auto"

    @property
    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def system_message(self) -> dict:
        return {"role": "system", "content": self.format.preamble(self.functions)}

    def constraint(self, parallel: bool, marker_tokens: Mapping[str, int] = {}) -> StructuredOutput | None:
        """For a forced choice: the reply is one call (or, with `parallel`, several) of the
        allowed tool(s), as a Lark grammar with each call's arguments a JSON schema; a marker the
        tokenizer has as one token (`marker_tokens`, text -> id) may be written as that token."""
        if not self.forced:
            return None
        allowed = [f for f in self.functions if self.choice in ("required", f["name"])]
        schemas = []
        for f in allowed:
            # strict arguments: no properties beyond the declared ones (a small model adds some)
            arguments = {"additionalProperties": False, **f["parameters"]}
            schemas.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": arguments},
                            "required": ["name", "arguments"], "additionalProperties": False,
                            "x-guidance": JSON_OPTIONS})  # compact JSON, as response_format's
        return StructuredOutput(grammar=self.format.grammar(schemas, parallel, marker_tokens))


def render_messages(messages: list[dict], tools: Tools | None, in_template: bool = False) -> list[dict]:
    """Template-ready messages: the tools' system message first (unless the template describes
    the tools itself, `in_template`), assistant tool calls written in the call format."""
    return ([tools.system_message()] if tools and not in_template else []) + messages


def render_tool_calls(tool_calls: list[dict], param: str = "tool_calls", format: ToolFormat = HERMES) -> str:
    """An assistant message's earlier calls in the call format; ToolError if one is malformed."""
    return format.render(_checked_calls(tool_calls, param))


def template_tool_calls(tool_calls: list[dict], param: str = "tool_calls") -> list[dict]:
    """An assistant message's earlier calls for a template that writes them itself (Qwen's):
    OpenAI's form with the arguments as an object, as transformers and vLLM pass them."""
    return [{"type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in _checked_calls(tool_calls, param)]


def template_tools(tools: Tools) -> list[dict]:
    """A request's tools for a template that describes them itself, in OpenAI's form."""
    return [{"type": "function", "function": f} for f in tools.functions]


def _checked_calls(tool_calls: list[dict], param: str) -> list[tuple[str, object]]:
    calls = []
    for i, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ToolError(f'{param}[{i}] must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}',
                            f"{param}.{i}")
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except RecursionError:
            raise ToolError(f"{param}[{i}].function.arguments nests too deeply", f"{param}.{i}.function.arguments") \
                from None
        except ValueError:
            pass  # written back as the string it was
        calls.append((function["name"], arguments))
    return calls


def parse_tool_calls(text: str, tools: Tools) -> tuple[str | None, list[dict]]:
    """(content outside the calls or None, OpenAI tool_calls) of a reply; whitespace next to a
    call is dropped. Text that is not a call of a known tool with object arguments stays content."""
    parsed = tools.format.parse(text, tools.names)
    if parsed is None:
        return text, []
    content, calls = parsed
    return content, [openai_call(name, arguments) for name, arguments in calls]


def tool_call(body: str, tools: Tools) -> dict | None:
    """The OpenAI tool call written in a hermes block's body, or None if it is not a known tool's call."""
    parsed = HERMES.parse(OPEN + body + CLOSE, tools.names)
    return None if parsed is None else openai_call(*parsed[1][0])


def openai_call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}
