"""LoRA's settings (`--lora.*`): which projections get low-rank adapters, of what rank and scale."""

from __future__ import annotations

import dataclasses

from minigpt.runtime.errors import check

LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
"""The projections LoRA may adapt: attention's q, k, v, o and the MLP's gate, up, down (transformers'
q_proj ... down_proj)."""


@dataclasses.dataclass(frozen=True)
class LoRAConfig:
    """Low-rank adapters (LoRA): the model's weights frozen, and beside each targeted projection W a trained
    A (in x rank) and B (rank x out), so that it computes x @ W + alpha / rank * dropout(x) @ A @ B."""

    rank: int = 0
    """The adapters' rank; 0: no adapters, every parameter trains."""
    alpha: float = 16.0
    """The adapters' output is scaled by alpha / rank, as PEFT scales it."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training."""
    targets: tuple[str, ...] = ()
    """The projections to adapt, of q k v o gate up down; empty: every one the model has."""

    def __post_init__(self) -> None:
        check(self.rank >= 0, f"lora.rank must be >= 0 (0: no adapters), got {self.rank}")
        check(self.alpha > 0, f"lora.alpha must be positive, got {self.alpha}")
        check(0.0 <= self.dropout < 1.0, f"lora.dropout must be in [0, 1), got {self.dropout}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        check(
            not unknown,
            f"lora.targets: {unknown[0] if unknown else ''!r} is none of {' '.join(LORA_TARGETS)}",
        )

    def adapts(self, name: str) -> bool:
        return self.rank > 0 and (not self.targets or name in self.targets)
