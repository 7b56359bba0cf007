"""Bits per byte, FLOPs, and where metrics go: console, metrics.jsonl, TensorBoard, loss.png."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from minigpt.config import ModelConfig


def bits_per_byte(nll_nats: float, n_bytes: float) -> float:
    """Summed negative log-likelihood (nats) over the UTF-8 bytes those tokens encode, in bits.

    Unlike loss per token, this does not depend on the tokenizer, so runs with different vocabularies compare.
    """
    return nll_nats / math.log(2) / n_bytes


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward): 6 per matmul weight, plus attention's
    QK^T and AV, which with the causal mask touch on average half the sequence."""
    d, f, layers = cfg.d_model, cfg.d_ff, cfg.n_layers
    matmul_params = layers * (4 * d * d + 2 * d * f) + d * cfg.padded_vocab
    attention = layers * 2 * 2 * seq_len * d / 2
    return 6 * matmul_params + 3 * attention


class MetricsWriter:
    """Appends one JSON line per record to metrics.jsonl and mirrors scalars to TensorBoard (tb/)."""

    def __init__(self, run_dir: str | Path, enabled: bool = True) -> None:
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self.tb = None
        if enabled:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(str(Path(run_dir) / "tb"))

    def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": step, "kind": kind, **values}) + "\n")
        for name, value in values.items():
            if isinstance(value, int | float):
                self.tb.add_scalar(f"{kind}/{name}", value, step)
        self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(run_dir: str | Path) -> Path:
    """loss.png: training loss and validation loss (and bits per byte) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    train = [(r["step"], r["loss"]) for r in records if r["kind"] == "train"]
    val = [(r["step"], r["loss"], r["bpb"]) for r in records if r["kind"] == "val"]
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss", alpha=0.8)
    if val:
        steps, losses, bpbs = zip(*val, strict=True)
        ax.plot(steps, losses, "o-", label="val loss")
        ax2 = ax.twinx()
        ax2.plot(steps, bpbs, "s--", color="tab:green", label="val bits/byte")
        ax2.set_ylabel("bits per byte")
        ax2.legend(loc="center right")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.legend(loc="upper right")
    ax.set_title(Path(run_dir).name)
    fig.tight_layout()
    out = Path(run_dir) / "loss.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
