"""Errors a user can act on. Every message says what was wrong and what to do."""


class SpecdecError(Exception):
    """Base class for errors raised by specdec."""


class ModelLoadError(SpecdecError):
    """A model directory is missing, incomplete, corrupt or unsupported."""


class InvalidRequestError(SpecdecError, ValueError):
    """A request (prompt or sampling parameters) cannot be served as given."""


class ConfigError(SpecdecError, ValueError):
    """An engine or speculator setting is out of range or inconsistent."""
