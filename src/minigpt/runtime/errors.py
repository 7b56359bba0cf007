"""The error a user's mistake raises, the warning for input used anyway, and a failed save. A leaf module: every
other module may import it, the command line before JAX starts among them."""


class ConfigError(Exception):
    """A user-facing mistake (bad flag, bad input file). The CLI prints it as one line.

    Deliberately not a ValueError: tyro turns a ValueError raised while it builds a config from flags into its
    own multi-line box, but lets other exceptions through, so a config's `__post_init__` check reaches the
    CLI's one-line handler."""


def check(ok: bool, message: str) -> None:
    """Raise ConfigError(message) unless `ok`: one rule of a config's validation."""
    if not ok:
        raise ConfigError(message)


class DataWarning(UserWarning):
    """Input that was used anyway, but probably not as intended (replaced bytes, huge documents): one line."""


class CheckpointSaveError(RuntimeError):
    """Writing a checkpoint failed (disk full, permissions); the earlier checkpoints are untouched."""
