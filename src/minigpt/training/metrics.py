"""Bits per byte, FLOPs, and where metrics go: console, metrics.jsonl, TensorBoard, loss.png."""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import secrets
import sys
import threading
import warnings
from pathlib import Path
from typing import Any

from minigpt.config import ModelConfig, TrainConfig, WandbConfig, to_dict
from minigpt.runtime import files
from minigpt.runtime.errors import ConfigError, DataWarning


def bits_per_byte(nll_nats: float, n_bytes: float) -> float:
    """Summed negative log-likelihood (nats) over the UTF-8 bytes those tokens encode, in bits.

    Unlike loss per token, this does not depend on the tokenizer, so runs with different vocabularies compare.
    """
    return nll_nats / math.log(2) / n_bytes


# ---------------------------------------------------------------------------------------------------------
# FLOPs and MFU
#
# Convention (as in PaLM's appendix B and nanoGPT's estimate_mfu, with the causal saving counted): *model*
# FLOPs, the arithmetic the model needs, not what the hardware happens to execute.
# - A matmul of (m, k) @ (k, n) is 2*m*k*n FLOPs: one multiply and one add per multiply-add.
# - Backward is twice forward (the gradient with respect to the input and to the weight are one matmul each),
#   so a training step is 3x the forward pass. Rematerialisation, if any, is not counted.
# - Per token and layer, the forward pass does: q, k, v and output projections 4 * 2*d*d; MLP up and down
#   2 * 2*d*d_ff; attention scores Q K^T and the weighted sum A V 2 * 2*d*(keys attended). With the causal
#   mask, query t of a window of T attends to t + 1 keys, (T + 1) / 2 on average: about half the full T.
# - The output layer (lm_head, or the tied embedding) is 2*d*padded_vocab: the padded columns are computed.
# - The embedding lookup is a gather, not a matmul, and counts nothing; nor do biases, norms, activations,
#   softmax, the loss or the optimizer update (together a few percent for the shapes we train).
# MFU = model FLOPs per second achieved / (devices x peak FLOPs per device), the peak being the fastest matmul
# the device offers, whatever dtype the model computes in (`hardware.peak`).
# ---------------------------------------------------------------------------------------------------------


def forward_flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> dict[str, float]:
    """Forward-pass FLOPs per token by part (see the convention above). `causal=False` counts the full T x T
    attention a kernel without block skipping (XLA's own `dot_product_attention` on CPU) actually computes."""
    d, f, layers = cfg.d_model, cfg.d_ff, cfg.n_layers
    keys = (seq_len + 1) / 2 if causal else seq_len
    q = cfg.n_heads * cfg.head_size  # d_model unless model.head_dim says otherwise
    kv = cfg.kv_heads * cfg.head_size  # grouped-query attention: narrower k and v projections
    mlp_matrices = 3 if cfg.activation == "swiglu" else 2  # SwiGLU's gate is a third matrix
    return {
        "attn_proj": layers * 2 * (2 * d * q + 2 * d * kv),
        "mlp": layers * mlp_matrices * 2 * d * f,
        "attention": layers * 2 * 2 * q * keys,
        "lm_head": 2 * d * cfg.padded_vocab,
    }


def flops_per_token(cfg: ModelConfig, seq_len: int, causal: bool = True) -> float:
    """Training FLOPs per token: forward + backward = 3x the forward pass (see the convention above)."""
    return 3 * sum(forward_flops_per_token(cfg, seq_len, causal).values())


def flops_per_step(cfg: Any, causal: bool = True) -> float:
    """Training FLOPs of one optimizer step of a TrainConfig: batch_size x grad_accum windows of seq_len."""
    return flops_per_token(cfg.model, cfg.data.seq_len, causal) * cfg.tokens_per_step


def mfu(flops: float, seconds: float, n_devices: int, peak_per_device: float | None) -> float | None:
    """Model FLOPs utilisation: `flops` done in `seconds` over n_devices x peak (None if the peak is unknown)."""
    if not peak_per_device or seconds <= 0:
        return None
    return flops / seconds / (n_devices * peak_per_device)


def summary_writer(folder: Path) -> Any:
    """tensorboardX's SummaryWriter for `folder`. tensorboardX imports torch wherever it is installed (seconds
    of a command's start) only to accept torch tensors; minigpt logs Python numbers, so torch is hidden from
    that import unless something in this process imported it already."""
    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        from tensorboardX import SummaryWriter
    else:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` now raises ImportError
        try:
            from tensorboardX import SummaryWriter
        finally:
            del sys.modules["torch"]
    return SummaryWriter(str(folder))


class MetricsWriter:
    """Appends one JSON line per record to metrics.jsonl and mirrors scalars to TensorBoard (tb/) and, when
    `config.wandb` names a project, to a Weights & Biases run (wandb/), keyed `kind/name` at `step` in both.

    Only an enabled writer (process 0's) touches TensorBoard or W&B. `resumed`: the run continues from a
    checkpoint, so it continues the W&B run its earlier sessions logged to."""

    def __init__(
        self,
        run_dir: str | Path,
        enabled: bool = True,
        config: TrainConfig | None = None,
        resumed: bool = False,
    ) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        self.wandb_run: Any = None
        if enabled:
            if config is not None and config.wandb.enabled:  # first: a missing wandb fails before tb/ opens
                self.wandb_run = start_wandb(Path(run_dir), config.wandb, to_dict(config), resumed)
            self.tb = summary_writer(Path(run_dir) / "tb")

    def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        line = json.dumps({"step": step, "kind": kind, **values}) + "\n"
        with open(self.path, "ab+") as f:
            if f.seek(0, os.SEEK_END) > 0:  # a run killed mid-append left a torn line: start a fresh one
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    line = "\n" + line
            f.write(line.encode())
        scalars = {f"{kind}/{name}": v for name, v in values.items() if isinstance(v, int | float)}
        for key, value in scalars.items():
            self.tb.add_scalar(key, value, step)
        self.tb.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(scalars, step=step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()
            self.wandb_run = None


WANDB_MISSING = "--wandb.project needs wandb: pip install 'minigpt[wandb]'"
WANDB_ID_FILE = "wandb/run_id"
"""Where a run directory keeps its W&B run's id (beside W&B's own files, in run_dir/wandb)."""


def wandb_run_id(run_dir: Path, resumed: bool) -> str:
    """The W&B run id of the run in `run_dir`: the saved one when training resumes from a checkpoint, else a
    new one, saved (a run that starts again from step 0, as with --overwrite, is a new W&B run)."""
    path = run_dir / WANDB_ID_FILE
    saved = path.read_text().strip() if resumed and path.is_file() else ""
    if saved:
        return saved
    run_id = secrets.token_hex(6)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(path, run_id + "\n")
    return run_id


def start_wandb(run_dir: Path, cfg: WandbConfig, config: dict[str, Any], resumed: bool) -> Any:
    """A W&B run logging into run_dir/wandb, with the run's config; ConfigError (one line) if wandb is not
    installed or cannot start (e.g. online without `wandb login`)."""
    try:
        import wandb
    except ImportError:
        raise ConfigError(WANDB_MISSING) from None
    run_id = wandb_run_id(run_dir, resumed)
    try:
        return wandb.init(
            dir=str(run_dir),
            project=cfg.project,
            entity=cfg.entity,
            name=cfg.name or run_dir.absolute().name,
            tags=list(cfg.tags),
            mode=cfg.mode,
            config=config,
            id=run_id,
            resume="allow",
        )
    except wandb.errors.Error as e:  # not logged in, server unreachable, a project or entity it refuses
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"W&B could not start the run ({why}); run `wandb login`, or log offline with --wandb.mode "
            "offline and upload later with `wandb sync`"
        ) from None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of metrics.jsonl, oldest first. A line that is not a JSON record is skipped: silently if
    it is the last one (a run killed while appending it), with a warning anywhere else."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    lines = path.read_bytes().split(b"\n")
    while lines and not lines[-1].strip():
        lines.pop()
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            record = None
        if isinstance(record, dict):
            records.append(record)
        elif number < len(lines):
            warnings.warn(f"{path} line {number} is not a JSON record; skipped", DataWarning, stacklevel=2)
    return records


def _plot_tasks(ax: Any, records: list[dict[str, Any]]) -> None:
    """--eval-tasks metrics against step (perplexities left out: their scale hides the rest)."""
    names = sorted({k for r in records for k in r if "/" in k and "perplexity" not in k})
    for name in names:
        points = [(r["step"], r[name]) for r in records if name in r]
        ax.plot(*zip(*points, strict=True), "o-", label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("task metric")
    ax.legend(loc="best", fontsize="small")


def _import_pyplot() -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot


def preload_plotting() -> None:
    """Import matplotlib in a background thread (a second or two) while the run compiles, so that drawing
    loss.png at the end does not add it to the run's exit."""

    def preload() -> None:
        with contextlib.suppress(Exception):  # plot_losses imports it again and says what failed
            _import_pyplot()

    threading.Thread(target=preload, name="minigpt-import-matplotlib", daemon=True).start()


def plot_losses(run_dir: str | Path) -> Path:
    """loss.png: training loss and validation loss (and bits per byte, of each source of a mixture too)
    against step; below them, the
    --eval-tasks metrics if the run scored tasks."""
    _import_pyplot()
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)

    def rows(kind: str, *keys: str) -> list[tuple]:
        return [
            tuple(r[k] for k in keys) for r in records if r.get("kind") == kind and all(k in r for k in keys)
        ]

    train, val = rows("train", "step", "loss"), rows("val", "step", "loss", "bpb")
    tasks = [r for r in records if r.get("kind") == "tasks"]
    fig, axes = plt.subplots(2 if tasks else 1, 1, figsize=(7, 7 if tasks else 4), squeeze=False)
    ax = axes[0, 0]
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", alpha=0.8)
    if val:
        steps, losses, bpbs = zip(*val, strict=True)
        ax.plot(steps, losses, "o-", label="val loss")
        ax2 = ax.twinx()
        ax2.plot(steps, bpbs, "s--", color="tab:green", label="val bits/byte")
        sources = sorted({k for r in records if r.get("kind") == "val" for k in r if k.startswith("bpb/")})
        colors = itertools.cycle(["tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan"])
        for key, color in zip(sources, colors, strict=False):
            points = zip(*rows("val", "step", key), strict=True)
            ax2.plot(*points, ":", color=color, label=key.replace("bpb/", "bits/byte "))
        ax2.set_ylabel("bits per byte")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    handles = [
        h for a in (ax, *ax.get_shared_x_axes().get_siblings(ax)) for h in a.get_legend_handles_labels()[0]
    ]
    ax.legend(
        handles=list(dict.fromkeys(handles)), loc="upper right"
    )  # one box for both axes, so neither hides the other's lines
    ax.set_title(Path(run_dir).name)
    if tasks:
        _plot_tasks(axes[1, 0], tasks)
    fig.tight_layout()
    out = Path(run_dir) / "loss.png"
    with files.atomic_open(out, "wb") as f:
        fig.savefig(f, format="png", dpi=110)
    plt.close(fig)
    return out
