"""Export a trained run as a transformers checkpoint folder.

`export_hf` writes a folder that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load (config.json, generation_config.json, model.safetensors, tokenizer files), as the class that computes
exactly what minigpt computes (see `minigpt.hf.architecture`). transformers and torch are not needed for
this: the weights are written with `safetensors.numpy`. The padded vocabulary rows are cut back to
`vocab_size`; scanned layers are unstacked; weights are gathered from any mesh and written by process 0.
minigpt's own config is kept as minigpt_config.json, so `import_hf` can restore the run's config.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from safetensors import SafetensorError

from minigpt.config import LoRAConfig, ModelConfig, to_dict
from minigpt.hf.architecture import (
    APERTUS,
    GPT2,
    GPT2_ACTIVATIONS,
    LLAMA,
    QWEN2,
    QWEN3,
    hf_architecture,
    param_name,
    tensor_table,
)
from minigpt.hf.tokenizer import write_hf_tokenizer
from minigpt.nn import lora
from minigpt.runtime import files
from minigpt.training.runs import check_output, load_model, run_config

MINIGPT_CONFIG = "minigpt_config.json"
"""The exported run's own config, beside transformers' config.json."""


def hf_config(cfg: ModelConfig, arch: str, eot_id: int) -> dict[str, Any]:
    """config.json of the transformers model (written by hand: transformers is not needed to export)."""
    common = {
        "architectures": [arch],
        "vocab_size": cfg.vocab_size,
        "bos_token_id": eot_id,
        "eos_token_id": eot_id,
        "tie_word_embeddings": cfg.tie_embeddings,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if arch == GPT2:
        return {
            **common,
            "model_type": "gpt2",
            "n_positions": cfg.max_seq_len,
            "n_embd": cfg.d_model,
            "n_layer": cfg.n_layers,
            "n_head": cfg.n_heads,
            "n_inner": cfg.d_ff,
            "activation_function": GPT2_ACTIVATIONS[cfg.activation],
            "layer_norm_epsilon": cfg.norm_eps,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }
    return _rope_family_config(cfg, arch, common)


def _rope_family_config(cfg: ModelConfig, arch: str, common: dict[str, Any]) -> dict[str, Any]:
    """config.json of the Llama-shaped classes: Llama, Qwen2, Qwen3 and Apertus."""
    out = {
        **common,
        "model_type": {LLAMA: "llama", QWEN2: "qwen2", QWEN3: "qwen3", APERTUS: "apertus"}[arch],
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": GPT2_ACTIVATIONS[cfg.activation] if arch == APERTUS else "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        # transformers 5 reads rope_parameters, 4.x rope_theta and rope_scaling: both say the same.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_theta": cfg.rope_theta, **rope_scaling(cfg)},
        "rope_scaling": rope_scaling(cfg) if cfg.rope_scaling != "none" else None,
        "attention_bias": cfg.bias,
        "attention_dropout": 0.0,
    }
    if arch == LLAMA:
        return out | {"mlp_bias": cfg.bias, "pretraining_tp": 1}
    if arch == APERTUS:  # not its default pad token 3, a real token whose embedding fine-tuning would freeze
        return out | {"pad_token_id": None}
    if arch == QWEN2:  # its q, k, v biases are built in, the others absent
        out = {k: v for k, v in out.items() if k != "attention_bias"}
    return out | {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.n_layers,
        "layer_types": ["full_attention"] * cfg.n_layers,
    }


def rope_scaling(cfg: ModelConfig) -> dict[str, Any]:
    """transformers' RoPE parameters besides the theta: the rope type and the llama3 scaling's parameters."""
    if cfg.rope_scaling == "none":
        return {"rope_type": "default"}
    return {
        "rope_type": "llama3",
        "factor": cfg.rope_factor,
        "low_freq_factor": cfg.rope_low_freq_factor,
        "high_freq_factor": cfg.rope_high_freq_factor,
        "original_max_position_embeddings": cfg.rope_original_max_len,
    }


# ------------------------------------------------------------------------------------------------ export


def gather_params(params: Any, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Every parameter as one host numpy array (gathered from any mesh), named by its dotted path, scanned
    layers unstacked into blocks.0..., blocks.{L-1}."""
    from jax.experimental import multihost_utils

    out: dict[str, np.ndarray] = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = param_name(path)
        value = np.asarray(multihost_utils.process_allgather(x, tiled=True))
        if cfg.scan_layers and name.startswith("blocks."):
            rest = name.removeprefix("blocks.")
            for i in range(cfg.n_layers):
                out[f"blocks.{i}.{rest}"] = value[i]
        else:
            out[name] = value
    return out


def hf_tensors(cfg: ModelConfig, arch: str, named: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The transformers state dict (float32, C-contiguous) of minigpt parameters `named` (see
    `gather_params`), vocabulary rows cut to vocab_size; absent biases (model.bias=False) become zeros."""

    def get(name: str) -> np.ndarray:
        if name in named:
            value = named[name]
        elif name.endswith(".bias") and not cfg.bias:  # GPT-2 without biases: exactly zero biases
            owner = name.removesuffix("bias")
            value = np.zeros(named.get(owner + "kernel", named.get(owner + "scale")).shape[-1], np.float32)
        else:
            raise ValueError(f"parameter {name} missing")  # a bug, not a user mistake
        if name == "wte":
            value = value[: cfg.vocab_size]
        elif name == "lm_head.kernel":
            value = value[:, : cfg.vocab_size]
        return value

    out = {}
    for hf, ours, transpose in tensor_table(cfg, arch):
        value = np.concatenate([get(n) for n in ours], axis=-1) if len(ours) > 1 else get(ours[0])
        out[hf] = np.ascontiguousarray(value.T if transpose else value, dtype=np.float32)
    return out


def write_hf(
    out: str | Path,
    cfg: ModelConfig,
    params: Any,
    tokenizer: Any | None,
    eot_id: int,
    extra_config: dict | None = None,
    overwrite: bool = False,
) -> str:
    """Write a transformers checkpoint folder for a model with parameters `params` (any mesh; every process
    calls this, process 0 writes). Returns the transformers class. `extra_config` is saved as
    minigpt_config.json (the run's full config, for `import_hf`)."""
    arch = hf_architecture(cfg)
    out = Path(out)
    check_output(out, None, overwrite, "transformers checkpoint folder")
    tensors = hf_tensors(cfg, arch, lora.merged(gather_params(params, cfg), cfg.lora))
    if jax.process_index() != 0:
        return arch
    try:
        with files.atomic_folder(out) as tmp:
            _write_folder(tmp, cfg, arch, tensors, tokenizer, eot_id, extra_config)
    except (OSError, SafetensorError) as e:  # safetensors' errors, and some OSErrors, name no file
        raise OSError(getattr(e, "errno", None), getattr(e, "strerror", None) or str(e), str(out)) from None
    return arch


def _write_folder(
    tmp: Path, cfg: ModelConfig, arch: str, tensors: dict, tokenizer: Any, eot_id: int, extra: dict | None
) -> None:
    from safetensors.numpy import save_file

    ids = _special_ids(tokenizer, eot_id)
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg, arch, eot_id) | ids, indent=2))
    generation = {**ids, "pad_token_id": eot_id}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(tmp / "model.safetensors", files.open_mode())  # safetensors creates it 0600 whatever the umask
    if tokenizer is not None:
        write_hf_tokenizer(tokenizer, tmp, cfg.max_seq_len)
    if extra is not None:
        (tmp / MINIGPT_CONFIG).write_text(json.dumps(extra, indent=2))


def _special_ids(tokenizer: Any, eot_id: int) -> dict[str, Any]:
    """bos_token_id and eos_token_id: end-of-text for both, or a checkpoint tokenizer's BOS and stop ids."""
    bos = getattr(tokenizer, "bos_id", None)
    stops = list(getattr(tokenizer, "stop_ids", ()) or [eot_id])
    return {
        "bos_token_id": eot_id if bos is None else bos,
        "eos_token_id": stops[0] if len(stops) == 1 else stops,
    }


def export_hf(run: str | Path, out: str | Path, overwrite: bool = False) -> tuple[Path, str]:
    """`minigpt export --format hf`: the newest checkpoint of `run` (or an .npz export) as a transformers
    checkpoint folder. Returns (folder, transformers class)."""
    run, out = Path(run), Path(out)
    check_output(out, run, overwrite, "transformers checkpoint folder")
    hf_architecture(run_config(run).model)  # refuse before reading any weights
    setup, params, tokenizer, step = load_model(run)
    plain = dataclasses.replace(setup.cfg.model, lora=LoRAConfig())  # adapters are merged into the weights
    extra = {**to_dict(dataclasses.replace(setup.cfg, model=plain)), "step": step}
    extra["tokenizer_identity"] = tokenizer.identity
    arch = write_hf(out, setup.cfg.model, params, tokenizer, tokenizer.eot_id, extra, overwrite)
    return out, arch
