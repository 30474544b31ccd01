"""The engine's error vocabulary. The server maps these to HTTP status codes in one place and
the CLI prints ``str(err)`` as one line on stderr with exit code 2."""
from __future__ import annotations


class EngineError(Exception):
    """Base class; ``http_status`` is the status the server answers with."""

    http_status = 500
    code = "engine_error"


class ConfigError(EngineError):
    """A bad model folder, option or configuration, found before any work starts."""

    http_status = 400
    code = "invalid_config"


class InvalidRequest(EngineError):
    """A request the engine cannot run as given (bad token id, bad sampling value)."""

    http_status = 400
    code = "invalid_request_error"


class RequestTooLong(InvalidRequest):
    """Prompt plus requested tokens exceed the model's context."""

    http_status = 413
    code = "context_length_exceeded"


class QueueFull(EngineError):
    """The scheduler's waiting queue is full; retry after ``retry_after`` seconds."""

    http_status = 429
    code = "queue_full"

    def __init__(self, message: str, retry_after: float = 1.0):
        super().__init__(message)
        self.retry_after = retry_after


class OutOfKVCache(EngineError):
    """The paged KV pool cannot hold this request even when it runs alone."""

    http_status = 413
    code = "out_of_kv_cache"


class NonFiniteLogits(EngineError):
    """The model produced NaN or infinite logits for a request (a broken checkpoint, or fp16
    overflow): that request ends with this error instead of random or repeated tokens; the
    others go on."""

    http_status = 500
    code = "non_finite_logits"
