"""`EngineConfig`: how many requests `minigpt serve` decodes at once and how it reads prompts (--engine.*),
here rather than beside the engine so that the command line reads these flags before JAX starts."""

from __future__ import annotations

import dataclasses

from minigpt.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How many requests decode at once and how prompts are read (`minigpt serve`'s --engine.* flags)."""

    slots: int = 32
    """Requests decoded at once: the rows of the key/value cache (each max_seq_len tokens)."""
    prefill_chunk: int = 256
    """Prompt tokens read per call between two decode steps, over all the prompts being read."""
    max_queue: int = 256
    """Requests waiting for a row beyond which new ones are refused (the server answers 429)."""

    def __post_init__(self) -> None:
        if self.slots < 1 or self.max_queue < 0:
            raise ConfigError(f"slots must be >= 1 and max_queue >= 0, got {self.slots} and {self.max_queue}")
        if self.prefill_chunk < 16 or self.prefill_chunk & (self.prefill_chunk - 1):
            raise ConfigError(f"prefill_chunk must be a power of two >= 16, got {self.prefill_chunk}")
