"""The error a user's mistake raises. A leaf module: every other module, `optimizer.py` included, may import it."""


class ConfigError(Exception):
    """A user-facing mistake (bad flag, bad input file). The CLI prints it as one line.

    Deliberately not a ValueError: tyro turns a ValueError raised while it builds a config from flags into its
    own multi-line box, but lets other exceptions through, so a config's `__post_init__` check reaches the
    CLI's one-line handler."""


def check(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless `ok`: one rule of a config's validation."""
    if not ok:
        raise ConfigError(message)
