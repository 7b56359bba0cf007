"""A decoder-only transformer in Flax NNX. Every parameter carries logical axis names (`axes=`), which
`sharding.py` maps onto the mesh, so the same module runs data parallel, FSDP or tensor parallel.

The architecture is configurable (`ModelConfig`): the Flax miniGPT tutorial's (post-norm, learned positions,
ReLU) and a modern one (pre-norm RMSNorm, RoPE, SwiGLU or ReLU², QK-norm, grouped-query attention, no biases,
tied embeddings) are both reachable, with layers unrolled or scanned and optionally rematerialised.

Shapes are named in variables: B batch, T time, D model width, N query heads, K key/value heads,
G query heads per key/value head, H head dim, F feed-forward, V vocab, L layers, S cache slots.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from minigpt.config import LoRAConfig, ModelConfig
from minigpt.nn import lora, loss, matmul
from minigpt.nn.attention import attend, cached_attention
from minigpt.nn.dropout import dropout
from minigpt.nn.lora import Adapter
from minigpt.nn.rope import rope, rotation
from minigpt.parallel.sharding import activation_sharding_constraint, gathered, logical_axes

Axes = tuple[str | None, ...]
KVCache = tuple[jax.Array, jax.Array]
"""Keys and values of every layer, each (L, B, K, S, H) in the compute dtype: slot p of a row holds the
key/value of the token at position p of that row."""
Values = tuple[jax.Array, jax.Array] | None
"""`value_residual`'s carry from layer to layer: (whether the first layer has run, its values (B, T, K, H));
None without it."""
Stream = tuple[jax.Array, Values]
"""What one layer passes the next: the residual stream (B, T, D) and `Values`."""


REMAT_POLICIES: dict[str, Callable[..., bool] | None] = {
    "dots": jax.checkpoint_policies.checkpoint_dots,
    # Attention's matmuls (scores, probabilities x values) have batch dimensions; the projections' do not.
    "projections": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "full": None,  # jax.checkpoint's default: save nothing but the inputs
}
"""`ModelConfig.remat` -> the jax.checkpoint policy saying which intermediate values a layer keeps."""


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], axes: Axes, std: float) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


def _zeros(shape: tuple[int, ...], axes: Axes) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, jnp.float32), axes=axes)


class Norm(nnx.Module):
    """LayerNorm (centre and scale, optional bias) or RMSNorm (scale only), computed in float32."""

    def __init__(self, d: int, kind: str, bias: bool, eps: float, axes: Axes = ("embed",)) -> None:
        self.rms, self.eps = kind == "rmsnorm", eps
        self.scale = nnx.Param(jnp.ones((d,), jnp.float32), axes=axes)
        self.bias = _zeros((d,), axes) if bias and not self.rms else None

    def __call__(self, x: jax.Array) -> jax.Array:
        h = x.astype(jnp.float32)
        if not self.rms:
            h = h - h.mean(-1, keepdims=True)
        h = h * jax.lax.rsqrt(jnp.square(h).mean(-1, keepdims=True) + self.eps) * self.scale[...]
        if self.bias is not None:
            h = h + self.bias[...]
        return h.astype(x.dtype)


class Linear(nnx.Module):
    """y = x @ W (+ b) with W (in, out) named by `axes`, in the input's dtype: a 16-bit input multiplies with
    float32 accumulation, forward and backward (`matmul.dense`). With `lora`, plus a low-rank adapter's
    output (`minigpt.nn.lora`), its dropout driven by `key`."""

    def __init__(
        self,
        d_in: int,
        d_out: int,
        axes: Axes,
        bias: bool,
        std: float,
        rngs: nnx.Rngs,
        lora: LoRAConfig | None = None,
    ) -> None:
        self.kernel = _param(rngs, (d_in, d_out), axes, std)
        self.bias = _zeros((d_out,), (axes[1],)) if bias else None
        self.adapter = Adapter(lora, d_in, d_out, axes, rngs) if lora is not None else None

    def __call__(self, x: jax.Array, key: jax.Array | None = None) -> jax.Array:
        w, b = gathered(self.kernel), None if self.bias is None else self.bias[...]
        y = x @ w if x.dtype == jnp.float32 else matmul.dense(x, w, b, x.dtype)
        if b is not None and x.dtype == jnp.float32:
            y = y + b
        if self.adapter is not None:
            y = y + self.adapter(x, key)
        return y


def _linear(
    cfg: ModelConfig, name: str, d_in: int, d_out: int, axes: Axes, bias: bool, std: float, rngs: nnx.Rngs
) -> Linear:
    """The projection `name` (q, k, v, o, gate, up, down), with an adapter if --lora.targets names it."""
    return Linear(d_in, d_out, axes, bias, std, rngs, cfg.lora if cfg.lora.adapts(name) else None)


def _residual_std(cfg: ModelConfig) -> float:
    """GPT-2's scaled init: projections into the residual stream get std 0.02/sqrt(2L), so the stream's
    variance does not grow with depth."""
    return 0.02 / math.sqrt(2 * cfg.n_layers) if cfg.scaled_init else 0.02


class Attention(nnx.Module):
    """Causal self-attention with grouped key/value heads; heads are split over the tensor axis
    (q/k/v column-parallel, output row-parallel)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        d, H = cfg.d_model, cfg.head_size
        self.cfg = cfg
        qkv_bias = cfg.bias or cfg.qkv_bias
        self.q = _linear(cfg, "q", d, cfg.n_heads * H, ("embed", "heads"), qkv_bias, 0.02, rngs)
        self.k = _linear(cfg, "k", d, cfg.kv_heads * H, ("embed", "heads"), qkv_bias, 0.02, rngs)
        self.v = _linear(cfg, "v", d, cfg.kv_heads * H, ("embed", "heads"), qkv_bias, 0.02, rngs)
        self.o = _linear(cfg, "o", cfg.n_heads * H, d, ("heads", "embed"), cfg.bias, _residual_std(cfg), rngs)
        self.q_norm = Norm(H, "rmsnorm", False, cfg.norm_eps, (None,)) if cfg.qk_norm else None
        self.k_norm = Norm(H, "rmsnorm", False, cfg.norm_eps, (None,)) if cfg.qk_norm else None
        # The first layer's share in this layer's values (`value_residual`): half at initialisation.
        self.v_mix = nnx.Param(jnp.full((1,), 0.5, jnp.float32), axes=(None,)) if cfg.value_residual else None
        # Own values' and the value embedding's weights (`value_embeddings`): a half each at initialisation.
        self.ve_mix = (
            nnx.Param(jnp.full((2,), 0.5, jnp.float32), axes=(None,)) if cfg.value_embeddings else None
        )

    def _qkv(
        self, x_BTD: jax.Array, positions_BT: jax.Array, keys: list | None = None
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg = self.cfg
        B, T, _ = x_BTD.shape
        kq, kk, kv = keys or (None, None, None)
        q_BTNH = self.q(x_BTD, kq).reshape(B, T, cfg.n_heads, cfg.head_size)
        k_BTKH = self.k(x_BTD, kk).reshape(B, T, cfg.kv_heads, cfg.head_size)
        v_BTKH = self.v(x_BTD, kv).reshape(B, T, cfg.kv_heads, cfg.head_size)
        if self.q_norm is not None:  # bounds q·k/sqrt(H) by sqrt(H)·|scale|², whatever the activations do
            q_BTNH, k_BTKH = self.q_norm(q_BTNH), self.k_norm(k_BTKH)
        if cfg.position == "rope":
            rot = rotation(positions_BT, cfg)
            q_BTNH, k_BTKH = rope(q_BTNH, rot), rope(k_BTKH, rot)
        return q_BTNH, k_BTKH, v_BTKH

    def _values(self, v_BTKH: jax.Array, v1: Values, ve_BTKH: jax.Array | None) -> tuple[jax.Array, Values]:
        """This layer's values with its value embedding `ve_BTKH` added (`value_embeddings`: a per-token
        vector the layer need not compute from the stream), then `_value_residual`'s mix."""
        if ve_BTKH is not None:
            mix = self.ve_mix[...].astype(v_BTKH.dtype)
            v_BTKH = mix[0] * v_BTKH + mix[1] * ve_BTKH
        return self._value_residual(v_BTKH, v1)

    def _value_residual(self, v_BTKH: jax.Array, v1: Values) -> tuple[jax.Array, Values]:
        """With `value_residual`, this layer's values mixed with the first layer's (ResFormer), which the first
        layer passes on as its own: the deep layers keep the first layer's per-token information at hand."""
        if self.v_mix is None:
            return v_BTKH, v1
        seen, v1_BTKH = v1
        v1_BTKH = jnp.where(seen, v1_BTKH, v_BTKH)
        share = self.v_mix[...].astype(v_BTKH.dtype)
        return (1 - share) * v_BTKH + share * v1_BTKH, (jnp.ones_like(seen), v1_BTKH)

    def __call__(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        visible_B1TT: jax.Array | None,
        lora_key: jax.Array | None = None,
        v1: Values = None,
        ve_BTKH: jax.Array | None = None,
    ) -> tuple[jax.Array, Values]:
        """Training/eval path: causal attention, and with `visible_B1TT` only where it is true as well
        (`attention_mask`). `lora_key` drives the adapters' dropout. Returns the output and `v1` for the next
        layer (`_values`)."""
        B, T, _ = x_BTD.shape
        keys = lora.keys(lora_key, 4)
        q_BTNH, k_BTKH, v_BTKH = self._qkv(x_BTD, positions_BT, keys[:3])
        v_BTKH, v1 = self._values(v_BTKH, v1, ve_BTKH)
        y_BTNH = attend(self.cfg, q_BTNH, k_BTKH, v_BTKH, visible_B1TT)
        return self.o(y_BTNH.reshape(B, T, -1), keys[3]), v1

    def decode(
        self,
        x_BTD: jax.Array,
        positions_BT: jax.Array,
        kv: tuple[jax.Array, jax.Array],
        v1: Values = None,
        ve_BTKH: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[tuple[jax.Array, jax.Array], Values]]:
        """Cached path: write this call's keys/values into the cache `kv` ((B, K, S, H) each, slot = position),
        then attend from each query to the cache slots at positions <= its own (`cached_attention`)."""
        B, T, _ = x_BTD.shape
        q_BTNH, k_BTKH, v_BTKH = self._qkv(x_BTD, positions_BT)
        v_BTKH, v1 = self._values(v_BTKH, v1, ve_BTKH)
        k_BKSH, v_BKSH = kv
        rows_B1 = jnp.arange(B)[:, None]
        k_BKSH = k_BKSH.at[rows_B1, :, positions_BT].set(k_BTKH.astype(k_BKSH.dtype))
        v_BKSH = v_BKSH.at[rows_B1, :, positions_BT].set(v_BTKH.astype(v_BKSH.dtype))
        y_BTNH = cached_attention(q_BTNH, k_BKSH, v_BKSH, positions_BT)
        return self.o(y_BTNH.reshape(B, T, -1)), ((k_BKSH, v_BKSH), v1)


class MLP(nnx.Module):
    """GELU/ReLU/ReLU² (up, act, down) or SwiGLU (silu(gate) * up, down)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        d, f = cfg.d_model, cfg.d_ff
        self.kind = cfg.activation
        swiglu = self.kind == "swiglu"
        self.gate = _linear(cfg, "gate", d, f, ("embed", "mlp"), cfg.bias, 0.02, rngs) if swiglu else None
        self.up = _linear(cfg, "up", d, f, ("embed", "mlp"), cfg.bias, 0.02, rngs)
        self.down = _linear(cfg, "down", f, d, ("mlp", "embed"), cfg.bias, _residual_std(cfg), rngs)

    def __call__(self, x_BTD: jax.Array, lora_key: jax.Array | None = None) -> jax.Array:
        k_up, k_gate, k_down = lora.keys(lora_key, 3)
        h_BTF = self.up(x_BTD, k_up)
        if self.kind == "swiglu":
            h_BTF = jax.nn.silu(self.gate(x_BTD, k_gate)) * h_BTF
        elif self.kind == "relu2":
            h_BTF = jnp.square(jax.nn.relu(h_BTF))
        elif self.kind == "relu":
            h_BTF = jax.nn.relu(h_BTF)
        else:
            h_BTF = jax.nn.gelu(h_BTF)
        return self.down(h_BTF, k_down)


def compute_dtype(cfg: ModelConfig) -> jnp.dtype:
    """The dtype of the products' operands and of the activations between them; the residual stream, the
    norms and the parameters stay float32."""
    return jnp.dtype(jnp.bfloat16 if cfg.dtype == "bfloat16" else jnp.float32)


def decoding_params(params: nnx.State, cfg: ModelConfig) -> nnx.State:
    """`params` with the projections' kernels in the compute dtype, as each product casts them (`Linear`), so
    the results are the same and a decode loop's step reads half the weights' bytes: cast inside the loop, the
    scanned layers convert their float32 kernels every step (XLA cannot hoist a cast out of the layers' loop)."""
    dtype = compute_dtype(cfg)

    def cast(path: tuple[Any, ...], x: jax.Array) -> jax.Array:
        is_kernel = any(getattr(k, "key", None) == "kernel" for k in path)
        return x.astype(dtype) if is_kernel and x.dtype == jnp.float32 else x

    return jax.tree_util.tree_map_with_path(cast, params)


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        self.pre_norm, self.dtype = cfg.norm_position == "pre", compute_dtype(cfg)
        self.rate, self.lora = cfg.dropout, cfg.lora
        self.ln1 = Norm(cfg.d_model, cfg.norm, cfg.bias, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.ln2 = Norm(cfg.d_model, cfg.norm, cfg.bias, cfg.norm_eps)
        self.mlp = MLP(cfg, rngs)

    def _apply(self, x_BTD: jax.Array, attn: Callable[[jax.Array], Any], key: jax.Array | None) -> Any:
        """The residual wiring around `attn(x) -> (y, aux)`; returns (x, aux). The stream is float32 and the
        sublayers read it in the compute dtype: a residual add in bfloat16 would round away most of a small
        update's bits."""
        k1, k2 = jax.random.split(key) if key is not None else (None, None)
        k_mlp = lora.key_for(key, self.lora, 1)
        c = lambda h: h.astype(self.dtype)
        if self.pre_norm:
            y_BTD, aux = attn(c(self.ln1(x_BTD)))
            x_BTD = x_BTD + dropout(y_BTD, self.rate, k1)
            x_BTD = x_BTD + dropout(self.mlp(c(self.ln2(x_BTD)), k_mlp), self.rate, k2)
        else:
            y_BTD, aux = attn(c(x_BTD))
            x_BTD = self.ln1(x_BTD + dropout(y_BTD, self.rate, k1))
            x_BTD = self.ln2(x_BTD + dropout(self.mlp(c(x_BTD), k_mlp), self.rate, k2))
        return activation_sharding_constraint(x_BTD), aux

    def __call__(
        self,
        stream: Stream,
        positions_BT: jax.Array,
        key: jax.Array | None,
        visible_B1TT: jax.Array | None,
        ve_BTKH: jax.Array | None = None,
    ) -> Stream:
        """(x, v1) in, (x, v1) out: the residual stream and the first layer's values (`Attention._values`)."""
        x_BTD, v1 = stream
        k_attn = lora.key_for(key, self.lora, 0)
        return self._apply(
            x_BTD, lambda h: self.attn(h, positions_BT, visible_B1TT, k_attn, v1, ve_BTKH), key
        )

    def decode(
        self,
        stream: Stream,
        positions_BT: jax.Array,
        kv: tuple[jax.Array, jax.Array],
        ve_BTKH: jax.Array | None = None,
    ) -> tuple[Stream, tuple[jax.Array, jax.Array]]:
        x_BTD, v1 = stream
        attn = lambda h: self.attn.decode(h, positions_BT, kv, v1, ve_BTKH)
        x_BTD, (kv, v1) = self._apply(x_BTD, attn, None)
        return (x_BTD, v1), kv


def _stack(modules: list[nnx.Module]) -> nnx.Module:
    """One module whose every parameter has a leading layer axis: the layers' parameters, stacked."""
    graphdef, first = nnx.split(modules[0])
    states = [first] + [nnx.split(m)[1] for m in modules[1:]]
    return nnx.merge(graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states))


def attention_mask(segment_BT: jax.Array, shared_prefix: bool = False) -> jax.Array:
    """(B, 1, T, T): which keys each query may see besides causality: those of its own segment, and with
    `shared_prefix` also segment 0's, a prefix every later segment reads (task evaluation packs one context
    and its candidate continuations into a row: each continuation sees the context, not the others)."""
    visible_BTT = segment_BT[:, :, None] == segment_BT[:, None, :]
    if shared_prefix:
        visible_BTT = visible_BTT | (segment_BT[:, None, :] == 0)
    return visible_BTT[:, None]


def documents(tokens_BT: jax.Array, eot_id: int) -> tuple[jax.Array, jax.Array]:
    """Segment ids and positions (B, T) of the documents in packed windows. An end-of-text token starts a
    new document at position 0 (it is the next document's beginning-of-sequence, as in generation from an
    empty prompt), so a document's last token still predicts its end within its own document. The text
    before a window's first end-of-text (the rest of a document begun in an earlier window) is one more
    segment, at positions from 0."""
    if eot_id < 0:
        raise ValueError("document attention needs model.eot_id (resolved from the tokenizer)")
    is_eot_BT = tokens_BT == eot_id
    segment_BT = jnp.cumsum(is_eot_BT, axis=1, dtype=jnp.int32)
    t_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
    start_BT = jax.lax.cummax(jnp.where(is_eot_BT, t_BT, 0), axis=1)
    return segment_BT, t_BT - start_BT


class GPT(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs) -> None:
        if cfg.vocab_size <= 0:
            raise ValueError(
                "ModelConfig.vocab_size must be set (from the tokenizer) before building the model"
            )
        self.cfg = cfg
        V, D = cfg.padded_vocab, cfg.d_model
        self.wte = _param(rngs, (V, D), ("vocab", "embed"), 0.02)
        self.wpe = (
            _param(rngs, (cfg.max_seq_len, D), (None, "embed"), 0.01) if cfg.position == "learned" else None
        )
        blocks = [Block(cfg, rngs) for _ in range(cfg.n_layers)]
        # Scanned layers are the same parameters (same init) stacked: compile time stays flat with depth.
        self.blocks = _stack(blocks) if cfg.scan_layers else nnx.List(blocks)
        self.ln_f = Norm(D, cfg.norm, cfg.bias, cfg.norm_eps) if cfg.norm_position == "pre" else None
        self.lm_head = None if cfg.tie_embeddings else Linear(D, V, ("embed", "vocab"), cfg.bias, 0.02, rngs)
        # Last, so a model without them initialises as before.
        n, KH = cfg.value_embeddings, cfg.kv_heads * cfg.head_size
        self.wve = _param(rngs, (n, V, KH), (None, "vocab", "heads"), 0.02) if n else None

    @property
    def compute_dtype(self) -> jnp.dtype:
        return compute_dtype(self.cfg)

    def _embed(self, tokens_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
        """The residual stream's start (B, T, D), float32 (`Block._apply`)."""
        x_BTD = gathered(self.wte, keep=0)[tokens_BT]
        if self.wpe is not None:
            x_BTD = x_BTD + gathered(self.wpe, keep=0)[positions_BT]
        return x_BTD

    def _value_embeds(self, tokens_BT: jax.Array) -> jax.Array | None:
        """Each layer's value embeddings of the tokens (L, B, T, K, H): layer i reads table i mod n."""
        if self.wve is None:
            return None
        cfg = self.cfg
        table_L11 = (jnp.arange(cfg.n_layers) % cfg.value_embeddings)[:, None, None]
        ve_LBTX = gathered(self.wve, keep=1)[table_L11, tokens_BT[None]]
        return ve_LBTX.reshape(*ve_LBTX.shape[:3], cfg.kv_heads, cfg.head_size).astype(self.compute_dtype)

    def _values_carry(self, x_BTD: jax.Array) -> Values:
        """`Values` before the first layer: none of its values yet."""
        if not self.cfg.value_residual:
            return None
        B, T, _ = x_BTD.shape
        return jnp.array(False), jnp.zeros((B, T, self.cfg.kv_heads, self.cfg.head_size), self.compute_dtype)

    def _layers(self, layer: Callable[[Block, Stream, Any], tuple[Stream, Any]], x: Stream, xs: Any):
        """Apply `layer(block, x, xs_l) -> (x, ys_l)` through the layers, xs/ys stacked along a leading L axis:
        a `lax.scan` over the stacked parameters, or an unrolled loop. With remat, each layer keeps only what its
        policy saves; the rest is recomputed in the backward pass."""
        cfg = self.cfg

        def pure(state: nnx.State, x: Stream, xs_l: Any) -> tuple[Stream, Any]:
            return layer(nnx.merge(graphdef, state), x, xs_l)

        if cfg.remat != "none":
            pure = jax.checkpoint(pure, policy=REMAT_POLICIES[cfg.remat])
        if cfg.scan_layers:
            graphdef, stacked = nnx.split(self.blocks)
            return jax.lax.scan(lambda x, inp: pure(inp[0], x, inp[1]), x, (stacked, xs))
        ys = []
        for i, block in enumerate(self.blocks):
            graphdef, state = nnx.split(block)
            x, y = pure(state, x, jax.tree.map(lambda a, i=i: a[i], xs))
            ys.append(y)
        return x, jax.tree.map(lambda *a: jnp.stack(a), *ys)

    def hidden(
        self,
        tokens_BT: jax.Array,
        *,
        dropout_key: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        positions_BT: jax.Array | None = None,
        shared_prefix: bool = False,
    ) -> jax.Array:
        """The final hidden states (B, T, D), normalised: what the output layer projects onto the vocabulary.

        `segment_ids` (B, T) ints, optional: attention stays within runs of equal ids (one document of a
        packed sequence cannot see another; with `shared_prefix`, segment 0 is seen by all: `attention_mask`).
        Positions are 0..T-1 unless given. With `document_attention`, the segments are the window's documents
        and positions restart in each (`documents`)."""
        cfg = self.cfg
        B, T = tokens_BT.shape
        if cfg.document_attention and segment_ids is None:
            segment_ids, positions_BT = documents(tokens_BT, cfg.eot_id)
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(T), (B, T))
        visible = None if segment_ids is None else attention_mask(segment_ids, shared_prefix)
        keys = jax.random.split(dropout_key, cfg.n_layers + 1) if dropout_key is not None else None
        x_BTD = self._embed(tokens_BT, positions_BT)
        x_BTD = activation_sharding_constraint(dropout(x_BTD, cfg.dropout, None if keys is None else keys[0]))

        def layer(block: Block, stream: Stream, xs: Any) -> tuple[Stream, None]:
            key, ve_BTKH = xs
            return block(stream, positions_BT, None if keys is None else key, visible, ve_BTKH), None

        layer_keys = jnp.zeros((cfg.n_layers, 2), jnp.uint32) if keys is None else keys[1:]
        stream = (x_BTD, self._values_carry(x_BTD))
        (x_BTD, _), _ = self._layers(layer, stream, (layer_keys, self._value_embeds(tokens_BT)))
        return self._final_norm(x_BTD)

    def __call__(
        self,
        tokens_BT: jax.Array,
        *,
        dropout_key: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
    ) -> jax.Array:
        """Logits (B, T, padded vocab) in float32; padded vocabulary entries are -inf-like so they never win."""
        return self._logits(self.hidden(tokens_BT, dropout_key=dropout_key, segment_ids=segment_ids))

    def token_nll(
        self, tokens_BT: jax.Array, targets_BT: jax.Array, **segments: jax.Array | None
    ) -> jax.Array:
        """Per-position NLL (B, T) of `targets_BT`, with the output layer chunked as the config says.
        `segments`: `segment_ids` and `positions_BT` of packed examples, as `hidden` takes them."""
        h_BTD = self.hidden(tokens_BT, **segments)
        if not self.cfg.loss_chunk:
            return loss.nll(self._logits(h_BTD), targets_BT)
        return loss.token_nll(
            h_BTD, *self.output_layer(), targets_BT, self.cfg.vocab_size, self.cfg.loss_chunk
        )

    def token_scores(
        self,
        tokens_BT: jax.Array,
        segment_BT: jax.Array,
        positions_BT: jax.Array,
        at_BC: jax.Array,
        targets_BC: jax.Array,
    ) -> tuple[jax.Array, jax.Array]:
        """Log-probability (B, C) of `targets_BC` predicted at positions `at_BC` of each row, and whether each is
        the greedy choice (B, C), chunked like the loss: what task evaluation reads (`loss.token_scores`). Rows
        are packed as a shared context (segment 0) and continuations (segments 1, 2, ...) that each see the
        context but not one another, at the `positions_BT` they would have alone. Only those C positions reach
        the output layer (a task's context is most of a row)."""
        h_BTD = self.hidden(tokens_BT, segment_ids=segment_BT, positions_BT=positions_BT, shared_prefix=True)
        h_BCD = jnp.take_along_axis(h_BTD, at_BC[..., None], axis=1)
        return loss.token_scores(
            h_BCD, *self.output_layer(), targets_BC, self.cfg.vocab_size, self.cfg.loss_chunk
        )

    def loss(
        self,
        tokens_BT: jax.Array,
        targets_BT: jax.Array,
        weights_BT: jax.Array,
        dropout_key: jax.Array | None,
        **segments: jax.Array | None,
    ) -> jax.Array:
        """sum(weights x NLL), the training objective. Chunked (`loss_chunk` > 0), the B x T x V logits exist
        neither in the forward nor the backward pass (`loss.nll_sum`). `segments` as for `token_nll`."""
        h_BTD = self.hidden(tokens_BT, dropout_key=dropout_key, **segments)
        with jax.named_scope("loss"):  # a profile's category (tools/breakdown.py)
            if not self.cfg.loss_chunk:
                return jnp.sum(weights_BT * loss.nll(self._logits(h_BTD), targets_BT))
            w_DV, b_V = self.output_layer()
            return loss.nll_sum(
                h_BTD, w_DV, b_V, targets_BT, weights_BT, self.cfg.vocab_size, self.cfg.loss_chunk
            )

    def output_layer(self) -> tuple[jax.Array, jax.Array | None]:
        """The output projection as (weights (D, V), bias (V,) or None): the token embedding's transpose when
        tied."""
        if self.lm_head is None:
            return gathered(self.wte, keep=0).T, None
        bias = None if self.lm_head.bias is None else self.lm_head.bias[...]
        return gathered(self.lm_head.kernel, keep=1), bias

    def _final_norm(self, x_BTD: jax.Array) -> jax.Array:
        """The stream normalised (pre-norm) and in the compute dtype: what the output layer reads."""
        return (x_BTD if self.ln_f is None else self.ln_f(x_BTD)).astype(self.compute_dtype)

    def _logits(self, h_BTD: jax.Array) -> jax.Array:
        return loss.logits(h_BTD, *self.output_layer(), self.cfg.vocab_size)

    def init_cache(self, batch_size: int) -> KVCache:
        """An empty key/value cache for `decode`: max_seq_len slots per row and layer."""
        cfg = self.cfg
        shape = (cfg.n_layers, batch_size, cfg.kv_heads, cfg.max_seq_len, cfg.head_size)
        return jnp.zeros(shape, self.compute_dtype), jnp.zeros(shape, self.compute_dtype)

    def decode(
        self,
        tokens_BT: jax.Array,
        positions_BT: jax.Array,
        cache: KVCache,
        *,
        out_index_B: jax.Array | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Incremental forward pass with a key/value cache (no dropout): a prompt prefill (T tokens per row) or
        one decode step (T = 1). Token t of row b sits at `positions_BT[b, t]` (< max_seq_len, the position
        table's size; the caller keeps it there) and attends to cached positions <= its own, so rows may be at
        different positions. Slots past a row's current position may hold stale values: they are masked.

        Returns float32 logits (B, T, padded vocab), or (B, 1, padded vocab) for just the position
        `out_index_B[b]` (an index into T) of each row, and the updated cache."""
        x_BTD = activation_sharding_constraint(self._embed(tokens_BT, positions_BT))
        stream = (x_BTD, self._values_carry(x_BTD))
        (x_BTD, _), cache = self._layers(
            lambda block, s, xs: block.decode(s, positions_BT, *xs),
            stream,
            (cache, self._value_embeds(tokens_BT)),
        )
        if out_index_B is not None:
            x_BTD = jnp.take_along_axis(x_BTD, out_index_B[:, None, None], axis=1)
        return self._logits(self._final_norm(x_BTD)), cache


def is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def param_axes(state: nnx.State) -> nnx.State:
    """The logical axis names of every parameter, as a State of tuples mirroring `state` (a leading None
    for the layer axis of scanned layers)."""
    return jax.tree.map(logical_axes, state, is_leaf=is_variable)


def abstract_model(cfg: ModelConfig, seed: int = 0) -> tuple[nnx.GraphDef, nnx.State]:
    """Graph definition and parameter shapes, without allocating any parameter memory."""
    return nnx.split(nnx.eval_shape(lambda: GPT(cfg, nnx.Rngs(seed))))


def count_params(state: nnx.State) -> int:
    return sum(x.size for x in jax.tree.leaves(state))
