"""Which config fields a resumed run may change: declared beside each field (`resume_safe`), read by
`codec.config_changes`, which refuses a resume that changes any other."""

from __future__ import annotations

import dataclasses
from typing import Any

_RESUME_SAFE = "minigpt.resume_safe"


def resume_safe(default: Any) -> Any:
    """Declare a config field a resumed run may change (bookkeeping, run length, device layout): a dataclass
    field with this default. Unmarked fields are unsafe: changing one on resume is refused by
    `config_changes`, since it would silently change the run."""
    return dataclasses.field(default=default, metadata={_RESUME_SAFE: True})


def is_resume_safe(field: dataclasses.Field) -> bool:
    return bool(field.metadata.get(_RESUME_SAFE, False))
