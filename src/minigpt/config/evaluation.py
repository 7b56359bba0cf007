"""`EvalConfig`: `minigpt eval`'s flags (a run, and what to measure of it), checked when it is made, here rather
than beside the evaluation so that the command line reads them before JAX starts."""

from __future__ import annotations

import dataclasses
from typing import Annotated

import tyro

from minigpt.config.training import split_names
from minigpt.runtime.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """Without --tasks or --text: loss and bits per byte on the run's validation split."""

    run: Annotated[str, tyro.conf.arg(help="run directory written by `minigpt train`, or an export file")]
    batches: int = 0
    """Cap on validation batches (0: the whole validation split)."""
    tasks: Annotated[tuple[str, ...], tyro.conf.arg(help_behavior_hint="(default: none)")] = ()
    """lm-evaluation-harness tasks, comma- or space-separated (needs `pip install -e '.[eval]'`)."""
    text: Annotated[tuple[str, ...], tyro.conf.arg(help_behavior_hint="(default: none)")] = ()
    """Text files whose bits per byte to measure (each file one document); a .jsonl file of conversations
    (`messages`, or `prompt`/`completion`) gets the loss on its assistant tokens instead."""
    include_path: str | None = None
    """A folder of your own lm-eval task YAML files, added to lm-eval's tasks."""
    limit: Annotated[float | None, tyro.conf.arg(help_behavior_hint="(default: all)")] = None
    """Examples per task: a count, or a fraction below 1."""
    num_fewshot: Annotated[int | None, tyro.conf.arg(help_behavior_hint="(default: each task's own)")] = None
    """Few-shot examples per prompt."""
    batch_size: int = 32
    """Rows per forward pass for --tasks and --text."""
    tensor: int = 1
    """Split the model over this many devices (tensor parallel); the rest are data parallel."""
    show: int = 0
    """Print the first this-many examples of each --text file of conversations, the assistant's tokens (what
    is scored, and what training on them trains) between ⟦ ⟧, and stop there: no model is loaded."""
    bootstrap_iters: int = 100_000
    """lm-eval's bootstrap resamples for metrics' standard errors (0: none, fastest)."""
    out: Annotated[
        str | None,
        tyro.conf.arg(help_behavior_hint="(default: RUN/evals/tasks-stepN.json, or beside an export file)"),
    ] = None
    """Where to save --tasks results as JSON."""

    def __post_init__(self) -> None:
        if self.batches < 0:
            raise ConfigError(f"--batches must be >= 0 (0: the whole validation split), got {self.batches}")
        if self.show < 0:
            raise ConfigError(f"--show must be >= 0 (0: score, show nothing), got {self.show}")
        if self.batch_size < 1 or self.tensor < 1:
            raise ConfigError("--batch-size and --tensor must be >= 1")
        if self.limit is not None and self.limit <= 0:
            raise ConfigError(f"--limit must be > 0 (a count, or a fraction below 1), got {self.limit}")
        object.__setattr__(self, "tasks", split_names(self.tasks))
