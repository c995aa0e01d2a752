"""Tokenizer and chat template, built from GGUF metadata or a Hugging Face folder."""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from datetime import datetime

import jinja2
import jinja2.sandbox
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from tokendance.errors import ModelLoadError
from tokendance.round_core.spans import Boundaries

GGUF_CONTROL_TOKEN = 3  # llama.cpp token type of special (control) tokens
GGUF_USER_DEFINED_TOKEN = 4  # added tokens that are text, e.g. Qwen's <tool_call>: matched whole, kept in decoding

# Fallback when a model carries no chat template: ChatML, the format SmolLM2 was trained on.
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ChatTokenizer:
    """Text <-> token ids, plus the model's chat template.

    Special tokens (e.g. `<|im_start|>`) written in text are encoded as single ids, so a rendered
    chat template tokenizes to what the model was trained on.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        chat_template: str | None,
        bos_token: str | None,
        eos_token: str | None,
    ):
        self._tokenizer = tokenizer
        # As transformers renders chat templates: loop controls, a `tojson` that does not escape
        # HTML and takes json.dumps' options, `strftime_now` (Llama 3.x templates date the prompt).
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                           extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_template_error
        env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
        self.chat_template = chat_template or CHATML_TEMPLATE  # the source, e.g. to pick a tool-call format
        self._template = env.from_string(self.chat_template)
        self.bos_token = bos_token
        self.eos_token = eos_token

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """An upper bound on the characters one token covers (a vocabulary entry's spelling is at
        least as long as the text it stands for: bytes for byte-level BPE, `<|im_start|>` itself
        for special tokens): a text of n characters has at least n / this many tokens."""
        return max(map(len, self._tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The tokenizer as `tokenizers` JSON (what grammar libraries load)."""
        return self._tokenizer.to_str()

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    @functools.cached_property
    def boundaries(self) -> Boundaries:
        """The ids that cut a prompt into spans from its ids alone (`round_core.spans.cut_spans`, as
        the vLLM plugin cuts them): those holding a line break, and the special tokens."""
        line_breaks = frozenset(i for i in range(self.vocab_size) if "\n" in self.decode([i], skip_special_tokens=False))
        added = self._tokenizer.get_added_tokens_decoder()
        return Boundaries(line_breaks, frozenset(i for i, token in added.items() if token.special))

    @functools.cached_property
    def knows_tools(self) -> bool:
        """Whether the chat template renders a request's `tools` itself (Qwen's does; SmolLM2's
        knows none)."""
        import jinja2.meta

        return "tools" in jinja2.meta.find_undeclared_variables(self._template.environment.parse(self.chat_template))

    def apply_chat_template(
        self, messages: Sequence[dict], add_generation_prompt: bool = True, tools: Sequence[dict] | None = None
    ) -> str:
        """The template rendered as transformers renders it; `tools` (OpenAI's form) are passed to a
        template that knows them."""
        return self._template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **({"tools": list(tools)} if tools else {}),
        )


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)


# GGUF `tokenizer.ggml.pre` -> the split before byte-level BPE, as the models' tokenizer.json have it.
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
GGUF_PRE_TOKENIZERS = ("default", "gpt-2", "smollm", "llama-bpe", "qwen2")


def tokenizer_from_gguf_metadata(
    tokens: Sequence[str],
    token_types: Sequence[int],
    merges: Sequence[str],
    pre_tokenizer: str | None,
) -> Tokenizer:
    """A byte-level BPE tokenizer ("gpt2" in GGUF terms) from the vocabulary stored in the file."""

    vocab = {token: index for index, token in enumerate(tokens)}
    merge_pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_tokenizer == "smollm":  # SmolLM splits every digit on its own before byte-level BPE
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre_tokenizer in ("llama-bpe", "qwen2"):
        pattern = Regex(LLAMA3_SPLIT if pre_tokenizer == "llama-bpe" else QWEN2_SPLIT)
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(pattern, behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    elif pre_tokenizer in (None, "default", "gpt-2"):
        tokenizer.pre_tokenizer = byte_level
    else:
        raise ModelLoadError(f"GGUF pre-tokenizer {pre_tokenizer!r} is not supported ({', '.join(GGUF_PRE_TOKENIZERS)}): "
                             "load the model's Hugging Face folder instead, which has its tokenizer.json")
    tokenizer.decoder = decoders.ByteLevel()
    specials = [
        AddedToken(token, special=True, normalized=False)
        for token, kind in zip(tokens, token_types)
        if kind == GGUF_CONTROL_TOKEN
    ]
    tokenizer.add_special_tokens(specials)
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False)
                          for token, kind in zip(tokens, token_types) if kind == GGUF_USER_DEFINED_TOKEN])
    return tokenizer
