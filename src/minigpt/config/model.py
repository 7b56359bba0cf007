"""The model's shape and how it computes (`--model.*`): a decoder-only transformer's sizes, its norms,
positions, attention and MLP variants, the compute dtype, remat and the chunked loss."""

from __future__ import annotations

import dataclasses
import math
from typing import Annotated, Literal

import tyro

from minigpt.config.fields import resume_safe
from minigpt.config.lora import LoRAConfig
from minigpt.runtime.errors import check

REMAT_POLICIES = ("none", "dots", "projections", "full")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer shape. `vocab_size=0` takes the tokenizer's vocabulary."""

    vocab_size: int = 0
    max_seq_len: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    d_ff: int = 1024
    dropout: float = 0.0
    """Dropout on embeddings and each residual branch while training (rounded to a multiple of 2^-16)."""
    norm_position: Literal["pre", "post"] = "pre"
    """pre: GPT-2 style, norm before each sublayer; post: norm after the residual add (the original
    Transformer's and the Flax miniGPT tutorial's blocks)."""
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    position: Literal["learned", "rope"] = "learned"
    """learned: a table of max_seq_len position vectors (GPT-2); rope: rotary embeddings in attention."""
    rope_theta: float = 10_000.0
    rope_scaling: Literal["none", "llama3"] = "none"
    """llama3: Llama 3.1's RoPE frequency scaling (low frequencies divided by rope_factor, high ones kept,
    those between interpolated), for checkpoints trained with it."""
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    """The llama3 scaling's parameters (transformers' rope_parameters: factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings)."""
    activation: Literal["gelu", "relu", "relu2", "swiglu"] = "gelu"
    """MLP non-linearity; swiglu adds a gate matrix (keep d_ff ~ 8/3 d_model for the same size as 4 d_model)."""
    qk_norm: bool = False
    """RMS-normalise queries and keys per head before attention: bounds the attention logits."""
    value_residual: bool = False
    """Mix the first layer's attention values into every later layer's, in a learned share per layer
    (ResFormer's value residual). No transformers class computes it: such a model does not export."""
    value_embeddings: int = 0
    """Tables of per-token value vectors (modded-nanogpt's value embeddings): layer i adds its token's vector
    from table i mod n to its attention values, in a learned share. 0: none. No transformers class computes
    them: such a model does not export."""
    n_kv_heads: int = 0
    """Key/value heads for grouped-query attention (0: n_heads, i.e. plain multi-head attention)."""
    head_dim: int = 0
    """Width of each attention head (0: d_model / n_heads); queries are n_heads x head_dim wide."""
    tie_embeddings: bool = False
    bias: bool = True
    qkv_bias: bool = False
    """Biases on the query, key and value projections only (Qwen2's); `bias` puts them everywhere."""
    norm_eps: float = 1e-5
    """The epsilon every norm (QK-norm too) adds to the variance."""
    scaled_init: bool = True
    """Initialise residual projections (attention output, MLP down) with std 0.02/sqrt(2 n_layers)."""
    dtype: Literal["auto", "float32", "bfloat16"] = resume_safe("float32")
    """Compute dtype; parameters and optimizer state stay float32. bfloat16 multiplies bfloat16 operands with
    float32 accumulation and keeps norms, softmax and the loss in float32. auto: bfloat16 on accelerators,
    and on a CPU where a dense layer trains faster in it (matrix units such as AMX or AVX-512 BF16: measured
    once per machine), float32 elsewhere; every preset's default."""
    attention: Literal["auto", "xla", "cudnn", "mixed", "splash"] = "auto"
    """xla, cudnn: jax.nn.dot_product_attention's implementations; mixed: minigpt's, bfloat16 products with
    float32 accumulation laid out for the CPU's matrix units; splash: JAX's Pallas TPU kernel (no scores in
    memory; plain causal attention over sequences a multiple of 128 long, else xla; interpreted, slowly, off a
    TPU). auto: on TPUs splash for sequences of 512 tokens or more and xla below; in bfloat16 cudnn on GPUs and
    mixed on CPUs; xla in float32."""
    remat: Literal["none", "dots", "projections", "full"] = resume_safe("none")
    """What each layer keeps for the backward pass; the rest is recomputed there (less memory, more compute).
    none: everything; dots: every matmul's output (elementwise work is recomputed); projections: the
    outputs of the weight matmuls but nothing inside attention (scores and probabilities are recomputed);
    full: only the layer's input. With --model.scan-layers the backward pass recomputes layer by layer; with
    unrolled layers XLA's CPU scheduler may recompute early and save little."""
    loss_chunk: int = resume_safe(-1)
    """Sequence positions per chunk of the output layer's loss and gradients, so the batch x sequence x vocab
    logits never exist at once (0: all at once; -1: the power of two nearest 2^24 logits per chunk)."""
    scan_layers: bool = False
    """Stack the layers' parameters and run them with lax.scan: compile time stays flat with depth."""
    document_attention: bool = False
    """Attention stays inside a document of a packed window and positions restart at each document: a
    document's end-of-text token starts the next one (at position 0), so every document is modelled as if it
    began its window, as in generation and task evaluation."""
    eot_id: int = -1
    """The end-of-text token that separates documents (-1: the tokenizer's)."""
    vocab_multiple: int = 128
    """The embedding/output tables are padded to a multiple of this (padded logits are masked), so any
    tensor-parallel size divides the vocabulary and matmuls stay aligned."""
    lora: Annotated[LoRAConfig, tyro.conf.arg(name="lora", prefix_name=False)] = LoRAConfig()

    def __post_init__(self) -> None:
        check(
            self.vocab_size >= 0, f"model.vocab_size must be >= 0 (0 = from tokenizer), got {self.vocab_size}"
        )
        check(
            self.remat in REMAT_POLICIES,
            f"model.remat must be one of {', '.join(REMAT_POLICIES)}, got {self.remat!r}",
        )
        check(
            self.eot_id >= -1, f"model.eot_id must be a token id or -1 (the tokenizer's), got {self.eot_id}"
        )
        check(self.loss_chunk >= -1, f"model.loss_chunk must be >= 0 or -1 (auto), got {self.loss_chunk}")
        for name in ("max_seq_len", "d_model", "n_layers", "n_heads", "d_ff", "vocab_multiple"):
            check(getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}")
        check(
            self.head_dim > 0 or self.d_model % self.n_heads == 0,
            f"model.d_model={self.d_model} must be divisible by model.n_heads={self.n_heads} (or set "
            "model.head_dim)",
        )
        check(self.head_dim >= 0, f"model.head_dim must be >= 0 (0: d_model / n_heads), got {self.head_dim}")
        check(0 < self.norm_eps < 1, f"model.norm_eps must be in (0, 1), got {self.norm_eps}")
        for name in ("rope_factor", "rope_low_freq_factor", "rope_original_max_len"):
            check(getattr(self, name) > 0, f"model.{name} must be positive, got {getattr(self, name)}")
        check(
            self.rope_high_freq_factor > self.rope_low_freq_factor,
            "model.rope_high_freq_factor must be larger than model.rope_low_freq_factor",
        )
        check(0.0 <= self.dropout < 1.0, f"model.dropout must be in [0, 1), got {self.dropout}")
        check(self.n_kv_heads >= 0, f"model.n_kv_heads must be >= 0, got {self.n_kv_heads}")
        check(
            self.value_embeddings >= 0,
            f"model.value_embeddings must be >= 0 (0: none), got {self.value_embeddings}",
        )
        check(
            self.n_heads % self.kv_heads == 0,
            f"model.n_heads={self.n_heads} must be a multiple of model.n_kv_heads={self.n_kv_heads}",
        )
        check(
            self.position != "rope" or self.head_size % 2 == 0,
            f"RoPE needs an even head dimension, got {self.head_size}",
        )
        check(self.rope_theta > 0, f"model.rope_theta must be positive, got {self.rope_theta}")
        check(
            "gate" not in self.lora.targets or self.activation == "swiglu",
            f"lora.targets names gate, but this model's MLP has no gate projection ({self.activation}, not "
            "swiglu); leave it out",
        )

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def padded_vocab(self) -> int:
        return math.ceil(self.vocab_size / self.vocab_multiple) * self.vocab_multiple
