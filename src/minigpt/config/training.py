"""A training run's whole configuration: `TrainConfig`, which tyro turns into `minigpt train`'s flags
(`--model.d-model 384`). Values are checked when a config is built, so a bad flag fails before any data is
read or any array is allocated."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from minigpt.config.data import DataConfig
from minigpt.config.fields import resume_safe
from minigpt.config.model import ModelConfig
from minigpt.config.run import DistributedConfig, MeshConfig, WandbConfig
from minigpt.optim.optimizer import AdamW, CosineDecaySchedule, Optimizer, Schedule
from minigpt.runtime.errors import ConfigError, check


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs. `minigpt train --preset cpu --steps 500 --run-dir runs/a`."""

    run_dir: str = resume_safe("runs/default")
    """Where config, metrics, plots and checkpoints go; training there again resumes from the newest checkpoint."""
    overwrite: bool = resume_safe(False)
    """Start from scratch, deleting the run directory's checkpoints, metrics and samples."""
    init_from: str | None = None
    """Start from these weights rather than random ones: a transformers checkpoint folder (its model and
    tokenizer are the run's) or a minigpt run directory (its newest checkpoint). The run's own model flags keep
    only how it computes (dtype, attention, remat, scan, loss chunk, dropout); the default preset is then
    finetune."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = resume_safe(MeshConfig())
    dist: DistributedConfig = resume_safe(DistributedConfig())
    optimizer: Optimizer = AdamW(weight_decay=0.1)
    schedule: Schedule = CosineDecaySchedule(warmup_steps=100, peak_lr=1e-3, decay_lr=1e-4)
    """The learning-rate schedule; one whose length is 0 (the default) ends with the run, at --steps or at the
    step --max-time lays out."""
    steps: int = resume_safe(2000)
    """The run's length in optimizer steps (with --max-time: at most this many)."""
    batch_size: int = 32
    """Global batch size in sequences, split over the mesh's data and FSDP axes."""
    grad_accum: int | Literal["auto"] = 1
    """Micro-batches per optimizer update; each micro-batch has batch_size sequences. auto: batch_size is the
    sequences per update, split into the fewest micro-batches that fit the devices' memory by `minigpt plan`
    (resolved to ints when training starts, and saved as such)."""
    seed: int = 0
    max_time: float = resume_safe(0.0)
    """A training-time budget in seconds, not counting evaluation and saving (0: none; a finite number, so not
    inf). The step time is measured over the first steps and the run's length fixed then (at most --steps), so
    the schedule ends fully decayed when the budget does; the length is saved with each checkpoint, and a
    resumed run keeps it."""
    max_epochs: float = resume_safe(3.0)
    """With --max-time: the run ends by the time it has read its training text this many times, however long
    the budget (its schedule decays to that end), since repeating a small corpus more often makes the model
    worse, the sooner the weaker its weight decay (--weight-decay-passes); 0: no limit. A corpus tokenized
    only as far as the run reads never binds it."""
    weight_decay_passes: float = 0.0
    """A run from scratch raises its optimizer's weight decay to at least 1 / (peak lr x the steps of this
    many passes over the training text): what the weights learn fades within that many passes, so a small
    corpus read again and again is not memorised (0: the optimizer's weight decay alone)."""
    average_weights: float = resume_safe(0.0)
    """Keep an average of the weights over this last fraction of the run's steps, each step weighted by its
    number in it (later ones more), and end with it where it evaluates better than the last weights (0: off)."""
    log_every: int = resume_safe(10)
    eval_every: int = resume_safe(200)
    """Evaluate (and print a sample) every this many steps; 0: only at the end of the run."""
    eval_batches: int = resume_safe(0)
    """Cap on validation batches per evaluation (0: the whole validation split, deterministically)."""
    eval_tasks: tuple[str, ...] = resume_safe(())
    """lm-evaluation-harness tasks to score during training, comma- or space-separated (e.g. hellaswag
    lambada_openai; `pip install -e '.[eval]'`): their metrics go to metrics.jsonl, TensorBoard and the plot."""
    eval_tasks_every: int = resume_safe(0)
    """Score --eval-tasks every this many steps; 0: only at the end of the run."""
    eval_tasks_limit: float = resume_safe(0.0)
    """Examples per task at each scoring: a count, or a fraction below 1 (0: all of them)."""
    eval_tasks_include_path: str | None = resume_safe(None)
    """A folder of your own lm-eval task YAML files, for --eval-tasks to name."""
    ckpt_every: int = resume_safe(500)
    """Save a checkpoint every this many steps; 0: only at the end (and when stopped by a signal)."""
    keep_checkpoints: int = resume_safe(3)
    sample_prompt: str = resume_safe("")
    """What the samples printed at each evaluation continue; empty: the opening words of a validation document."""
    sample_tokens: int = resume_safe(120)
    """Tokens of the sample printed at each evaluation; 0: no samples."""
    profile_steps: str = resume_safe("")
    """Trace steps START:END (0-based, END excluded) with jax.profiler into run_dir/tb, for TensorBoard's
    profile plugin or XProf (e.g. 10:15). Empty: no trace."""
    peak_tflops: float = resume_safe(0.0)
    """Peak TFLOP/s per device for the MFU in the log (0: known accelerators' vendor figure; CPUs: measured)."""
    wandb: WandbConfig = resume_safe(WandbConfig())
    """Optional Weights & Biases tracking (--wandb.project NAME); may change when a run is resumed."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "log_every"):
            check(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        for name in ("eval_every", "ckpt_every"):
            check(
                getattr(self, name) >= 0,
                f"{name} must be >= 0 (0: only at the end), got {getattr(self, name)}",
            )
        check(
            self.grad_accum == "auto" or (isinstance(self.grad_accum, int) and self.grad_accum > 0),
            f"grad_accum must be positive or 'auto', got {self.grad_accum!r}",
        )
        check(self.keep_checkpoints >= 1, f"keep_checkpoints must be >= 1, got {self.keep_checkpoints}")
        check(
            math.isfinite(self.max_time) and self.max_time >= 0,
            f"max_time must be a number of seconds >= 0 (0: no budget), got {self.max_time}",
        )
        check(
            math.isfinite(self.max_epochs) and self.max_epochs >= 0,
            f"max_epochs must be a number of passes over the training text >= 0 (0: no limit), got {self.max_epochs}",
        )
        check(
            math.isfinite(self.weight_decay_passes) and self.weight_decay_passes >= 0,
            f"weight_decay_passes must be a number of passes >= 0 (0: off), got {self.weight_decay_passes}",
        )
        check(
            0 <= self.average_weights < 1,
            f"average_weights must be a fraction of the run in [0, 1) (0: off), got {self.average_weights}",
        )
        check(self.eval_batches >= 0, f"eval_batches must be >= 0, got {self.eval_batches}")
        check(
            self.sample_tokens >= 0, f"sample_tokens must be >= 0 (0: no samples), got {self.sample_tokens}"
        )
        object.__setattr__(self, "eval_tasks", split_names(self.eval_tasks))
        check(
            self.eval_tasks_every >= 0,
            f"eval_tasks_every must be >= 0 (0: only at the end), got {self.eval_tasks_every}",
        )
        check(
            self.eval_tasks_limit >= 0,
            f"eval_tasks_limit must be >= 0 (a count, a fraction below 1, or 0 for all), got {self.eval_tasks_limit}",
        )
        check(self.peak_tflops >= 0, f"peak_tflops must be >= 0, got {self.peak_tflops}")
        parse_steps_window(self.profile_steps)
        if not (self.data.seq_len or self.init_from):  # 0: the model's context (the source's: `with_initial`)
            object.__setattr__(self, "data", dataclasses.replace(self.data, seq_len=self.model.max_seq_len))
        check(
            self.data.seq_len <= self.model.max_seq_len
            or bool(self.init_from),  # the source's context caps it
            f"data.seq_len={self.data.seq_len} exceeds model.max_seq_len={self.model.max_seq_len}; "
            "lower --data.seq-len or raise --model.max-seq-len",
        )

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer update trains on: batch_size x grad_accum windows of seq_len targets."""
        if self.grad_accum == "auto":  # only `memory.resolve_grad_accum` knows the split
            raise ConfigError(
                "grad_accum 'auto' must be resolved (memory.resolve_grad_accum) before it is used"
            )
        return self.batch_size * self.grad_accum * self.data.seq_len

    @property
    def profile_window(self) -> tuple[int, int] | None:
        """The steps `profile_steps` names, as (start, end), or None for no trace."""
        return parse_steps_window(self.profile_steps)


def parse_steps_window(text: str) -> tuple[int, int] | None:
    """'10:15' -> (10, 15): the steps with 0-based index 10..14 (half-open, like a Python slice); '' -> None."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    check(
        bool(sep) and start.strip().isdigit() and end.strip().isdigit() and int(start) < int(end),
        f"profile_steps must be START:END with 0 <= START < END, got {text!r}",
    )
    return int(start), int(end)


def split_names(items: tuple[str, ...]) -> tuple[str, ...]:
    """Names given comma- or space-separated (`--tasks a,b c` -> ('a', 'b', 'c')), empty ones dropped."""
    return tuple(name for item in items for name in item.split(",") if name)
