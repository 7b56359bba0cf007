"""Which transformers class computes exactly what a minigpt model computes, and how their tensors correspond.

Both directions use this map: export writes a model as the class `hf_architecture` names, import reads a
checkpoint of one of those classes back. The classes:

  GPT2LMHeadModel   pre-norm LayerNorm, learned positions, GELU (tanh approximation: "gelu_new"), ReLU or
                    ReLU², plain multi-head attention, no QK-norm; tied embeddings (untied only without
                    biases: GPT-2's output layer has none). Without biases, GPT-2's biases are written as 0.
  LlamaForCausalLM  pre-norm RMSNorm, RoPE (the rotate-half layout, plain or with Llama 3.1's scaling),
                    SwiGLU, grouped-query attention, any head width, tied or untied; biases map to
                    attention_bias + mlp_bias (untied only without biases).
  Qwen2ForCausalLM  the Llama shape with biases on the query, key and value projections only (qkv_bias).
  Qwen3ForCausalLM  the Llama shape plus QK-norm (RMSNorm of each query/key head before RoPE), without biases.
  ApertusForCausalLM
                    the Qwen3 shape with a plain MLP (up, activation, down): ReLU² (the cpu preset's block),
                    ReLU or GELU ("gelu_new"); always QK-norm (Apertus has no switch for it), no biases. Its
                    RoPE is written as plain RoPE (Apertus's own default is llama3 scaling).

Every norm's epsilon is the model's norm_eps. Anything else (post-norm blocks, RMSNorm with learned positions,
LayerNorm with RoPE, a plain MLP with RoPE but without QK-norm or with biases, ...) has no faithful
transformers equivalent and is refused with a one-line ConfigError naming the option, never mapped
approximately.
"""

from __future__ import annotations

import jax

from minigpt.config import ConfigError, ModelConfig

GPT2, LLAMA, QWEN2, QWEN3 = "GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
APERTUS = "ApertusForCausalLM"
SUPPORTED = (GPT2, LLAMA, QWEN2, QWEN3, APERTUS)
GPT2_ACTIVATIONS = {"gelu": "gelu_new", "relu": "relu", "relu2": "relu2"}
"""minigpt's plain-MLP activation -> GPT-2's activation_function and Apertus's hidden_act (jax.nn.gelu is the
tanh approximation)."""
PLAIN_ACTIVATIONS = {"gelu_new": "gelu", "gelu_pytorch_tanh": "gelu", "relu": "relu", "relu2": "relu2"}
"""The reverse, for import: a transformers activation name -> minigpt's."""


def param_name(path: tuple) -> str:
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


def hf_architecture(cfg: ModelConfig) -> str:
    """The transformers class that computes exactly this model, or a one-line ConfigError naming the option
    that prevents it."""

    def refuse(option: str, why: str) -> None:
        raise ConfigError(f"cannot export to transformers: {option} {why}; no transformers class computes it")

    if cfg.norm_position != "pre":
        refuse("model.norm_position=post", "(norm after the residual add)")
    if cfg.value_residual:
        refuse("model.value_residual", "(the first layer's values mixed into every layer's)")
    if cfg.value_embeddings:
        refuse(f"model.value_embeddings={cfg.value_embeddings}", "(tables of values added to attention's)")
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
        if cfg.head_size * cfg.n_heads != cfg.d_model:
            refuse(f"model.head_dim={cfg.head_dim}", "with learned positions (GPT-2's heads split d_model)")
        return GPT2
    if cfg.norm != "rmsnorm":
        refuse("model.norm=layernorm", "with RoPE (Llama and Apertus use RMSNorm)")
    if not cfg.tie_embeddings and cfg.bias:
        refuse("model.bias with untied embeddings", "(Llama's output layer has no bias)")
    if cfg.activation in GPT2_ACTIVATIONS:
        if not cfg.qk_norm:
            refuse(f"model.activation={cfg.activation} with RoPE but without model.qk_norm", "(Apertus, the RoPE class with a plain MLP, always has QK-norm)")  # fmt: skip
        if cfg.bias or cfg.qkv_bias:
            refuse(f"{_biases(cfg)} with model.activation={cfg.activation}", "and RoPE (Apertus has no biases)")  # fmt: skip
        return APERTUS
    if cfg.activation != "swiglu":
        refuse(f"model.activation={cfg.activation}", "with RoPE (Llama's MLP is SwiGLU)")
    if cfg.qk_norm:
        if cfg.bias or cfg.qkv_bias:
            refuse(f"{_biases(cfg)} with model.qk_norm", "(Qwen3, Llama with QK-norm, has no biases)")
        return QWEN3
    return QWEN2 if cfg.qkv_bias and not cfg.bias else LLAMA


def _biases(cfg: ModelConfig) -> str:
    return "model.bias" if cfg.bias else "model.qkv_bias"


def tensor_table(cfg: ModelConfig, arch: str) -> list[tuple[str, tuple[str, ...], bool]]:
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
                if cfg.bias or (cfg.qkv_bias and ours[-1] in "qkv" and ours.startswith("attn.")):
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
