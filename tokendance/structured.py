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
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tokendance.errors import InvalidRequestError

# Compact JSON, with the separators models are trained on: free whitespace lets a small model
# wander into endless newlines inside an object.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SPEC_CHARS = 100_000
MAX_REPEAT = 4096  # the largest count in a `{n}` / `{n,m}` repetition (larger ones explode the lexer)
MAX_SCHEMA_DEPTH = 64  # nesting of a JSON schema
_REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


class StructuredOutputError(RuntimeError):
    """A constraint that compiled could not go on while decoding (the request fails alone)."""


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
            if _depth(schema) > MAX_SCHEMA_DEPTH:
                raise InvalidRequestError(f"the JSON schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
            try:  # property order is the output order
                json.dumps(schema, ensure_ascii=False).encode("utf-8")
                object.__setattr__(self, "json", json.dumps(schema, allow_nan=False))
            except UnicodeEncodeError:
                raise InvalidRequestError("the JSON schema is not valid Unicode (it holds a lone surrogate)") from None
            except ValueError:
                raise InvalidRequestError("the JSON schema holds NaN or Infinity, which JSON does not allow") from None
        if self.choice is not None:
            choice = self.choice
            if not isinstance(choice, (list, tuple)) or not choice or not all(isinstance(c, str) and c for c in choice):
                raise InvalidRequestError("choice must be a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(choice))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{name} must be a non-empty string")
        text = self.spec_text()
        if len(text) > MAX_SPEC_CHARS:
            raise InvalidRequestError(f"structured output specification over {MAX_SPEC_CHARS} characters")
        try:
            for piece in self.choice or (text,):
                piece.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError("the structured output specification is not valid Unicode "
                                      "(it holds a lone surrogate)") from None
        counts = [int(n) for match in _REPEAT.finditer(text) for n in match.groups() if n]
        if counts and max(counts) > MAX_REPEAT:
            raise InvalidRequestError(f"a repetition count in the constraint is over {MAX_REPEAT}")

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
            return matcher.grammar_from_regex("|".join(regex_escape(c) for c in self.choice))
        return matcher.grammar_from_lark(self.grammar)


def _depth(value, level: int = 0) -> int:
    """Nesting depth of a JSON value, stopping once it is too deep to matter."""
    if level > MAX_SCHEMA_DEPTH:
        return level
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return max((_depth(child, level + 1) for child in children), default=level)


def regex_escape(text: str) -> str:
    """Escape for llguidance's (Rust) regex syntax: every non-alphanumeric ASCII character but `<`
    and `>` (escaped, they are word boundaries)."""
    return "".join(c if c.isalnum() or not c.isascii() or c in "<>" else "\\" + c for c in text)


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
            raise InvalidRequestError(f"invalid structured output constraint: {_first_line(template.get_error())}")
        probe = template.deep_copy()  # a grammar that allows no first token accepts nothing (or never ends)
        words = torch.zeros((self._tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
        probe.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * 4)
        if probe.is_error() or not bool(words.any()):
            raise InvalidRequestError("the structured output constraint accepts no output "
                                      "(an empty language, or a rule that only refers to itself)")
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
            raise StructuredOutputError(f"the output constraint cannot continue after {self.num_consumed} tokens "
                                        f"({_first_line(self.matcher.get_error())})")

    def consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise StructuredOutputError(f"the output constraint rejected token {token} after {self.num_consumed} "
                                        f"tokens ({_first_line(self.matcher.get_error())})")
        self.num_consumed += 1

    def rollback_to(self, num_consumed: int) -> None:
        if num_consumed < self.num_consumed:
            self.matcher.rollback(self.num_consumed - num_consumed)
            self.num_consumed = num_consumed


def _first_line(error: str) -> str:
    """llguidance's error without the parser state it appends."""
    return error.split("\n", 1)[0].strip()[:120]


BITS = torch.arange(32, dtype=torch.int32)


def allowed_tokens(guides: list[Guide], vocab_size: int) -> torch.Tensor:  # [len(guides), vocab] bool
    words = torch.empty(len(guides), (vocab_size + 31) // 32, dtype=torch.int32)
    for row, guide in enumerate(guides):
        guide.fill_mask(words[row])
    return ((words[:, :, None] >> BITS) & 1).reshape(len(guides), -1)[:, :vocab_size].bool()
