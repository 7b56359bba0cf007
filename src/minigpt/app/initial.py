"""Where a run's first weights come from with --init-from: a transformers checkpoint folder or a minigpt run.

The source decides what the weights compute (every architecture field of the model, and the tokenizer the
token ids mean); the run's own flags decide only how it computes them (dtype, attention, remat, scan, loss
chunk, dropout, vocabulary padding). So `with_initial` rewrites the config before anything is validated or
tokenized, and a resumed run rebuilds the same config from the same source. `initial_state` then puts the
source's weights into the run's shards with a fresh optimizer state, instead of a random initialisation.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from minigpt.config import ConfigError, ModelConfig, TrainConfig
from minigpt.hf.export import gather_params
from minigpt.hf.import_ import minigpt_arrays, padded_vocab, read_hf_config, state_from_arrays
from minigpt.hf.tokenizer import is_gpt2_folder
from minigpt.hf.weights import read_weights
from minigpt.nn import lora
from minigpt.parallel.distributed import say
from minigpt.training.memory import fitted_seq_len
from minigpt.training.runs import load_model, run_config
from minigpt.training.trainer import Setup, TrainState

HOW_IT_COMPUTES = (
    "dtype", "attention", "remat", "loss_chunk", "scan_layers", "dropout", "document_attention",
    "vocab_multiple", "scaled_init", "lora",
)  # fmt: skip
"""The model fields a run keeps of its own flags (how it computes, and its adapters): the rest come from the
--init-from source."""


def with_initial(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with the model and tokenizer of its --init-from source (unchanged without one). Its window is
    --data.seq-len capped at the source's context, or (`--data.seq-len 0`, what --init-from without it
    asks) the whole context, halved until its step fits the memory plan."""
    if not cfg.init_from:
        return cfg
    model, tokenizer = _source_model(Path(cfg.init_from).expanduser())
    model = dataclasses.replace(model, **{f: getattr(cfg.model, f) for f in HOW_IT_COMPUTES}, eot_id=-1)
    data = dataclasses.replace(
        cfg.data,
        seq_len=min(cfg.data.seq_len or model.max_seq_len, model.max_seq_len),
        **{"hf_tokenizer": None, **tokenizer},
    )
    out = dataclasses.replace(
        cfg, init_from=str(Path(cfg.init_from).expanduser().absolute()), model=model, data=data
    )
    return out if cfg.data.seq_len else _fitted(out)


def _fitted(cfg: TrainConfig) -> TrainConfig:
    """`cfg` whose window is the source's whole context: as long as the memory plan fits, said in a line."""
    context = cfg.model.max_seq_len
    seq_len = fitted_seq_len(cfg, context)
    if seq_len == context:
        say(
            f"windows of {context} tokens, the context of --init-from {cfg.init_from} (--data.seq-len to choose)"
        )
    else:
        say(
            f"windows of {seq_len} tokens of the {context}-token context of --init-from {cfg.init_from}: the "
            f"longest whose step fits this machine's memory at --batch-size {cfg.batch_size} (--data.seq-len "
            "to choose)"
        )
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=seq_len))


def ignored_flags(asked: ModelConfig, got: ModelConfig) -> list[str]:
    """The architecture fields `asked` set away from their defaults that the --init-from source overrode
    (`got`): flags the run would otherwise drop without a word."""
    default = ModelConfig()
    names = [f.name for f in dataclasses.fields(ModelConfig) if f.name not in (*HOW_IT_COMPUTES, "eot_id")]
    return [
        f"model.{n}={getattr(asked, n)!r}"
        for n in names
        if getattr(asked, n) != getattr(default, n) and getattr(asked, n) != getattr(got, n)
    ]


def _source_model(path: Path) -> tuple[ModelConfig, dict[str, Any]]:
    """The source's model and the data fields naming its tokenizer."""
    if path.is_file() or not path.exists():
        raise ConfigError(
            f"--init-from {path}: not a folder; name a transformers checkpoint folder or a minigpt run directory"
        )
    if (path / "config.json").is_file() and not (path / "checkpoints").exists():
        model, _ = read_hf_config(path)
        if is_gpt2_folder(path):
            return model, {"tokenizer": "gpt2"}
        return model, {"tokenizer": "hf", "hf_tokenizer": str(path.absolute())}
    source = run_config(path)
    if source.data.tokenizer == "gpt2":
        return source.model, {"tokenizer": "gpt2", "gpt2_dir": source.data.gpt2_dir}
    return source.model, {"tokenizer": "hf", "hf_tokenizer": str((path / "tokenizer").absolute())}


def initial_state(setup: Setup) -> TrainState:
    """Step 0 of a run with --init-from: the source's weights in the run's shards, a fresh optimizer state."""
    path, model = Path(setup.cfg.init_from or ""), setup.cfg.model
    if (path / "checkpoints").exists():
        source, params, _, _ = load_model(path)
        named = lora.merged(gather_params(params, source.cfg.model), source.cfg.model.lora)
        weights = padded_vocab(named, source.cfg.model.vocab_size, model.padded_vocab)
    else:
        weights = minigpt_arrays(model, read_hf_config(path)[1], read_weights(path))
    return state_from_arrays(setup, weights)
