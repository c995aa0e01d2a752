"""Typed errors raised at the engine's edges.

Every error caused by a caller's input is an `InvalidRequestError` (a `ValueError`), so callers can
catch it without knowing the engine; the server maps these classes to OpenAI-style error bodies.
"""


class TokenDanceError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidRequestError(TokenDanceError, ValueError):
    """The request (prompt, sampling values, ...) is invalid; nothing was scheduled. `param`
    names the field at fault when it is a sampling parameter (`SamplingParams`'s name, which the
    server's API shares); None when it is the prompt or the request as a whole, which the caller
    knows better."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ContextLengthError(InvalidRequestError):
    """The prompt (plus the tokens to generate) exceeds the model's context window."""


class CapacityError(InvalidRequestError):
    """The request can never fit in the KV cache, even alone."""


class ModelLoadError(TokenDanceError, ValueError):
    """The model path is missing, is not a model, or holds an unsupported architecture."""


def error_line(exc: BaseException) -> str:
    """What went wrong in one line: our own errors say it themselves; others are named by type."""
    text = " ".join(str(exc).split())
    if isinstance(exc, TokenDanceError):
        return text
    return f"{type(exc).__name__}: {text} (run with --debug for the traceback)"
