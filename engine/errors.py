"""Errors the engine raises for bad input, each with a message that says what is wrong."""

from __future__ import annotations


class EngineError(Exception):
    """Base class for errors caused by the caller's input or files, not by a bug."""


class UnsupportedModelError(EngineError):
    """The checkpoint's architecture or a setting of it is not supported."""


class CheckpointError(EngineError):
    """A checkpoint file is missing, corrupt, or holds tensors of the wrong shape."""


class InvalidRequestError(EngineError, ValueError):
    """A prompt or sampling parameter cannot be served (empty, too long, out of range)."""
