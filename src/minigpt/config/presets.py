"""Named presets: the whole `TrainConfig` that `minigpt train --preset NAME` starts from; flags override it."""

from __future__ import annotations

from minigpt.config.data import DataConfig
from minigpt.config.model import ModelConfig
from minigpt.config.training import TrainConfig
from minigpt.optim.optimizer import AdamW, ConstantSchedule, CosineDecaySchedule, Muon, WSDSchedule
from minigpt.runtime.errors import ConfigError

PRESETS: dict[str, TrainConfig] = {
    # Ten minutes (--max-time 600) on any machine, ending fully decayed. A time budget rewards cheap tokens: a
    # small model, a corpus-sized BPE vocabulary, Muon; the block is Apertus's, so transformers can load it.
    # A corpus small enough to be read several times is, with weight decay that follows its length; six
    # layers and batch 48 spend the time that six passes leave, which on TinyStories still underfits. The run
    # ends with the average of its weights over the decay where that evaluates better.
    "cpu": TrainConfig(
        run_dir="runs/cpu",
        model=ModelConfig(
            max_seq_len=256,
            d_model=96,
            n_layers=6,
            n_heads=2,
            d_ff=384,
            norm="rmsnorm",
            position="rope",
            activation="relu2",
            qk_norm=True,
            bias=False,
            tie_embeddings=False,
            dtype="auto",
        ),
        data=DataConfig(seq_len=128, tokenizer="bpe", bpe_vocab_size=4096),
        optimizer=Muon(adam_lr_ratio=3.0, b1=0.8, head_lr_ratio=0.25),
        schedule=WSDSchedule(warmup_steps=10, peak_lr=0.02, decay_fraction=0.5),
        steps=100_000,
        max_time=600.0,
        max_epochs=6.0,
        weight_decay_passes=1.0,
        average_weights=0.5,
        batch_size=48,
        log_every=10,
        eval_every=100,
        ckpt_every=200,
    ),
    # The Flax miniGPT tutorial's hyperparameters, without its padding.
    # Training a checkpoint further (--init-from, the default preset there): its model and tokenizer, AdamW
    # at a small peak rate after a short warm-up, cosine decay to zero at the budget's end, no decay of norms
    # and biases (optimizer.default_weight_decay_mask).
    "finetune": TrainConfig(
        run_dir="runs/finetune",
        model=ModelConfig(dtype="auto"),
        data=DataConfig(seq_len=256),
        optimizer=AdamW(weight_decay=0.1),
        schedule=CosineDecaySchedule(warmup_steps=10, peak_lr=5e-5, decay_lr=0.0),
        steps=100_000,
        max_time=600.0,
        batch_size=8,
        log_every=10,
        eval_every=50,
        ckpt_every=100,
    ),
    "tutorial": TrainConfig(
        run_dir="runs/tutorial",
        model=ModelConfig(
            max_seq_len=256,
            d_model=256,
            n_layers=4,
            n_heads=8,
            d_ff=256,
            dropout=0.1,
            norm_position="post",
            activation="relu",
            dtype="auto",
        ),
        data=DataConfig(seq_len=256, tokenizer="gpt2"),
        optimizer=AdamW(b2=0.999, weight_decay=0.0, clip_gradient_norm=1e9),
        schedule=ConstantSchedule(warmup_steps=0, peak_lr=1e-3),
        steps=5000,
        batch_size=144,
        log_every=20,
        eval_every=500,
        ckpt_every=1000,
    ),
    # The cpu preset's recipe widened for one accelerator, the default of `minigpt train` on a TPU or GPU: its
    # chip reads a small corpus's passes in seconds, so a budget buys width and depth rather than more tokens.
    # Scanned layers keep the compile short.
    "accelerator": TrainConfig(
        run_dir="runs/accelerator",
        model=ModelConfig(
            max_seq_len=256,
            d_model=512,
            n_layers=8,
            n_heads=8,
            d_ff=2048,
            norm="rmsnorm",
            position="rope",
            activation="relu2",
            qk_norm=True,
            bias=False,
            tie_embeddings=False,
            dtype="auto",
            scan_layers=True,
        ),
        data=DataConfig(seq_len=256, tokenizer="bpe", bpe_vocab_size=4096),
        optimizer=Muon(adam_lr_ratio=3.0, b1=0.8, head_lr_ratio=0.25),
        schedule=WSDSchedule(warmup_steps=20, peak_lr=0.01, decay_fraction=0.5),
        steps=100_000,
        max_time=600.0,
        max_epochs=6.0,
        weight_decay_passes=1.0,
        average_weights=0.5,
        batch_size=128,
        log_every=20,
        eval_every=200,
        ckpt_every=500,
    ),
    # GPT-2 small (124M) for an accelerator: 1024 context, ~0.5M tokens per update. Scanned layers compile
    # once, whatever the depth; full remat keeps a micro-batch of 64 on a 16 GB chip, and on a TPU ran faster
    # than keeping the products.
    "gpt2-124m": TrainConfig(
        run_dir="runs/gpt2-124m",
        model=ModelConfig(
            max_seq_len=1024,
            d_model=768,
            n_layers=12,
            n_heads=12,
            d_ff=3072,
            tie_embeddings=True,
            dtype="auto",
            scan_layers=True,
            remat="full",
        ),
        data=DataConfig(seq_len=1024, tokenizer="gpt2"),
        optimizer=AdamW(weight_decay=0.1),
        schedule=CosineDecaySchedule(warmup_steps=700, peak_lr=6e-4, decay_lr=6e-5),
        steps=19000,
        batch_size=64,
        grad_accum=8,
        log_every=10,
        eval_every=500,
        ckpt_every=1000,
    ),
}


def get_preset(name: str) -> TrainConfig:
    """The preset called `name`, or a ConfigError listing the presets there are."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset '{name}'; choose one of: {', '.join(PRESETS)}")
    return PRESETS[name]
