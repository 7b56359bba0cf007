"""Fine-tuning side by side: `minigpt train` and TRL's SFTTrainer (with PEFT for LoRA) on the same checkpoint
(the `sft` fixture's), conversations, optimizer and learning rate, each giving its loss per step. Every batch
is the whole training set (all of minigpt's packed rows, all of TRL's examples), so the order each shuffles in
does not matter."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

LR, STEPS = 1e-3, 50


def minigpt_config(folder: Path, steps: int, *flags: str, run: str = "run") -> Any:
    """The config of `minigpt train --init-from` on the conversations with torch's AdamW defaults, a constant
    learning rate and as many rows per batch as the training set packs into."""
    from minigpt.app.initial import with_initial
    from minigpt.commands.flags import parse_train
    from minigpt.data.build import prepare
    from minigpt.data.loader import train_rows
    from minigpt.optim.optimizer import AdamW, ConstantSchedule

    args = ["--init-from", str(folder / "checkpoint"), "--data", str(folder / "train.jsonl"), "--val-data",
            str(folder / "val.jsonl"), "--data.seq-len", "127", "--data.cache-dir", str(folder / "cache"),
            "--model.dtype", "float32", "--mesh.cpu-devices", "1", "--steps", str(steps), "--log-every", "1",
            "--eval-every", "1000", "--max-epochs", "0", "--run-dir", str(folder / run), "--overwrite", *flags]  # fmt: skip
    cfg = with_initial(parse_train(args, "minigpt train"))
    return dataclasses.replace(
        cfg,
        batch_size=int(train_rows(prepare(cfg.data), cfg.data.seq_len)),
        optimizer=AdamW(b2=0.999, weight_decay=0.0, clip_gradient_norm=1.0),
        schedule=ConstantSchedule(warmup_steps=0, peak_lr=LR),
    )


def minigpt_losses(cfg: Any) -> list[float]:
    from minigpt.app.train import train

    train(cfg)
    lines = (Path(cfg.run_dir) / "metrics.jsonl").read_text().splitlines()
    return [m["loss"] for m in map(json.loads, lines) if m["kind"] == "train"]


def trl_losses(folder: Path, hf: tuple, steps: int, model: Any = None) -> list[float]:
    """TRL's SFTTrainer on the conversations, assistant tokens only, no packing: of `model` (a PEFT model,
    say), or of the checkpoint itself."""
    torch, transformers = hf
    datasets = pytest.importorskip("datasets")
    trl = pytest.importorskip("trl")
    examples = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    if model is None:
        model = transformers.AutoModelForCausalLM.from_pretrained(folder / "checkpoint", dtype=torch.float32)
    args = trl.SFTConfig(
        output_dir=str(folder / "trl"), per_device_train_batch_size=len(examples), max_steps=steps,
        learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, assistant_only_loss=True,
        packing=False, max_length=None, seed=0, bf16=False, dataloader_drop_last=False,
    )  # fmt: skip
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder / "checkpoint")
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(examples), processing_class=tokenizer
    )
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]
