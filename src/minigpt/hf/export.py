"""Hugging Face transformers interop: export a trained run as a transformers checkpoint, import one back.

`export_hf` writes a folder that `AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`
load (config.json, generation_config.json, model.safetensors, tokenizer files), mapped onto the standard
class that computes exactly what minigpt computes. transformers and torch are not needed for this: the
weights are written with `safetensors.numpy`. The mapping:

  GPT2LMHeadModel   pre-norm LayerNorm, learned positions, GELU (tanh approximation: "gelu_new"), ReLU or
                    ReLU², plain multi-head attention, no QK-norm; tied embeddings (untied only without
                    biases: GPT-2's output layer has none). Without biases, GPT-2's biases are written as 0.
  LlamaForCausalLM  pre-norm RMSNorm, RoPE (the rotate-half layout), SwiGLU, grouped-query attention, tied or
                    untied; biases map to attention_bias + mlp_bias (untied only without biases).
  Qwen3ForCausalLM  the Llama shape plus QK-norm (RMSNorm of each query/key head before RoPE), without biases.
  ApertusForCausalLM
                    the Qwen3 shape with a plain MLP (up, activation, down): ReLU² (the cpu preset's block),
                    ReLU or GELU ("gelu_new"); always QK-norm (Apertus has no switch for it), no biases. Its
                    RoPE is written as plain RoPE (Apertus's own default is llama3 scaling).

Every norm's epsilon is minigpt's 1e-5. Anything else (post-norm blocks, RMSNorm with learned positions,
LayerNorm with RoPE, a plain MLP with RoPE but without QK-norm or with biases, ...) has no faithful
transformers equivalent and is refused with a one-line ConfigError naming the option, never exported
approximately. The padded vocabulary rows are cut back to `vocab_size`; scanned layers are unstacked; weights
are gathered from any mesh and written by process 0.

Tokenizers: GPT-2's BPE becomes vocab.json + merges.txt (GPT2Tokenizer); a trained byte-level BPE its
tokenizer.json (PreTrainedTokenizerFast). Both set `split_special_tokens: true`, so, as in minigpt, text
that spells "<|endoftext|>" is encoded as plain text (minigpt splits documents at end-of-text and never
makes the token from text); load with `AutoTokenizer.from_pretrained(DIR, split_special_tokens=False)` for
transformers' usual behaviour. End-of-text is bos/eos (and the generation pad) token, as in GPT-2: prompt
with it to start a new document. minigpt's own config is kept as minigpt_config.json.

`import_hf` is the reverse, for a local transformers checkpoint of one of those classes (safetensors
weights, float32/16 or bfloat16): it writes a run directory (config.json, tokenizer/, an Orbax checkpoint
at step 0 with a fresh optimizer state) that `minigpt generate`, `eval` and `train --run-dir` accept.
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
from minigpt.data.tokenizer import EOT, GPT2_FILES, BPETokenizer, GPT2Tokenizer, _byte_decoder
from minigpt.training.checkpoint import Checkpointer
from minigpt.training.runs import check_output, load_model, run_config
from minigpt.training.trainer import TrainState, build

NORM_EPS = 1e-5
"""model.Norm's epsilon: LayerNorm's layer_norm_epsilon, RMSNorm's rms_norm_eps."""
GPT2, LLAMA, QWEN3 = "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen3ForCausalLM"
APERTUS = "ApertusForCausalLM"
SUPPORTED = (GPT2, LLAMA, QWEN3, APERTUS)
GPT2_ACTIVATIONS = {"gelu": "gelu_new", "relu": "relu", "relu2": "relu2"}
"""minigpt's plain-MLP activation -> GPT-2's activation_function and Apertus's hidden_act (jax.nn.gelu is the
tanh approximation)."""
PLAIN_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu", "relu2": "relu2"}
"""The reverse, for import: a transformers activation name -> minigpt's."""
MINIGPT_CONFIG = "minigpt_config.json"


# ------------------------------------------------------------------------------------------ architecture


def hf_architecture(cfg: ModelConfig) -> str:
    """The transformers class that computes exactly this model, or a one-line ConfigError naming the option
    that prevents it."""

    def refuse(option: str, why: str) -> None:
        raise ConfigError(f"cannot export to transformers: {option} {why}; no transformers class computes it")

    if cfg.norm_position != "pre":
        refuse("model.norm_position=post", "(norm after the residual add)")
    if cfg.position == "learned":
        if cfg.norm != "layernorm":
            refuse("model.norm=rmsnorm", "with learned positions (GPT-2 uses LayerNorm)")
        if cfg.activation not in GPT2_ACTIVATIONS:
            refuse(f"model.activation={cfg.activation}", "with learned positions (GPT-2's MLP is not gated)")
        if cfg.qk_norm:
            refuse("model.qk_norm", "with learned positions (GPT-2 has no QK-norm)")
        if cfg.kv_heads != cfg.n_heads:
            refuse(
                f"model.n_kv_heads={cfg.n_kv_heads}",
                "with learned positions (GPT-2 has no grouped-query attention)",
            )
        if not cfg.tie_embeddings and cfg.bias:
            refuse("model.bias with untied embeddings", "(GPT-2's output layer has no bias)")
        return GPT2
    if cfg.norm != "rmsnorm":
        refuse("model.norm=layernorm", "with RoPE (Llama and Apertus use RMSNorm)")
    if not cfg.tie_embeddings and cfg.bias:
        refuse("model.bias with untied embeddings", "(Llama's output layer has no bias)")
    if cfg.activation in GPT2_ACTIVATIONS:
        if not cfg.qk_norm:
            refuse(f"model.activation={cfg.activation} with RoPE but without model.qk_norm", "(Apertus, the RoPE class with a plain MLP, always has QK-norm)")  # fmt: skip
        if cfg.bias:
            refuse(f"model.bias with model.activation={cfg.activation}", "and RoPE (Apertus's MLP has no biases)")  # fmt: skip
        return APERTUS
    if cfg.activation != "swiglu":
        refuse(f"model.activation={cfg.activation}", "with RoPE (Llama's MLP is SwiGLU)")
    if cfg.qk_norm:
        if cfg.bias:
            refuse("model.bias with model.qk_norm", "(Qwen3, Llama with QK-norm, has no MLP biases)")
        return QWEN3
    return LLAMA


def _tensor_table(cfg: ModelConfig, arch: str) -> list[tuple[str, tuple[str, ...], bool]]:
    """(transformers tensor, the minigpt parameters it is made of, transposed?) for every tensor of `arch`.

    minigpt names are dotted parameter paths with layers unstacked ("blocks.3.attn.q.kernel"); kernels are
    (in, out), as GPT-2's Conv1D weights, while nn.Linear weights are (out, in). c_attn is q, k, v
    concatenated along the output axis."""
    table: list[tuple[str, tuple[str, ...], bool]] = []
    if arch == GPT2:
        table += [("transformer.wte.weight", ("wte",), False), ("transformer.wpe.weight", ("wpe",), False)]
        for i in range(cfg.n_layers):
            h, b = f"transformer.h.{i}.", f"blocks.{i}."
            for hf, ours in (("ln_1", "ln1"), ("ln_2", "ln2")):
                table += [(f"{h}{hf}.weight", (f"{b}{ours}.scale",), False), (f"{h}{hf}.bias", (f"{b}{ours}.bias",), False)]  # fmt: skip
            for kind in ("weight", "bias"):
                ours = "kernel" if kind == "weight" else "bias"
                table += [
                    (f"{h}attn.c_attn.{kind}", tuple(f"{b}attn.{p}.{ours}" for p in "qkv"), False),
                    (f"{h}attn.c_proj.{kind}", (f"{b}attn.o.{ours}",), False),
                    (f"{h}mlp.c_fc.{kind}", (f"{b}mlp.up.{ours}",), False),
                    (f"{h}mlp.c_proj.{kind}", (f"{b}mlp.down.{ours}",), False),
                ]
        table += [("transformer.ln_f.weight", ("ln_f.scale",), False), ("transformer.ln_f.bias", ("ln_f.bias",), False)]  # fmt: skip
    else:
        table.append(("model.embed_tokens.weight", ("wte",), False))
        # Apertus: the same tensors but its norms' names and a plain MLP (no gate).
        norms = ("attention", "feedforward") if arch == APERTUS else ("input", "post_attention")
        mlp = ("up", "down") if arch == APERTUS else ("gate", "up", "down")
        for i in range(cfg.n_layers):
            h, b = f"model.layers.{i}.", f"blocks.{i}."
            table += [
                (f"{h}{norms[0]}_layernorm.weight", (f"{b}ln1.scale",), False),
                (f"{h}{norms[1]}_layernorm.weight", (f"{b}ln2.scale",), False),
            ]
            linears = [(f"self_attn.{p}_proj", f"attn.{p}") for p in "qkvo"]
            linears += [(f"mlp.{p}_proj", f"mlp.{p}") for p in mlp]
            for hf, ours in linears:
                table.append((f"{h}{hf}.weight", (f"{b}{ours}.kernel",), True))
                if cfg.bias:
                    table.append((f"{h}{hf}.bias", (f"{b}{ours}.bias",), False))
            if arch in (QWEN3, APERTUS):
                table += [
                    (f"{h}self_attn.q_norm.weight", (f"{b}attn.q_norm.scale",), False),
                    (f"{h}self_attn.k_norm.weight", (f"{b}attn.k_norm.scale",), False),
                ]
        table.append(("model.norm.weight", ("ln_f.scale",), False))
    if not cfg.tie_embeddings:
        table.append(("lm_head.weight", ("lm_head.kernel",), True))
    return table


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
            "layer_norm_epsilon": NORM_EPS,
            "resid_pdrop": cfg.dropout,
            "embd_pdrop": cfg.dropout,
            "attn_pdrop": 0.0,
            "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
        }
    out = {
        **common,
        "model_type": {LLAMA: "llama", QWEN3: "qwen3", APERTUS: "apertus"}[arch],
        "hidden_size": cfg.d_model,
        "intermediate_size": cfg.d_ff,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": GPT2_ACTIVATIONS[cfg.activation] if arch == APERTUS else "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": NORM_EPS,
        # transformers 5 reads rope_parameters, 4.x rope_theta (+ rope_scaling None): both say the same.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "rope_scaling": None,
        "attention_bias": cfg.bias,
        "attention_dropout": 0.0,
    }
    if arch == LLAMA:
        return out | {"mlp_bias": cfg.bias, "pretraining_tp": 1}
    if arch == APERTUS:  # not its default pad token 3, a real token whose embedding fine-tuning would freeze
        return out | {"pad_token_id": None}
    return out | {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": cfg.n_layers,
        "layer_types": ["full_attention"] * cfg.n_layers,
    }


# ------------------------------------------------------------------------------------------------ export


def _name(path: tuple) -> str:
    """'blocks.0.attn.q.kernel' for the key path of a parameter leaf."""
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey) and k.name != "value":
            parts.append(k.name)
    return ".".join(parts)


def gather_params(params: Any, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Every parameter as one host numpy array (gathered from any mesh), named by its dotted path, scanned
    layers unstacked into blocks.0..., blocks.{L-1}."""
    from jax.experimental import multihost_utils

    out: dict[str, np.ndarray] = {}
    for path, x in jax.tree_util.tree_leaves_with_path(params):
        name = _name(path)
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
    for hf, ours, transpose in _tensor_table(cfg, arch):
        value = np.concatenate([get(n) for n in ours], axis=-1) if len(ours) > 1 else get(ours[0])
        out[hf] = np.ascontiguousarray(value.T if transpose else value, dtype=np.float32)
    return out


def write_hf_tokenizer(tokenizer: Any, out: Path, max_seq_len: int) -> None:
    """Tokenizer files that AutoTokenizer loads to encode exactly as minigpt does."""
    settings = {
        "bos_token": EOT,
        "eos_token": EOT,
        "model_max_length": max_seq_len,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,  # "<|endoftext|>" in text is text, as in minigpt
    }
    if isinstance(tokenizer, GPT2Tokenizer):
        shutil.copyfile(tokenizer.files_dir / "encoder.json", out / "vocab.json")
        shutil.copyfile(tokenizer.files_dir / "vocab.bpe", out / "merges.txt")
        settings = {
            "tokenizer_class": "GPT2Tokenizer",
            **settings,
            "unk_token": EOT,
            "add_prefix_space": False,
            "add_bos_token": False,
            "errors": "replace",
        }
    elif isinstance(tokenizer, BPETokenizer):
        (out / "tokenizer.json").write_text(tokenizer.tok.to_str())
        settings = {"tokenizer_class": "PreTrainedTokenizerFast", **settings}
    else:
        raise ConfigError(f"cannot export a {type(tokenizer).__name__} tokenizer to transformers")
    (out / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


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
    from safetensors.numpy import save_file

    arch = hf_architecture(cfg)
    out = Path(out)
    check_output(out, None, overwrite, "transformers checkpoint folder")
    tensors = hf_tensors(cfg, arch, gather_params(params, cfg))
    if jax.process_index() != 0:
        return arch
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(json.dumps(hf_config(cfg, arch, eot_id), indent=2))
    generation = {"bos_token_id": eot_id, "eos_token_id": eot_id, "pad_token_id": eot_id}
    (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        write_hf_tokenizer(tokenizer, tmp, cfg.max_seq_len)
    if extra_config is not None:
        (tmp / MINIGPT_CONFIG).write_text(json.dumps(extra_config, indent=2))
    _replace_folder(tmp, out)
    return arch


def _write_run(out: Path, cfg: TrainConfig, tokenizer: Any, state: TrainState, meta: dict) -> None:
    """A run directory holding `state` as its step-0 checkpoint: written whole in a temporary folder, then
    put in place."""
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_json(cfg, str(tmp / "config.json"))
    tokenizer.save(tmp / "tokenizer")
    ckpt = Checkpointer(tmp, keep=cfg.keep_checkpoints)
    ckpt.save(
        0, state, _fresh_data_state(cfg), {"tokenizer": tokenizer.identity, "step": 0, "val": None, **meta}
    )
    ckpt.close()
    _replace_folder(tmp, out)


def _replace_folder(new: Path, out: Path) -> None:
    """Put the finished folder `new` at `out`; an old `out` is removed only once `new` is in place."""
    old = out.with_name(out.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if out.exists():
        out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)


def export_hf(run: str | Path, out: str | Path, overwrite: bool = False) -> tuple[Path, str]:
    """`minigpt export --format hf`: the newest checkpoint of `run` (or an .npz export) as a transformers
    checkpoint folder. Returns (folder, transformers class)."""
    run, out = Path(run), Path(out)
    check_output(out, run, overwrite, "transformers checkpoint folder")
    hf_architecture(run_config(run).model)  # refuse before reading any weights
    setup, params, tokenizer, step = load_model(run)
    extra = {**to_dict(setup.cfg), "step": step, "tokenizer_identity": tokenizer.identity}
    arch = write_hf(out, setup.cfg.model, params, tokenizer, tokenizer.eot_id, extra, overwrite)
    return out, arch


# ------------------------------------------------------------------------------------------------ import

_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16}


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a .safetensors file as numpy arrays, bfloat16 included (numpy has no bfloat16, so
    safetensors.numpy cannot read it); float tensors are returned as float32 (exactly)."""
    import ml_dtypes

    dtypes = {**_SAFETENSORS_DTYPES, "BF16": ml_dtypes.bfloat16}
    raw = path.read_bytes()
    try:
        header, base = _safetensors_header(raw)
    except ValueError as e:
        raise ConfigError(
            f"{path} is not a readable safetensors file ({e}); copy or download it again, or re-save it "
            "with model.save_pretrained(DIR)"
        ) from None
    out = {}
    for name, info in header.items():
        if info["dtype"] not in dtypes:
            continue  # integer buffers (old GPT-2 attention masks) are not weights
        start, end = info["data_offsets"]
        dtype = np.dtype(dtypes[info["dtype"]])
        value = np.frombuffer(raw, dtype, (end - start) // dtype.itemsize, base + start)
        out[name] = value.reshape(info["shape"]).astype(np.float32)
    return out


_ITEMSIZE = dict(F64=8, F32=4, F16=2, BF16=2, I64=8, I32=4, I16=2, I8=1, U8=1, BOOL=1)
"""Bytes per element of the safetensors dtypes, for checking each tensor's extent against its shape."""


def _safetensors_header(raw: bytes) -> tuple[dict[str, dict], int]:
    """A safetensors file's tensor entries (name -> dtype, shape, data_offsets) and where its data starts;
    a ValueError saying what is wrong with a torn or damaged file."""
    if len(raw) < 8:
        raise ValueError(f"{len(raw)} bytes, fewer than a header needs")
    n = int.from_bytes(raw[:8], "little")
    if n > len(raw) - 8:
        raise ValueError(
            f"its header claims {n:,} bytes, the file has {len(raw):,}: truncated or not safetensors"
        )
    try:
        header = json.loads(raw[8 : 8 + n])
    except ValueError:
        raise ValueError("its header is not JSON: damaged, or not a safetensors file") from None
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    header.pop("__metadata__", None)
    for name, info in header.items():
        try:
            (start, end), shape, kind = info["data_offsets"], info["shape"], info["dtype"]
            ok = isinstance(kind, str) and all(isinstance(x, int) and x >= 0 for x in [start, end, *shape])
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok or start > end:
            raise ValueError(f"its header's entry for {name!r} is malformed")
        if 8 + n + end > len(raw):
            raise ValueError(f"truncated: {name} ends at byte {8 + n + end:,}, the file has {len(raw):,}")
        size, count = _ITEMSIZE.get(kind), math.prod(shape)
        if size is not None and (end - start) != count * size:
            raise ValueError(f"{name} holds {end - start:,} bytes, not the {count * size:,} its shape needs")
    return header, 8 + n


def _read_weights(hf_dir: Path) -> dict[str, np.ndarray]:
    index = hf_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_bytes())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ConfigError(f"{index} is not a readable safetensors index (no JSON weight_map)") from None
        missing = [f for f in files if not (hf_dir / str(f)).is_file()]
        if missing:
            raise ConfigError(f"{index} lists {missing[0]}, which is not in {hf_dir}; copy the whole folder")
    elif (hf_dir / "model.safetensors").is_file():
        files = ["model.safetensors"]
    elif any(hf_dir.glob("*.bin")) or any(hf_dir.glob("*.pt")):
        raise ConfigError(
            f"{hf_dir} holds PyTorch pickles; minigpt reads safetensors only: re-save with "
            "model.save_pretrained(DIR, safe_serialization=True)"
        )
    else:
        raise ConfigError(f"{hf_dir} has no model.safetensors")
    out: dict[str, np.ndarray] = {}
    for f in files:
        out |= read_safetensors(hf_dir / f)
    return out


def _rope_theta(c: dict, arch: str) -> float:
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling")
    if arch == APERTUS and not (params or scaling):
        raise ConfigError("cannot import: the config names no RoPE, so ApertusConfig's default applies: llama3 RoPE scaling, which has no minigpt equivalent")  # fmt: skip
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default" or (scaling and scaling.get("rope_type", scaling.get("type")) != "default"):
        raise ConfigError(f"cannot import: RoPE scaling ({scaling or params}) has no minigpt equivalent")
    return float(params.get("rope_theta", c.get("rope_theta", 10_000.0)))


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
    need(c.get("layer_norm_epsilon", 1e-5) == NORM_EPS, f"layer_norm_epsilon={c.get('layer_norm_epsilon')} (minigpt: 1e-5)")  # fmt: skip
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
    )


def _llama_model(c: dict, arch: str, need: Any) -> ModelConfig:
    """Llama, Qwen3 (Llama with QK-norm and no biases) or Apertus (Qwen3 with a plain MLP)."""
    fn = c.get("hidden_act", "xielu" if arch == APERTUS else "silu")  # the config classes' defaults
    if arch == APERTUS:
        acts, mlp = PLAIN_ACTIVATIONS, "plain MLP is ReLU², ReLU or tanh GELU"
    else:
        acts, mlp = {"silu": "swiglu"}, "gated MLP is SwiGLU"
    need(fn in acts, f"hidden_act={fn!r} (minigpt's {mlp})")
    need(c.get("rms_norm_eps") == NORM_EPS, f"rms_norm_eps={c.get('rms_norm_eps')} (minigpt: 1e-5)")
    d, heads = c["hidden_size"], c["num_attention_heads"]
    need(
        c.get("head_dim") in (None, d // heads),
        f"head_dim={c.get('head_dim')} != hidden_size/heads={d // heads}",
    )
    tied = c.get("tie_word_embeddings", False)
    if arch == LLAMA:
        bias = bool(c.get("attention_bias", False))
        need(
            bias == bool(c.get("mlp_bias", False)), "attention_bias != mlp_bias (minigpt has one bias switch)"
        )
    else:
        bias = False
        need(not c.get("attention_bias", False), f"attention_bias ({arch.removesuffix('ForCausalLM')}'s MLP has no biases)")  # fmt: skip
        need(not c.get("use_sliding_window", False), "use_sliding_window")
    need(tied or not bias, "biases with untied embeddings (an output layer without bias)")
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
        rope_theta=_rope_theta(c, arch),
        activation=acts[fn],
        qk_norm=arch in (QWEN3, APERTUS),
        n_kv_heads=0 if kv == heads else kv,
        tie_embeddings=tied,
        bias=bias,
    )


def minigpt_arrays(cfg: ModelConfig, arch: str, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """minigpt parameters (dotted names, layers unstacked, vocabulary padded with zero rows) from a
    transformers state dict; refuses missing and unexpected tensors."""
    if arch == GPT2:  # GPT-2 checkpoints from the hub name the base model's tensors without "transformer."
        tensors = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in tensors.items()}  # fmt: skip
    table = _tensor_table(cfg, arch)
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
    pad = cfg.padded_vocab - cfg.vocab_size
    out["wte"] = np.pad(out["wte"], ((0, pad), (0, 0)))
    if "lm_head.kernel" in out:
        out["lm_head.kernel"] = np.pad(out["lm_head.kernel"], ((0, 0), (0, pad)))
    return out


def read_hf_tokenizer(hf_dir: Path, eos_id: int | None) -> GPT2Tokenizer | BPETokenizer:
    """minigpt's tokenizer for a transformers folder: GPT-2's BPE (vocab.json + merges.txt, byte-identical
    to GPT-2's files) or a byte-level BPE tokenizer.json whose end-of-text token is "<|endoftext|>"."""
    import hashlib

    def sha(name: str) -> str | None:
        p = hf_dir / name
        return hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None

    if sha("vocab.json") == GPT2_FILES["encoder.json"] and sha("merges.txt") == GPT2_FILES["vocab.bpe"]:
        return _gpt2_from(hf_dir / "vocab.json", hf_dir / "merges.txt")
    if not (hf_dir / "tokenizer.json").is_file():
        raise ConfigError(
            f"{hf_dir} has no tokenizer minigpt can use: GPT-2's vocab.json + merges.txt, or a byte-level "
            "BPE tokenizer.json"
        )
    from tokenizers import Tokenizer as HFTokenizer

    try:
        hf_tok = HFTokenizer.from_file(str(hf_dir / "tokenizer.json"))
    except Exception as e:
        raise ConfigError(f"cannot read {hf_dir / 'tokenizer.json'}: {e}") from None
    spec = json.loads(hf_tok.to_str())
    pre = spec.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if spec["model"]["type"] != "BPE" or not any(p.get("type") == "ByteLevel" for p in pres):
        raise ConfigError(f"{hf_dir / 'tokenizer.json'} is not a byte-level BPE; minigpt cannot use it")
    if hf_tok.token_to_id(EOT) is None:
        raise ConfigError(f"{hf_dir / 'tokenizer.json'} has no {EOT} token, minigpt's end-of-text")
    tok = BPETokenizer(hf_tok)
    table = _byte_decoder()
    odd = [t for t, i in hf_tok.get_vocab().items() if i != tok.eot_id and not all(ch in table for ch in t)]
    if odd:
        raise ConfigError(f"{hf_dir / 'tokenizer.json'} has a token that is not byte-level text: {odd[0]!r}")
    if eos_id is not None and eos_id != tok.eot_id:
        raise ConfigError(
            f"the model's eos_token_id {eos_id} is not {EOT} ({tok.eot_id}), minigpt's end-of-text"
        )
    return tok


def _gpt2_from(vocab_json: Path, merges_txt: Path) -> GPT2Tokenizer:
    """GPT2Tokenizer from transformers' vocab.json + merges.txt (GPT-2's encoder.json + vocab.bpe), staged
    in a temporary folder under minigpt's names (the caller removes `files_dir` once saved)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="minigpt-gpt2-"))
    shutil.copyfile(vocab_json, folder / "encoder.json")
    shutil.copyfile(merges_txt, folder / "vocab.bpe")
    return GPT2Tokenizer(folder)


_ARCH_FIELDS = (
    "vocab_size", "max_seq_len", "d_model", "n_layers", "n_heads", "d_ff", "norm_position", "norm", "position",
    "rope_theta", "activation", "qk_norm", "kv_heads", "tie_embeddings", "bias",
)  # fmt: skip
"""What a transformers config determines; the other ModelConfig fields (dtype, scan_layers, dropout,
init...) do not change the function the weights compute."""


def _same_function(a: ModelConfig, b: ModelConfig) -> bool:
    return all(getattr(a, f) == getattr(b, f) for f in _ARCH_FIELDS)


def _fresh_data_state(cfg: TrainConfig) -> dict:
    """The data iterator position of a run that has not trained yet (the same pipeline, on dummy tokens)."""
    local = cfg.batch_size // jax.process_count() * cfg.grad_accum

    class _Store:
        def tokens(self, split: str) -> np.ndarray:
            return np.zeros(cfg.data.seq_len * local * jax.process_count() + 1, np.int32)

    return train_iterator(_Store(), cfg.data.seq_len, local, cfg.seed).get_state()


def _flag(key: str, value: Any) -> list[str]:
    """The tyro flag(s) that set config field `key` (dotted, e.g. "model.d_model") to `value`."""
    special = {"data.paths": "--data", "data.val_paths": "--val-data"}
    head, _, last = key.rpartition(".")
    prefix = f"--{head}." if head else "--"
    if isinstance(value, bool):
        return [prefix + ("" if value else "no-") + last.replace("_", "-")]
    flag = special.get(key, prefix + last.replace("_", "-"))
    return [flag, *map(str, value)] if isinstance(value, list | tuple) else [flag, str(value)]


def train_command(cfg: TrainConfig) -> str:
    """A `minigpt train` command line whose config equals `cfg` (so it continues the run in cfg.run_dir):
    the flags that differ from the cpu preset's defaults."""
    base, want = to_dict(get_preset("cpu")), to_dict(cfg)
    args = ["minigpt", "train", "--run-dir", cfg.run_dir]
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
) -> tuple[Path, str, str | None]:
    """`minigpt import`: a run directory from a local transformers checkpoint. Returns (run directory,
    transformers class, a `minigpt train` command that continues pretraining it, or None where minigpt
    cannot tokenize a corpus with the checkpoint's tokenizer: a byte-level BPE that minigpt did not train
    on the run's own data, which `train`/`eval` would replace by a newly trained one).

    If the folder was written by `export_hf` (it holds minigpt_config.json) and its model is unchanged, the
    original run's config is restored, so `eval` reads the same data and training continues with the
    original flags. Otherwise the config is the cpu preset's with the checkpoint's model and `data` (default:
    the cpu preset's), its tokenizer fields set to the imported tokenizer. The checkpoint is at step 0 with
    a fresh optimizer state."""
    hf_dir, out = Path(hf_dir), Path(out).absolute()
    if not (hf_dir / "config.json").is_file():
        raise ConfigError(f"{hf_dir} is not a transformers checkpoint folder (no config.json)")
    check_output(out, hf_dir, overwrite, "run directory")
    try:
        hf_cfg = json.loads((hf_dir / "config.json").read_bytes())
        model, arch = model_config_from_hf(hf_cfg)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        why = f"no {e}" if isinstance(e, KeyError) else str(e).splitlines()[0]
        raise ConfigError(f"{hf_dir / 'config.json'} is not a readable transformers config ({why})") from None
    eos = hf_cfg.get("eos_token_id")
    tokenizer = read_hf_tokenizer(hf_dir, eos if isinstance(eos, int) else None)
    try:
        return _import(hf_dir, out, model, arch, tokenizer, data)
    finally:
        if isinstance(tokenizer, GPT2Tokenizer):
            shutil.rmtree(tokenizer.files_dir, ignore_errors=True)  # the staged copy; the run holds its own


def _import(
    hf_dir: Path, out: Path, model: ModelConfig, arch: str, tokenizer: Any, data: DataConfig | None
) -> tuple[Path, str, str | None]:
    if model.vocab_size < tokenizer.vocab_size:
        raise ConfigError(f"the model's vocab_size {model.vocab_size} is smaller than its tokenizer's {tokenizer.vocab_size}")  # fmt: skip

    cfg: TrainConfig | None = None
    restored = False
    if (hf_dir / MINIGPT_CONFIG).is_file():
        try:
            saved = json.loads((hf_dir / MINIGPT_CONFIG).read_bytes())
            extra = ("step", "tokenizer_identity")  # what export_hf adds to the run's config
            fields = {k: v for k, v in saved.items() if k not in extra} if isinstance(saved, dict) else saved
            original = from_dict(fields)
        except (ConfigError, ValueError) as e:
            raise ConfigError(
                f"{hf_dir / MINIGPT_CONFIG} is not a readable minigpt config ({e}); delete it to import the "
                "weights with the cpu preset's config"
            ) from None
        same_tokenizer = saved.get("tokenizer_identity") == tokenizer.identity
        if _same_function(original.model, model) and same_tokenizer and data is None:
            cfg = dataclasses.replace(original, run_dir=str(out), overwrite=False)
            restored = True
    if cfg is None:
        preset = get_preset("cpu")
        data = data or preset.data
        if isinstance(tokenizer, GPT2Tokenizer):
            tok_fields = {"tokenizer": "gpt2", "gpt2_dir": str(out / "tokenizer")}
        else:
            tok_fields = {"tokenizer": "bpe", "bpe_vocab_size": tokenizer.vocab_size}
        data = dataclasses.replace(data, seq_len=min(data.seq_len, model.max_seq_len), **tok_fields)
        cfg = dataclasses.replace(preset, run_dir=str(out), model=model, data=data)

    weights = minigpt_arrays(cfg.model, arch, _read_weights(hf_dir))
    # Build on this process's devices, data parallel (the checkpoint restores onto any mesh later).
    n = jax.device_count()
    local = dataclasses.replace(cfg, mesh=MeshConfig(), batch_size=math.lcm(cfg.batch_size, n))
    setup = build(local)

    def leaf(path: tuple, spec: jax.ShapeDtypeStruct) -> jax.Array:
        name = _name(path)
        if cfg.model.scan_layers and name.startswith("blocks."):
            rest = name.removeprefix("blocks.")
            value = np.stack([weights[f"blocks.{i}.{rest}"] for i in range(cfg.model.n_layers)])
        else:
            value = weights[name]
        if value.shape != spec.shape:
            raise ConfigError(f"cannot import: {name} has shape {value.shape}, the config needs {spec.shape}")
        return jax.device_put(value.astype(spec.dtype), spec.sharding)

    params = jax.tree_util.tree_map_with_path(leaf, setup.abstract_state.params)
    fresh = functools.partial(TrainState.create, tx=setup.tx(cfg.steps), seed=cfg.seed)
    state = jax.jit(fresh, out_shardings=setup.state_shardings)(params)
    _write_run(out, cfg, tokenizer, state, {"imported_from": str(hf_dir.absolute())})
    # minigpt tokenizes a corpus with GPT-2's BPE, or with a BPE it trains on that corpus: the original run's.
    can_continue = isinstance(tokenizer, GPT2Tokenizer) or restored
    return out, arch, train_command(cfg) if can_continue else None
