"""Typed errors raised at the engine's edges.

Every error caused by a caller's input is an `InvalidRequestError` (a `ValueError`), so callers can
catch it without knowing the engine; the server maps these classes to OpenAI-style error bodies.
"""


class TokenDanceError(Exception):
    """Base class of every error this package raises on purpose."""


class InvalidRequestError(TokenDanceError, ValueError):
    """The request (prompt, sampling values, ...) is invalid; nothing was scheduled."""


class ContextLengthError(InvalidRequestError):
    """The prompt (plus the tokens to generate) exceeds the model's context window."""


class CapacityError(InvalidRequestError):
    """The request can never fit in the KV cache, even alone."""


class ModelLoadError(TokenDanceError, ValueError):
    """The model path is missing, is not a model, or holds an unsupported architecture."""
