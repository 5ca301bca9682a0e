"""User-facing errors: the CLI prints their message on one line and exits non-zero."""


class UserError(Exception):
    """A mistake in the user's input (config, file, data, arguments), not a bug in moetrain."""


class ConfigError(UserError, ValueError):
    """A configuration error: the message names the key, where it came from, and what is valid."""
