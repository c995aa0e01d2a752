"""`tokendance_hermes`: vLLM's hermes tool parser, holding a forced call to the compact shape
`tokendance serve` forces, and keeping the complete calls of a reply cut at max_tokens.

Loaded only inside vLLM (`register` names it lazily): `vllm serve ... --enable-auto-tool-choice
--tool-call-parser tokendance_hermes`. Two things in vLLM 0.32's hermes parser cost a small model
its calls (SmolLM2-135M in OASIS, tool_choice "required"):

- its grammar offers each call also as `<tool_call>\\n{"name": ...` with unbounded whitespace in
  the arguments; the model takes that variant, pretty-prints and runs on to max_tokens;
- a reply whose last block is unfinished fails json.loads as a whole, so no call is returned even
  where an earlier block was complete.

Streaming keeps vLLM's own: it sends each call as it is written, so a cut reply's complete calls
have reached the client already (the unfinished one has too, as far as it got).
"""

from __future__ import annotations

import json

from vllm.entrypoints.generate.base.protocol import ExtractedToolCallInformation, FunctionCall, ToolCall
from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from vllm.tool_parsers.tool_strict_level import ToolStrictLevel

# At most one whitespace character in a row inside the arguments (xgrammar rejects 0): `{"a": 1}`
# and `{"a": 1, "b": 2}` stay possible, an indented line does not.
MAX_WHITESPACE = 1


class CompactHermesToolParser(Hermes2ProToolParser):
    """Compact hermes calls: every tag of the structural tag begins `<tool_call>{` and caps the
    whitespace of its arguments; a block that holds no call (an unfinished last one) is dropped
    alone, not with the whole reply."""

    def get_structural_tag(self, request, *, reasoning: bool = False,
                           strict_level: ToolStrictLevel = ToolStrictLevel.AUTO):
        tag = super().get_structural_tag(request, reasoning=reasoning, strict_level=strict_level)
        tags = getattr(tag.format, "tags", None) if tag is not None else None  # none: free text (auto)
        if tags:
            # the same structural tag model ("hermes"), without the begins that open a new line
            tag.format.tags = [t for t in tags if not t.begin.startswith(self.tool_call_start_token + "\n")]
            for t in tag.format.tags:
                t.content.max_whitespace_cnt = MAX_WHITESPACE
        return tag

    def extract_tool_calls(self, model_output: str, request) -> ExtractedToolCallInformation:
        """As vLLM's hermes parser (content: the text before the first block), but per block."""
        calls = [call for closed, open_ in self.tool_call_regex.findall(model_output)
                 if (call := tool_call(closed or open_)) is not None]
        if not calls:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        content = model_output[:model_output.find(self.tool_call_start_token)]
        return ExtractedToolCallInformation(tools_called=True, tool_calls=calls, content=content or None)


def tool_call(block: str) -> ToolCall | None:
    """The call in a block's text, or None where it holds none."""
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        return None
    return ToolCall(type="function", function=FunctionCall(
        name=call["name"], arguments=json.dumps(call["arguments"], ensure_ascii=False)))
