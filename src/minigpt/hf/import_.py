"""Import a local transformers checkpoint as a minigpt run directory.

For a checkpoint of one of the classes in `minigpt.hf.architecture` (safetensors weights, float32/16 or
bfloat16), `import_hf` writes a run directory (config.json, tokenizer/, an Orbax checkpoint at step 0 with a
fresh optimizer state) that `minigpt generate`, `eval` and `train --run-dir` accept.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np

from minigpt.config import (
    ConfigError,
    DataConfig,
    MeshConfig,
    ModelConfig,
    TrainConfig,
    from_dict,
    get_preset,
    save_json,
    subcommand_name,
    to_dict,
)
from minigpt.data.loader import train_iterator
from minigpt.data.tokenizer import GPT2Tokenizer
from minigpt.hf.architecture import (
    APERTUS,
    GPT2,
    LLAMA,
    PLAIN_ACTIVATIONS,
    QWEN2,
    QWEN3,
    SUPPORTED,
    param_name,
    tensor_table,
)
from minigpt.hf.export import MINIGPT_CONFIG
from minigpt.hf.tokenizer import read_hf_tokenizer
from minigpt.hf.weights import read_weights
from minigpt.nn import lora
from minigpt.runtime import files
from minigpt.training.checkpoint import Checkpointer
from minigpt.training.memory import fitted_seq_len
from minigpt.training.runs import check_output
from minigpt.training.trainer import Setup, TrainState, build

APERTUS_ROPE = {"rope_type": "llama3", "rope_theta": 12_000_000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
"""ApertusConfig's RoPE where a config names none."""


def _rope(c: dict, arch: str) -> dict[str, Any]:
    """The ModelConfig RoPE fields of transformers config `c`: theta, and Llama 3.1's scaling where used."""
    params = {**(c.get("rope_scaling") or {}), **(c.get("rope_parameters") or {})}
    if arch == APERTUS and not params:
        params = APERTUS_ROPE
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", c.get("rope_theta", 10_000.0)))
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "llama3":
        raise ConfigError(f"cannot import: RoPE scaling {kind!r} has no minigpt equivalent (minigpt: llama3)")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("cannot import: partial_rotary_factor has no minigpt equivalent")
    return {
        "rope_theta": theta,
        "rope_scaling": "llama3",
        "rope_factor": float(params["factor"]),
        "rope_low_freq_factor": float(params["low_freq_factor"]),
        "rope_high_freq_factor": float(params["high_freq_factor"]),
        "rope_original_max_len": int(params["original_max_position_embeddings"]),
    }


def model_config_from_hf(c: dict) -> tuple[ModelConfig, str]:
    """The ModelConfig that computes what transformers config `c` does, and its class; a one-line
    ConfigError for anything minigpt cannot compute exactly."""
    archs = c.get("architectures") or []
    arch = next((a for a in archs if a in SUPPORTED), None)
    if arch is None:
        raise ConfigError(
            f"cannot import a {', '.join(archs) or c.get('model_type', 'unknown')} checkpoint; "
            f"minigpt imports {', '.join(SUPPORTED)}"
        )

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise ConfigError(f"cannot import this {arch}: {what} has no minigpt equivalent")

    return (_gpt2_model(c, need) if arch == GPT2 else _llama_model(c, arch, need)), arch


def _gpt2_model(c: dict, need: Any) -> ModelConfig:
    fn = c.get("activation_function", "gelu_new")
    need(fn in PLAIN_ACTIVATIONS, f"activation_function={fn!r} (minigpt's GELU is the tanh approximation)")
    need(c.get("scale_attn_weights", True), "scale_attn_weights=false")
    need(not c.get("scale_attn_by_inverse_layer_idx", False), "scale_attn_by_inverse_layer_idx")
    need(not c.get("add_cross_attention", False), "add_cross_attention")
    need(c.get("tie_word_embeddings", True), "tie_word_embeddings=false (an output layer without bias)")
    d = c.get("n_embd", 768)
    return ModelConfig(
        vocab_size=c["vocab_size"],
        max_seq_len=c.get("n_positions", 1024),
        d_model=d,
        n_layers=c.get("n_layer", 12),
        n_heads=c.get("n_head", 12),
        d_ff=c.get("n_inner") or 4 * d,
        dropout=float(c.get("resid_pdrop", 0.0)),
        activation=PLAIN_ACTIVATIONS[fn],
        tie_embeddings=True,
        bias=True,
        norm_eps=float(c.get("layer_norm_epsilon", 1e-5)),
    )


def _llama_model(c: dict, arch: str, need: Any) -> ModelConfig:
    """Llama, Qwen2 (Llama with q, k, v biases), Qwen3 (Llama with QK-norm and no biases) or Apertus (Qwen3
    with a plain MLP)."""
    fn = c.get("hidden_act", "xielu" if arch == APERTUS else "silu")  # the config classes' defaults
    if arch == APERTUS:
        acts, mlp = PLAIN_ACTIVATIONS, "plain MLP is ReLU², ReLU or tanh GELU"
    else:
        acts, mlp = {"silu": "swiglu"}, "gated MLP is SwiGLU"
    need(fn in acts, f"hidden_act={fn!r} (minigpt's {mlp})")
    d, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim", 128 if arch == QWEN3 else None) or 0  # the config classes' defaults
    tied = c.get("tie_word_embeddings", False)
    qkv_bias = arch == QWEN2
    if arch == QWEN2:
        bias = False
        need(not c.get("use_sliding_window", False), "use_sliding_window")
    elif arch == LLAMA:
        bias = bool(c.get("attention_bias", False))
        need(
            bias == bool(c.get("mlp_bias", False)), "attention_bias != mlp_bias (minigpt has one bias switch)"
        )
    else:
        bias = False
        need(not c.get("attention_bias", False), f"attention_bias ({arch.removesuffix('ForCausalLM')}'s MLP has no biases)")  # fmt: skip
        need(not c.get("use_sliding_window", False), "use_sliding_window")
    need(tied or not bias, "biases with untied embeddings (an output layer without bias)")
    need(c.get("partial_rotary_factor", 1.0) == 1.0, "partial_rotary_factor")
    kv = c.get("num_key_value_heads") or heads
    return ModelConfig(
        vocab_size=c["vocab_size"],
        max_seq_len=c.get("max_position_embeddings", 2048),
        d_model=d,
        n_layers=c["num_hidden_layers"],
        n_heads=heads,
        d_ff=c["intermediate_size"],
        norm="rmsnorm",
        position="rope",
        **_rope(c, arch),
        activation=acts[fn],
        qk_norm=arch in (QWEN3, APERTUS),
        n_kv_heads=0 if kv == heads else kv,
        head_dim=0 if head_dim * heads == d else head_dim,
        tie_embeddings=tied,
        bias=bias,
        qkv_bias=qkv_bias,
        norm_eps=float(c.get("rms_norm_eps", 1e-5 if arch == APERTUS else 1e-6)),
    )


def minigpt_arrays(cfg: ModelConfig, arch: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """minigpt parameters (dotted names, layers unstacked, vocabulary padded with zero rows) from a
    transformers state dict; refuses missing and unexpected tensors."""
    if arch == GPT2:  # GPT-2 checkpoints from the hub name the base model's tensors without "transformer."
        tensors = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in tensors.items()}  # fmt: skip
    table = tensor_table(cfg, arch)
    expected = {hf for hf, _, _ in table}
    ignored = re.compile(r".*(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")
    unexpected = [k for k in tensors if k not in expected and not ignored.match(k)]
    if cfg.tie_embeddings:  # tied checkpoints sometimes also store the (identical) output layer
        unexpected = [k for k in unexpected if k != "lm_head.weight"]
    if unexpected:
        raise ConfigError(f"cannot import: unexpected tensor {unexpected[0]} for a {arch} of this config")
    out: dict[str, np.ndarray] = {}
    for hf, ours, transpose in table:
        if hf not in tensors:
            raise ConfigError(f"cannot import: the checkpoint has no tensor {hf}")
        value = tensors[hf].T if transpose else tensors[hf]
        for name, part in zip(ours, np.split(value, len(ours), axis=-1), strict=True):
            out[name] = np.ascontiguousarray(part)
    return padded_vocab(out, cfg.vocab_size, cfg.padded_vocab)


def padded_vocab(named: dict[str, np.ndarray], vocab: int, padded: int) -> dict[str, np.ndarray]:
    """Parameters with the vocabulary's `vocab` rows kept and padded with zeros to `padded` (a model pads its
    tables to a multiple of model.vocab_multiple)."""
    out = dict(named)
    out["wte"] = np.pad(named["wte"][:vocab], ((0, padded - vocab), (0, 0)))
    if "lm_head.kernel" in named:
        out["lm_head.kernel"] = np.pad(named["lm_head.kernel"][:, :vocab], ((0, 0), (0, padded - vocab)))
    if "lm_head.bias" in named:
        out["lm_head.bias"] = np.pad(named["lm_head.bias"][:vocab], (0, padded - vocab))
    return out


def read_hf_config(hf_dir: Path) -> tuple[ModelConfig, str]:
    """The ModelConfig and class of a transformers checkpoint folder's config.json, or one line saying why
    not (unreadable, or a model minigpt cannot compute exactly)."""
    try:
        return model_config_from_hf(json.loads((hf_dir / "config.json").read_bytes()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        why = f"no {e}" if isinstance(e, KeyError) else str(e).splitlines()[0]
        raise ConfigError(f"{hf_dir / 'config.json'} is not a readable transformers config ({why})") from None


_ARCH_FIELDS = (
    "vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "d_ff", "norm_position", "norm", "position",
    "rope_theta", "rope_scaling", "rope_factor", "rope_low_freq_factor", "rope_high_freq_factor",
    "rope_original_max_len", "activation", "qk_norm", "kv_heads", "head_size", "tie_embeddings", "bias",
    "qkv_bias", "norm_eps",
)  # fmt: skip
"""What a transformers config determines; the other ModelConfig fields (dtype, scan_layers, dropout,
init...) do not change the function the weights compute."""


def _same_function(a: ModelConfig, b: ModelConfig) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in _ARCH_FIELDS)


def state_from_arrays(setup: Setup, weights: dict[str, np.ndarray]) -> TrainState:
    """A fresh train state (step 0, new optimizer state) whose parameters are `weights` (dotted names, layers
    unstacked, vocabulary padded as the setup's model pads it), each put straight into its shards."""
    cfg = setup.cfg

    def leaf(path: tuple, spec: jax.ShapeDtypeStruct) -> jax.Array:
        name = param_name(path)
        if lora.is_adapter(name):  # new adapters on the given weights
            value = lora.initial(name, spec.shape, cfg.seed)
        elif cfg.model.scan_layers and name.startswith("blocks."):
            rest = name.removeprefix("blocks.")
            value = np.stack([weights[f"blocks.{i}.{rest}"] for i in range(cfg.model.n_layers)])
        else:
            value = weights[name]
        if value.shape != spec.shape:
            raise ConfigError(f"cannot import: {name} has shape {value.shape}, the config needs {spec.shape}")
        return jax.device_put(value.astype(spec.dtype), spec.sharding)

    params = jax.tree_util.tree_map_with_path(leaf, setup.abstract_state.params)
    fresh = functools.partial(TrainState.create, tx=setup.tx(cfg.steps), cfg=cfg)
    return jax.jit(fresh, out_shardings=setup.state_shardings)(params)


def _fresh_data_state(cfg: TrainConfig) -> dict:
    """The data iterator position of a run that has not trained yet (the same pipeline, on dummy tokens)."""
    local = cfg.batch_size // jax.process_count() * cfg.grad_accum

    class _Store:
        examples = False

        def tokens(self, split: str) -> np.ndarray:
            return np.zeros(cfg.data.seq_len * local * jax.process_count() + 1, np.int32)

        def chunk_check(self, split: str) -> None:
            return None  # no file to check

    return train_iterator(_Store(), cfg.data.seq_len, local, cfg.seed).get_state()


def _write_run(out: Path, cfg: TrainConfig, tokenizer: Any, state: TrainState, meta: dict) -> None:
    """A run directory holding `state` as its step-0 checkpoint: written whole in a temporary folder, then
    put in place."""
    with files.atomic_folder(out) as tmp:
        save_json(cfg, str(tmp / "config.json"))
        tokenizer.save(tmp / "tokenizer")
        ckpt = Checkpointer(tmp, keep=cfg.keep_checkpoints)
        record = {"tokenizer": tokenizer.identity, "step": 0, "val": None, **meta}
        ckpt.save(0, state.saved(), _fresh_data_state(cfg), record)
        ckpt.close()


def _flag(key: str, value: Any) -> list[str]:
    """The tyro flag(s) that set config field `key` (dotted, e.g. "model.d_model") to `value`."""
    special = {"data.paths": "--data", "data.val_paths": "--val-data"}
    head, _, last = key.rpartition(".")
    prefix = f"--{head}." if head else "--"
    if isinstance(value, bool):
        return [prefix + ("" if value else "no-") + last.replace("_", "-")]
    flag = special.get(key, prefix + last.replace("_", "-"))
    return [flag, *map(str, value)] if isinstance(value, list | tuple) else [flag, str(value)]


def train_command(cfg: TrainConfig, preset: str = "cpu") -> str:
    """A `minigpt train` command line whose config equals `cfg` (so it continues the run in cfg.run_dir):
    the flags that differ from `preset`'s defaults."""
    base, want = to_dict(get_preset(preset)), to_dict(cfg)
    args = ["minigpt", "train", *(["--preset", preset] if preset != "cpu" else []), "--run-dir", cfg.run_dir]
    for section in ("model", "data", "mesh", "dist"):
        for k, v in want[section].items():
            if base[section].get(k) != v:
                args += _flag(f"{section}.{k}", v)
    for k, v in want.items():
        if k in ("run_dir", "overwrite") or isinstance(v, dict) or base.get(k) == v:
            continue
        args += _flag(k, v)
    for section in ("optimizer", "schedule"):
        if base[section] != want[section]:
            args.append(f"{section}:{subcommand_name(getattr(cfg, section))}")
            for k, v in want[section].items():
                if k != "type":
                    args += _flag(f"{section}.{k}", v)
    return shlex.join(args)


def import_hf(
    hf_dir: str | Path, out: str | Path, overwrite: bool = False, data: DataConfig | None = None
) -> tuple[Path, str, str]:
    """`minigpt import`: a run directory from a local transformers checkpoint. Returns (run directory,
    transformers class, a `minigpt train` command that continues training it).

    If the folder was written by `export_hf` (it holds minigpt_config.json) and its model is unchanged, the
    original run's config is restored, so `eval` reads the same data and training continues with the
    original flags. Otherwise the config is the finetune preset's with the checkpoint's model and `data`
    (default: the preset's, with windows of the checkpoint's context as far as memory allows, as --init-from
    makes them), its tokenizer fields set to the imported tokenizer. The checkpoint is at step 0 with
    a fresh optimizer state."""
    hf_dir, out = Path(hf_dir), Path(out).absolute()
    if not (hf_dir / "config.json").is_file():
        raise ConfigError(f"{hf_dir} is not a transformers checkpoint folder (no config.json)")
    check_output(out, hf_dir, overwrite, "run directory")  # before the config: never over a run or the source
    model, arch = read_hf_config(hf_dir)
    saved = _saved_config(hf_dir)
    tokenizer = read_hf_tokenizer(hf_dir, None if saved is None else saved.get("tokenizer_identity"))
    try:
        return _import(hf_dir, out, model, arch, tokenizer, data, saved)
    finally:
        if isinstance(tokenizer, GPT2Tokenizer):
            shutil.rmtree(tokenizer.files_dir, ignore_errors=True)  # the staged copy; the run holds its own


def _saved_config(hf_dir: Path) -> dict | None:
    """The run config a folder minigpt exported keeps (MINIGPT_CONFIG; None in other folders), or one line
    saying it cannot be read."""
    if not (hf_dir / MINIGPT_CONFIG).is_file():
        return None
    try:
        saved = json.loads((hf_dir / MINIGPT_CONFIG).read_bytes())
    except ValueError as e:
        raise _unreadable(hf_dir, e) from None
    if not isinstance(saved, dict):
        raise _unreadable(hf_dir, "not a JSON object")
    return saved


def _unreadable(hf_dir: Path, why: object) -> ConfigError:
    return ConfigError(
        f"{hf_dir / MINIGPT_CONFIG} is not a readable minigpt config ({why}); delete it to import the weights "
        "with the finetune preset's config"
    )


def _import(
    hf_dir: Path,
    out: Path,
    model: ModelConfig,
    arch: str,
    tokenizer: Any,
    data: DataConfig | None,
    saved: dict | None,
) -> tuple[Path, str, str]:
    if model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"the model's vocab_size {model.vocab_size} is smaller than its tokenizer's {tokenizer.vocab_size}")  # fmt: skip

    cfg: TrainConfig | None = None
    preset = "cpu"  # a restored run's flags are the ones that differ from the default preset
    if saved is not None:
        extra = ("step", "tokenizer_identity")  # what export_hf adds to the run's config
        try:
            original = from_dict({k: v for k, v in saved.items() if k not in extra})
        except (ConfigError, ValueError) as e:
            raise _unreadable(hf_dir, e) from None
        same_tokenizer = saved.get("tokenizer_identity") == tokenizer.identity
        if _same_function(original.model, model) and same_tokenizer and data is None:
            cfg = dataclasses.replace(original, run_dir=str(out), overwrite=False)
    if cfg is None:
        preset = "finetune"
        if isinstance(tokenizer, GPT2Tokenizer):
            tok_fields = {"tokenizer": "gpt2", "gpt2_dir": str(out / "tokenizer")}
        else:  # the checkpoint's own tokenizer, kept in the run
            tok_fields = {"tokenizer": "hf", "hf_tokenizer": str(out / "tokenizer")}
        # Windows as --init-from makes them: the --data.seq-len given, else the context, as far as memory allows.
        seq_len = 0 if data is None else min(data.seq_len or model.max_seq_len, model.max_seq_len)
        data = dataclasses.replace(
            data or get_preset(preset).data, seq_len=seq_len or model.max_seq_len, **tok_fields
        )
        cfg = dataclasses.replace(get_preset(preset), run_dir=str(out), model=model, data=data)
        if not seq_len:
            fitted = fitted_seq_len(cfg, model.max_seq_len)
            cfg = dataclasses.replace(cfg, data=dataclasses.replace(data, seq_len=fitted))

    weights = minigpt_arrays(cfg.model, arch, read_weights(hf_dir))
    # Build on this process's devices, data parallel (the checkpoint restores onto any mesh later).
    n = jax.device_count()
    local = dataclasses.replace(cfg, mesh=MeshConfig(), batch_size=math.lcm(cfg.batch_size, n))
    state = state_from_arrays(build(local), weights)
    _write_run(out, cfg, tokenizer, state, {"imported_from": str(hf_dir.absolute())})
    return out, arch, train_command(cfg, preset)
