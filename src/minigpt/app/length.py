"""How long a run is: the steps a --max-time budget can hold (and so how much of the corpus to tokenize),
passes over the training text (--max-epochs), and what the run says about its length when it starts and ends."""

from __future__ import annotations

import math

import jax

from minigpt.app.hooks import Progress
from minigpt.config import DataConfig, TrainConfig
from minigpt.data import hub
from minigpt.data.corpus import resolve_files
from minigpt.data.loader import train_rows
from minigpt.data.mixture import Corpus, Part
from minigpt.data.saved_tokenizer import open_pretrained
from minigpt.data.tokenizer import BPETokenizer, GPT2Tokenizer
from minigpt.parallel.distributed import say
from minigpt.training import hardware
from minigpt.training.metrics import flops_per_token
from minigpt.training.trainer import resolve_model, step_seconds, weight_decay_floor

STEP_MARGIN = 1.5
"""A timed step's rate times this bounds the steps a --max-time budget holds: later steps never run much
faster than the fastest of a few timed ones (they run slower: evaluation, checkpoints, a busy machine)."""


def run_tokens(cfg: TrainConfig) -> int | None:
    """The training tokens a run can read, to tokenize only those: --steps x tokens per step, or fewer where a
    --max-time budget holds fewer steps (`budget_steps`). None (the whole corpus) when that is unknown."""
    steps = cfg.steps
    if cfg.max_time:
        budget = budget_steps(cfg)
        if budget is None:
            return None
        steps = min(steps, budget)
    return steps * cfg.tokens_per_step


def budget_steps(cfg: TrainConfig) -> int | None:
    """The most steps --max-time can hold. First at a rate no step beats (`hardware.training_flops`: a dense
    block's on a CPU, the vendor's peak on an accelerator). Where that would tokenize more than the corpus can
    hold, a run in one process times its own step on random tokens, which bounds it several times tighter
    (the programs compiled are the run's, read back from the compilation cache)."""
    device = jax.devices()[0]
    dtype, _ = hardware.compute_dtype(cfg.model.dtype, device.platform)
    rate = hardware.training_flops(device, dtype, cfg.peak_tflops or None)
    if rate is None:
        return None
    cfg = expected_model(cfg)
    step_flops = flops_per_token(cfg.model, cfg.data.seq_len) * cfg.tokens_per_step
    bound = cfg.max_time * rate * jax.device_count() / step_flops
    if cfg.peak_tflops or jax.process_count() > 1 or cfg.steps <= bound:
        return math.ceil(min(cfg.steps, bound))  # 1e308: inf
    text = text_bytes(cfg.data)
    if text is not None and text <= bound * cfg.tokens_per_step:
        return math.ceil(bound)  # every token of the corpus fits the bound: a timed step would not shorten it
    say(f"timing a training step to size the --max-time {cfg.max_time:g}s budget's share of the corpus")
    return math.ceil(min(bound, STEP_MARGIN * cfg.max_time / step_seconds(cfg)))


def expected_model(cfg: TrainConfig) -> TrainConfig:
    """The config with the vocabulary and end-of-text id the tokenizer will give (a BPE that learns the size
    asked), so that a step timed before tokenizing compiles the run's own program."""
    if cfg.data.tokenizer == "bpe":
        vocab, eot = cfg.data.bpe_vocab_size, BPETokenizer.EOT_ID
    elif cfg.data.tokenizer == "hf":
        tok = open_pretrained(cfg.data.hf_tokenizer or "")
        vocab, eot = tok.vocab_size, tok.eot_id
    else:
        vocab, eot = GPT2Tokenizer.vocab_size, GPT2Tokenizer.eot_id
    return resolve_model(cfg, cfg.model.vocab_size or vocab, eot)


def text_bytes(data: DataConfig) -> int | None:
    """The bytes of the training files where they bound the tokens they make (local text and JSON lines: a
    token is at least a byte); None for hub datasets (the default TinyStories too) and Parquet (compressed)."""
    if not data.paths or any(hub.is_spec(str(p)) for source in data.sources() for p in source.paths):
        return None
    found = [f for source in data.sources() for f in resolve_files(source.paths)]
    if not all(f.suffix in (".txt", ".jsonl") for f in found):
        return None
    return sum(f.stat().st_size for f in found)


def _pass_steps(cfg: TrainConfig, parts: list[Part]) -> int | None:
    """Steps until the run has read every training window of the part it reads through first (each is read
    at its weight); None without parts."""
    per_step = cfg.batch_size * cfg.grad_accum
    return min(
        (int(train_rows(p.store, cfg.data.seq_len) / (p.weight * per_step)) for p in parts), default=None
    )


def repeats(cfg: TrainConfig, corpus: Corpus) -> int | None:
    """The step after which the run has read every window of a source whose store holds only the first
    tokens of its corpus (tokenized for a shorter run: the budget went further than its bound)."""
    return _pass_steps(cfg, [part for part in corpus.parts if not part.store.complete])


def epoch_steps(cfg: TrainConfig, corpus: Corpus) -> int | None:
    """Steps of one pass over the training text (of the source read through first, in a mixture), at least
    one; None when a store holds only the first tokens of its corpus, whose length the run does not know."""
    if not all(part.store.complete for part in corpus.parts):
        return None
    return max(1, _pass_steps(cfg, list(corpus.parts)) or 1)


def longest(cfg: TrainConfig, epoch: int | None) -> int:
    """The most steps the run may take: --steps, and with --max-time also --max-epochs passes over the
    training text, where it ends however much of the budget is left."""
    if not (cfg.max_time and cfg.max_epochs and epoch):
        return cfg.steps
    return min(cfg.steps, max(1, math.ceil(cfg.max_epochs * epoch)))


def describe_passes(cfg: TrainConfig, epoch: int | None) -> None:
    """How often the run may read its training text: where --max-epochs ends a budgeted run, or how often a
    run of --steps reads it."""
    if epoch is None:
        return
    if (floor := weight_decay_floor(cfg, epoch)) is not None and cfg.optimizer.weight_decay == floor:
        passes = f"{cfg.weight_decay_passes:g} pass{'es' * (cfg.weight_decay_passes != 1)}"
        say(
            f"weight decay {floor:.3g}: what the weights learn fades within {passes} over the training text "
            "(--weight-decay-passes), so reading it again does not teach it by heart"
        )
    cap = longest(cfg, epoch)
    if cap < cfg.steps:
        say(
            f"one pass over the training text is {epoch:,} steps: the run ends by step {cap:,} "
            f"({cfg.max_epochs:g} passes, --max-epochs) whatever is left of --max-time"
        )
    elif not cfg.max_time and cfg.steps > epoch:
        say(
            f"{cfg.steps:,} steps read the training text {cfg.steps / epoch:.1f} times (one pass is {epoch:,} "
            "steps); the run ends with the best weights it evaluates"
        )


def say_finished(cfg: TrainConfig, p: Progress) -> None:
    """A resumed run already at its end trains nothing: say why, and how to train longer."""
    if p.budgeted:
        say(
            f"the run is finished: step {p.step} is where its --max-time budget ended it, and its schedule has "
            "decayed there, so a larger --max-time does not lengthen it; to train longer, start again with "
            "--overwrite and the larger budget, or choose another --run-dir"
        )
    elif cfg.max_time and p.end < cfg.steps:
        say(
            f"the run is finished: step {p.step} ends its {cfg.max_epochs:g} passes over the training text "
            "(--max-epochs); to train longer, start again with --overwrite and a larger --max-epochs"
        )
    else:
        say(f"the run is finished at --steps {cfg.steps}; pass a larger --steps to train on from here")


SHORT_RUN = 20
"""A budgeted session that trains fewer steps than this says so: its model has barely begun to learn."""


def say_short(cfg: TrainConfig, p: Progress, start_step: int) -> None:
    """A --max-time budget that held only a few steps: say how few, at what pace, and how to get more."""
    steps = p.step - start_step
    if not cfg.max_time or steps >= SHORT_RUN or p.step >= cfg.steps:
        return
    pace = f" at {p.step_s:.2f} s/step" if p.step_s else ""
    say(
        f"warning: the {cfg.max_time:g} s budget held only {steps} training step{'s' * (steps != 1)}{pace}: the "
        "model has barely begun to learn; raise --max-time, or train a smaller model or batch (--preset cpu, "
        "--batch-size)"
    )
