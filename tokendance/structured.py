"""Structured output: a request's tokens constrained to a JSON schema, any JSON object, a regular
expression, one of a list of strings, or a Lark grammar.

Grammars are compiled by llguidance against the model's tokenizer; at each step a guided
request's matcher yields a bitmask of the tokens that keep the output inside the grammar (EOS
only once it is complete), the sampler masks the logits with it, and the sampled token advances
the matcher. Constrained and free requests share batches: only guided rows are masked.
"""

from __future__ import annotations

import functools
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tokendance.errors import InvalidRequestError

# Compact JSON, with the separators models are trained on: free whitespace lets a small model
# wander into endless newlines inside an object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SPEC_CHARS = 100_000


@dataclass(frozen=True)
class StructuredOutput:
    """Exactly one constraint. `json` is a JSON schema (a dict, kept as canonical JSON text)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None  # Lark, in llguidance's dialect

    def __post_init__(self) -> None:
        set_fields = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        set_fields += ["json_object"] if self.json_object is True else []
        if len(set_fields) != 1:
            raise InvalidRequestError(f"structured output needs exactly one constraint, got {set_fields or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, dict):
                raise InvalidRequestError("a JSON schema must be a JSON object")
            object.__setattr__(self, "json", json.dumps(schema))  # property order is the output order
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string")
        if len(self.spec_text()) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"structured output specification over {MAX_SPEC_CHARS} characters")

    def spec_text(self) -> str:
        if self.json is not None:
            return self.json
        if self.json_object:
            return '{"type": "object"}'
        if self.choice is not None:
            return json.dumps(list(self.choice))
        return self.regex if self.regex is not None else self.grammar

    @functools.cached_property
    def llguidance_grammar(self) -> str:
        """The constraint as llguidance grammar text, converted once per constraint (a request's
        matcher is made when it is validated and again when it first samples)."""
        import llguidance

        matcher = llguidance.LLMatcher
        if self.json is not None or self.json_object:
            return matcher.grammar_from_json_schema(self.spec_text(), defaults=JSON_OPTIONS)
        if self.regex is not None:
            return matcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return matcher.grammar_from_regex("|".join(_regex_escape(c) for c in self.choice))
        return matcher.grammar_from_lark(self.grammar)


def _regex_escape(text: str) -> str:
    """Escape for llguidance's (Rust) regex syntax: every non-alphanumeric ASCII character."""
    return "".join(c if c.isalnum() or not c.isascii() else "\\" + c for c in text)


class GrammarCompiler:
    """Compiles constraints into llguidance matchers for one tokenizer; compiled grammars are kept
    (LRU) and each request gets a cheap copy. Thread-safe: the server validates on worker threads."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...], capacity: int = 256):
        self._tokenizer = tokenizer
        self._eos = list(eos_token_ids)
        self._capacity = capacity
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self._lltokenizer = None

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher at the start of the grammar. Raises InvalidRequestError if it does not compile."""
        key = spec.llguidance_grammar
        with self._lock:
            template = self._compiled.get(key)
            if template is not None:
                self._compiled.move_to_end(key)
                return template.deep_copy()
        import llguidance

        template = llguidance.LLMatcher(self._llguidance_tokenizer(), key, log_level=0)
        if template.is_error():
            raise InvalidRequestError(f"invalid structured output constraint: {template.get_error()[:300]}")
        with self._lock:
            self._compiled[key] = template
            while len(self._compiled) > self._capacity:
                self._compiled.popitem(last=False)
        return template.deep_copy()

    def _llguidance_tokenizer(self):
        with self._lock:
            if self._lltokenizer is None:
                import llguidance

                self._lltokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend_json(), n_vocab=self._tokenizer.vocab_size, eos_token=self._eos)
            return self._lltokenizer


class Guide:
    """One request's matcher: the tokens allowed next, and the tokens consumed so far."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.num_consumed = 0

    def fill_mask(self, words: torch.Tensor) -> None:
        """The allowed next tokens as bits into `words` (int32, one bit per token id)."""
        self.matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if self.matcher.is_error():
            raise RuntimeError(f"structured output failed: {self.matcher.get_error()[:300]}")

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"structured output rejected token {token}: {self.matcher.get_error()[:300]}")
        self.num_consumed += 1

    def rollback_to(self, num_consumed: int) -> None:
        if num_consumed < self.num_consumed:
            self.matcher.rollback(self.num_consumed - num_consumed)
            self.num_consumed = num_consumed


BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(guides: list[Guide], vocab_size: int) -> torch.Tensor:  # [len(guides), vocab] bool
    words = torch.empty(len(guides), (vocab_size + 31) // 32, dtype=torch.int32)
    for row, guide in enumerate(guides):
        guide.fill_mask(words[row])
    return ((words[:, :, None] >> BITS) & 1).reshape(len(guides), -1)[:, :vocab_size].bool()
