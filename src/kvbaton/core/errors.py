"""Error types that carry a message meant for the person who sent the bad input."""


class KvbatonError(Exception):
    """Base class for every error kvbaton raises on purpose; its message is shown to the user."""


class InvalidRequestError(KvbatonError, ValueError):
    """A request or parameter is malformed or out of range (HTTP 400)."""


class ModelNotFoundError(KvbatonError, LookupError):
    """A model name is neither built in nor a readable local path (HTTP 404)."""


class UnsupportedModelError(KvbatonError):
    """A checkpoint exists but its architecture, tensor type or layout is not supported."""


class CapacityError(KvbatonError):
    """The engine cannot hold this request at all (e.g. it needs more KV blocks than exist)."""
