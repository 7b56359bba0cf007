"""`SamplingConfig`: how `generate` and `chat` sample (`--temperature`, `--top-k`, ...), checked when it is made,
here rather than beside the sampler so that the command line reads these flags before JAX starts."""

from __future__ import annotations

import dataclasses
import math

from minigpt.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
    """How to sample continuations; the defaults suit a small model's stories. Impossible settings are refused
    on construction, in one line, before any compilation."""

    num_samples: int = 1
    """Samples per prompt."""
    max_new_tokens: int = 200
    """New tokens per sample at most (fewer at end-of-text or when the context is full)."""
    temperature: float = 0.8
    """0 is greedy decoding."""
    top_k: int = 40
    """Sample among the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Nucleus sampling: among the most likely tokens whose probability reaches p, in (0, 1] (1: all)."""
    seed: int = 0
    """The same seed gives the same samples, whatever else is in the batch."""

    def __post_init__(self) -> None:
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (0: all tokens), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1] (1: all tokens), got {self.top_p}")
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.num_samples < 1:
            raise ConfigError(f"num_samples must be >= 1, got {self.num_samples}")
