"""Will it fit? Per-device memory of a training step, planned from shapes alone, before anything is allocated.

`make_plan(cfg, kind, devices)` estimates, per device, for a TrainConfig on `devices` devices of a `kind`
(`devices.DEVICE_KINDS`): the train state exactly (parameters and optimizer state from `jax.eval_shape` of the real
`TrainState`, sharded by the real rules over an `AbstractMesh`, so 8 x H100 can be planned on a laptop);
the gradients (float32, sharded like the parameters); the activations autodiff keeps for the backward pass,
read off the program itself (the residuals of the loss's VJP at the per-device micro-batch, which respects
the remat policy and `lax.scan`); and the transient working sets, calibrated against XLA's own buffer
assignment (`benchmarks/plan_check.py`): the output layer's logits, one layer's backward pass, the
optimizer update. Transients do not overlap in time (the loss runs before any layer's backward, the
update after the last), so the total is the resident terms plus the largest transient.

`resolve_grad_accum` turns `--grad-accum auto` into the smallest number of micro-batches whose micro-batch
fits, keeping the sequences per update; `quick_bound` and `refuse_what_cannot_fit` are `train`'s check.
Shapes: B micro-batch rows per device, T sequence, C loss chunk, D width, F feed-forward, V padded vocab.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.extend.core import Literal
from jax.sharding import AbstractMesh

from minigpt.config import ConfigError, ModelConfig, TrainConfig
from minigpt.nn import loss, splash
from minigpt.nn.model import abstract_model
from minigpt.optim.optimizer import create_optimizer
from minigpt.parallel import sharding
from minigpt.training import hardware
from minigpt.training.devices import capacity, device_kind, fmt_bytes, local_kind
from minigpt.training.trainer import TrainState, check_layout, mean_nll

HEADROOM = 0.10
"""The share of a device's memory a plan leaves free: allocator fragmentation, XLA's own scratch, the
runtime, and the estimate's error (within 15% of XLA's figure in `benchmarks/plan_check.py`)."""


def usable(capacity_bytes: int | float) -> int:
    """What a plan may fill of a device's memory: all of it less the headroom."""
    return int(capacity_bytes * (1 - HEADROOM))


GPT2_VOCAB = 50257
LAYER_COTANGENTS = 0.75
"""The share of a scanned layer's intermediates whose cotangents are live at once in its backward pass."""


# ------------------------------------------------------------------------------------------- the state


def planning_config(cfg: TrainConfig) -> TrainConfig:
    """The config with a concrete vocabulary before any tokenizer exists: the model's own, else the tokenizer's
    size (a trained BPE's `data.bpe_vocab_size`, an upper bound; GPT-2's 50257); and an end-of-text id (which
    token it is costs no memory) for document attention."""
    vocab = cfg.model.vocab_size or (cfg.data.bpe_vocab_size if cfg.data.tokenizer == "bpe" else GPT2_VOCAB)
    eot_id = cfg.model.eot_id if cfg.model.eot_id >= 0 else 0
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab, eot_id=eot_id))


def abstract_mesh(cfg: TrainConfig, devices: int) -> AbstractMesh:
    """The run's mesh without devices, refused as `trainer.make_run_mesh` refuses the real one."""
    d, f, t = sharding.mesh_shape(cfg.mesh, devices)
    check_layout(cfg, d * f, t)
    return AbstractMesh((d, f, t), sharding.MESH_AXES)


def _per_device_bytes(shapes: Any, shardings: Any, dtype: Any = None) -> int:
    """Bytes of one device's shards of a tree of ShapeDtypeStructs (in `dtype`, if given)."""
    is_sharding = lambda x: isinstance(x, jax.sharding.Sharding)
    leaves, specs = jax.tree.leaves(shapes), jax.tree.leaves(shardings, is_leaf=is_sharding)
    return sum(
        math.prod(sh.shard_shape(s.shape)) * jnp.dtype(dtype or s.dtype).itemsize
        for s, sh in zip(leaves, specs, strict=True)
    )


def state_bytes(cfg: TrainConfig, mesh: AbstractMesh) -> dict[str, int]:
    """Exact per-device bytes of the parameters, the optimizer state (with the step, rng and weight average)
    and the float32 gradients: `TrainState.create`'s shapes under `sharding.fsdp_sharding`, as
    `trainer.build` makes them, on a mesh without devices."""
    _, params = abstract_model(cfg.model, cfg.seed)
    tx = create_optimizer(cfg.optimizer, cfg.schedule, run_steps=cfg.steps)
    shapes = jax.eval_shape(functools.partial(TrainState.create, tx=tx, cfg=cfg), params)
    shardings = sharding.fsdp_sharding(shapes, mesh, min_size_mbytes=cfg.mesh.fsdp_min_mbytes)
    p = _per_device_bytes(shapes.params, shardings.params)
    names = ("opt_state", "step", "rng", "average")
    rest = tuple(getattr(shapes, n) for n in names), tuple(getattr(shardings, n) for n in names)
    return {
        "parameters": p,
        "optimizer state": _per_device_bytes(*rest),
        "gradients": _per_device_bytes(shapes.params, shardings.params, jnp.float32),
    }


# ------------------------------------------------------------------------------------- the activations


@functools.lru_cache(maxsize=128)
def residuals(model: ModelConfig, batch: int, seq_len: int) -> tuple[tuple[tuple[int, ...], str], ...]:
    """(shape, dtype) of every value autodiff keeps from the training loss's forward pass for its backward
    pass, for `batch` windows of `seq_len` tokens on one device: the VJP's residuals (as
    `jax.ad_checkpoint.print_saved_residuals` lists them), less the parameters themselves and broadcasts
    (XLA fuses a broadcast into its users rather than storing it; a scan's stacked residuals are stored)."""
    graphdef, params = abstract_model(model)
    tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    leaves, tree = jax.tree.flatten((params, tokens, key))

    def vjp(*flat: Any) -> Any:
        p, t, k = jax.tree.unflatten(tree, flat)
        return jax.vjp(lambda p: mean_nll(graphdef, p, t, k), p)

    closed, (_, vjp_fn) = jax.make_jaxpr(vjp, return_shape=True)(*leaves)
    jaxpr = closed.jaxpr
    producer = {v: eqn.primitive.name for eqn in jaxpr.eqns for v in eqn.outvars}
    inputs, seen, out = set(jaxpr.invars), set(), []
    for v in jaxpr.outvars[len(jaxpr.outvars) - len(jax.tree.leaves(vjp_fn)) :]:
        if isinstance(v, Literal) or v in inputs or v in seen or producer.get(v) == "broadcast_in_dim":
            continue
        seen.add(v)
        out.append((tuple(v.aval.shape), str(v.aval.dtype)))
    return tuple(out)


def _tensor_split(shape: tuple[int, ...], m: ModelConfig, seq_len: int) -> bool:
    """Whether a residual carries a dimension split over the tensor axis: the vocabulary, the feed-forward
    width, or heads ((.., N, H) projections, (.., N, 1) per-head statistics, (.., T, T) attention). A shape
    test, so an unsplit (B, T, D) counts as split when D equals d_ff or T equals the head size."""
    heads = (m.n_heads, m.kv_heads)
    return (
        m.padded_vocab in shape
        or (m.d_ff != m.d_model and shape[-1:] == (m.d_ff,))
        or (len(shape) >= 2 and shape[-1] in (m.head_size, 1) and shape[-2] in heads)
        or (len(shape) >= 3 and shape[-1] == m.head_size and shape[-3] in heads)
        or (len(shape) >= 2 and shape[-2:] == (seq_len, seq_len))
    )


def _bytes(
    entries: Sequence[tuple[tuple[int, ...], str]], m: ModelConfig, seq_len: int, tensor: int
) -> list[int]:
    """Per-device bytes of each residual: those with a tensor-split dimension divided by the tensor size."""
    return [
        math.prod(s) * jnp.dtype(d).itemsize // (tensor if _tensor_split(s, m, seq_len) else 1)
        for s, d in entries
    ]


def _platform(kind: str) -> str:
    return "cpu" if kind == "cpu" else "accelerator"


def device_model(cfg: TrainConfig, kind: str) -> ModelConfig:
    """The model as XLA on `kind` runs it: its compute dtype resolved (`--model.dtype auto`), and on cpu
    without remat in unrolled layers, since XLA:CPU removes jax.checkpoint's optimization barriers before
    scheduling (scanned layers recompute inside the backward loop and honour it)."""
    m = dataclasses.replace(cfg.model, dtype=hardware.compute_dtype(cfg.model.dtype, _platform(kind))[0])
    if kind == "cpu":
        m = dataclasses.replace(m, remat=m.remat if m.scan_layers else "none")
    return m


def _is_output_layer(shape: tuple[int, ...], m: ModelConfig) -> bool:
    """Logits-shaped residuals (.., V) (counted in the logits term), and the output layer's weights in the
    loss's layout or their gradients ((D, V) or (V, D), and (V,)), which the chunked loss computes in the
    forward pass (counted in the gradients; a transposed or cast copy of the weights in the logits term)."""
    V, D = m.padded_vocab, m.d_model
    return (len(shape) >= 3 and shape[-1] == V) or shape in ((V, D), (D, V), (V,))


def activation_terms(cfg: TrainConfig, kind: str, micro: int, tensor: int) -> dict[str, int]:
    """Per-device activations kept for the backward pass (the residuals at the micro-batch, and the token
    batch), and the working set of one layer's backward pass on top of them.

    One layer's intermediates are the residuals a second layer adds without remat; what a layer recomputes
    is those less the ones its policy saves. While a layer's backward runs, it holds what it recomputes and
    its largest cotangent, or, in a scan, whose stacked residuals stay allocated until the loop ends, the
    cotangents of its intermediates, measured at about LAYER_COTANGENTS of them (they are made and consumed
    one op at a time), whichever is larger. Unrolled layers without remat free each layer's residuals as its
    cotangents appear: only the largest intermediate is extra. Measured: XLA's scans within -25..+13 MiB of
    this for a 124 MiB layer (none, dots, projections, full)."""
    m, T = device_model(cfg, kind), cfg.data.seq_len
    flash = flash_attention(m, kind, T)

    def saved(model: ModelConfig) -> list[int]:
        entries = residuals(model, micro, T)
        keep = [
            e
            for e in entries
            if not _is_output_layer(e[0], m) and not (flash and len(e[0]) >= 4 and e[0][-2:] == (T, T))
        ]
        return _bytes(keep, m, T, tensor)

    def per_layer(remat: str) -> tuple[int, int]:
        """(bytes one layer saves under `remat`, its largest saved value)."""
        layer = dataclasses.replace(m, remat=remat, scan_layers=True)
        one, two = (
            saved(dataclasses.replace(layer, n_layers=1)),
            saved(dataclasses.replace(layer, n_layers=2)),
        )
        return sum(two) - sum(one), max(one)

    (everything, largest), (kept, _) = per_layer("none"), per_layer(m.remat)
    recomputed = everything - kept + largest if m.remat != "none" else largest
    layer = max(recomputed, int(LAYER_COTANGENTS * everything)) if m.scan_layers else recomputed
    # A fused kernel keeps the attention's softmax statistics, (B, N, T) float32 per layer, not its (T, T) scores.
    stats = m.n_layers * micro * m.n_heads * T * 4 // tensor if flash else 0
    return {
        "activations": sum(saved(m)) + stats + cfg.grad_accum * micro * (T + 1) * 4,
        "layer backward": layer,
    }


def flash_attention(m: ModelConfig, kind: str, seq_len: int) -> bool:
    """Whether attention runs as a fused kernel there, cuDNN's on a GPU or splash on a TPU, which keep softmax
    statistics instead of XLA's (T, T) scores and probabilities (and cannot be traced off their device, so
    their residuals are planned)."""
    k = device_kind(kind)
    if k.is_tpu:
        chosen = m.attention == "splash" or (m.attention == "auto" and seq_len >= splash.LONG)
        return chosen and splash.supported(seq_len) and not m.document_attention
    return k.is_gpu and (m.attention == "cudnn" or (m.attention == "auto" and m.dtype != "float32"))


def logits_bytes(cfg: TrainConfig, kind: str, micro: int, tensor: int) -> int:
    """The output layer's working set, split over the tensor axis. Chunked: a (B, C, V) block of float32
    logits and one of their exponentials in the compute dtype, C the loss chunk as `loss._chunked` evens it
    out, and the gradients a first pass keeps. Unchunked: what autodiff keeps of the (B, T, V)
    logits (read off the residuals), one float32 copy for their gradient, and with an output bias one for the
    logits before it is added (XLA kept 2.3 and 3 copies without a bias where this counts 2 and 3.25, 4 with
    one where this counts 4.25). Either way the output weights in the loss's layout where that is a copy made
    each step (a transposed tied embedding, a bfloat16 cast)."""
    m, T = device_model(cfg, kind), cfg.data.seq_len
    V, D, itemsize = m.padded_vocab, m.d_model, jnp.dtype(m.dtype).itemsize
    copy = V * D * itemsize if m.dtype != "float32" or _output_weights_copied(m) else 0
    if m.loss_chunk:
        chunk = loss.chunk_positions(m.loss_chunk, cfg.batch_size, T, V, _platform(kind))
        C = -(-T // -(-T // chunk))
        # The first pass's gradients stay live while a pass shifted by the maxima could run (loss._nll_sum_fwd).
        kept = D * V * 4 + micro * T * (D * itemsize + (D + 1) * 4)
        return (micro * C * V * (4 + itemsize) + kept + copy) // tensor
    saved = [e for e in residuals(m, micro, T) if len(e[0]) >= 3 and e[0][-1] == V]
    working = 2 if m.bias and not m.tie_embeddings else 1  # the gradient; and the logits before the bias
    return (sum(_bytes(saved, m, T, 1)) + working * micro * T * V * 4 + copy) // tensor


@functools.lru_cache(maxsize=32)
def _output_weights_copied(m: ModelConfig) -> bool:
    """Whether `GPT.output_layer` computes its weights (a tied embedding's transpose) rather than returning
    a parameter as it is."""
    graphdef, params = abstract_model(m)
    leaves, tree = jax.tree.flatten(params)
    closed = jax.make_jaxpr(lambda *f: nnx.merge(graphdef, jax.tree.unflatten(tree, f)).output_layer()[0])(
        *leaves
    )
    return closed.jaxpr.outvars[0] not in set(closed.jaxpr.invars)


# ------------------------------------------------------------------------------------------- the plan

RESIDENT = ("parameters", "optimizer state", "gradients", "activations")
TRANSIENT = ("logits", "layer backward", "optimizer update")
TERMS = {
    "parameters": "float32, one device's shards",
    "optimizer state": "the optimizer's moments (and step, rng, weight average), sharded like the parameters",
    "gradients": "float32, sharded like the parameters (x2 with grad_accum > 1: the running sum)",
    "activations": "what autodiff keeps from the forward pass for the backward pass, and the batch",
    "logits": "output layer: float32 logits, softmax and gradient per loss chunk (transient)",
    "layer backward": "one layer's backward: cotangents or recomputed intermediates (transient)",
    "optimizer update": "the update before it is applied: one float32 copy of the parameters (transient)",
}


@dataclasses.dataclass(frozen=True)
class Plan:
    """Per-device bytes of one training step's terms (TERMS), on `devices` devices of `kind`."""

    cfg: TrainConfig
    kind: str
    devices: int
    mesh: tuple[int, int, int]
    micro_batch: int
    """Sequences per device in each micro-batch."""
    terms: dict[str, int]
    capacity: int
    capacity_note: str

    @property
    def total(self) -> int:
        """Resident terms plus the largest transient: transients are live at different times."""
        return sum(self.terms[k] for k in RESIDENT) + max(self.terms[k] for k in TRANSIENT)

    @property
    def usable(self) -> int:
        return usable(self.capacity)

    @property
    def fits(self) -> bool:
        return self.total <= self.usable

    @property
    def largest(self) -> str:
        return max(self.terms, key=self.terms.__getitem__)


def make_plan(cfg: TrainConfig, kind: str | None = None, devices: int | None = None) -> Plan:
    """The plan for `cfg` (grad_accum an int) on `devices` devices of `kind` (default: this process's).

    Gradients: with grad_accum > 1 the accumulation scan carries their running sum beside each micro-batch's
    (XLA: +1x). Optimizer update: optax's updates before they are applied, one float32 copy of the
    parameters (XLA: AdamW and Lion 1x; SGD 0, fused into the in-place update; Muon 1.5x)."""
    if cfg.grad_accum == "auto":
        raise ValueError("resolve grad_accum 'auto' first (resolve_grad_accum)")
    cfg = planning_config(cfg)
    kind = kind or local_kind()
    devices = devices or jax.device_count()
    mesh = abstract_mesh(cfg, devices)
    d, f, t = (mesh.shape[a] for a in sharding.MESH_AXES)
    micro = cfg.batch_size // (d * f)
    terms = state_bytes(cfg, mesh)
    update = terms["gradients"]
    terms["gradients"] *= 2 if cfg.grad_accum > 1 else 1
    terms |= activation_terms(cfg, kind, micro, t)
    terms["logits"] = logits_bytes(cfg, kind, micro, t)
    terms["optimizer update"] = update
    terms = {k: terms[k] for k in TERMS}
    return Plan(cfg, kind, devices, (d, f, t), micro, terms, *capacity(kind, devices))


# ------------------------------------------------------------------------------ making it fit


def _split(cfg: TrainConfig, k: int) -> TrainConfig:
    """`cfg` with its batch in k times more, k times smaller micro-batches: the same sequences per update."""
    base = 1 if cfg.grad_accum == "auto" else cfg.grad_accum
    return dataclasses.replace(cfg, batch_size=cfg.batch_size // k, grad_accum=base * k)


def smallest_split(cfg: TrainConfig, kind: str, devices: int) -> tuple[int, Plan] | None:
    """The smallest k (k divides batch_size, and the data-parallel size divides batch_size / k) whose
    micro-batch fits, with its plan; None if even one sequence per device does not. Memory shrinks as k
    grows (past k = 2, where the gradients' running sum appears), so k > 1 is found by bisection."""
    dp = math.prod(sharding.mesh_shape(cfg.mesh, devices)[:2])
    ks = [
        k for k in range(1, cfg.batch_size + 1) if cfg.batch_size % k == 0 and cfg.batch_size // k % dp == 0
    ]
    if not ks:
        abstract_mesh(cfg, devices)  # raises: the batch does not split over the data-parallel devices
    plans: dict[int, Plan] = {}

    def fits(i: int) -> bool:
        plans[i] = plans.get(i) or make_plan(_split(cfg, ks[i]), kind, devices)
        return plans[i].fits

    if fits(0):
        return ks[0], plans[0]
    if len(ks) == 1 or not fits(len(ks) - 1):
        return None
    lo, hi = 1, len(ks) - 1  # ks[hi] fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return ks[hi], plans[hi]


def _fixes(plan: Plan) -> list[str]:
    """Flag changes that each make `plan` fit (checked by planning them), the likeliest first."""
    cfg, kind, n = plan.cfg, plan.kind, plan.devices
    out: list[tuple[int, str]] = []
    if not cfg.model.loss_chunk:
        chunked = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, loss_chunk=-1))
        if make_plan(chunked, kind, n).fits:
            out.append((0 if plan.largest == "logits" else 2, "--model.loss-chunk -1"))
    split = smallest_split(cfg, kind, n)
    if split is not None and split[0] > 1:
        p = split[1]
        flags = f"--batch-size {p.cfg.batch_size} --grad-accum {p.cfg.grad_accum}"
        flags = "--grad-accum auto" if cfg.grad_accum == 1 else flags
        out.append((1, f"{flags} (micro-batch {p.cfg.batch_size} x {p.cfg.grad_accum})"))
    if cfg.model.remat != "full":
        scan = kind == "cpu" and not cfg.model.scan_layers  # XLA:CPU honours remat in scanned layers only
        remat = dataclasses.replace(cfg.model, remat="full", scan_layers=cfg.model.scan_layers or scan)
        if make_plan(dataclasses.replace(cfg, model=remat), kind, n).fits:
            out.append((1, "--model.remat full" + (" --model.scan-layers" if scan else "")))
    d, f, _ = plan.mesh
    if d > 1:
        fsdp = dataclasses.replace(
            cfg, mesh=dataclasses.replace(cfg.mesh, data=1, fsdp=d * f, fsdp_min_mbytes=0)
        )
        if make_plan(fsdp, kind, n).fits:
            resident = plan.largest in ("parameters", "optimizer state", "gradients", "optimizer update")
            out.append((0 if resident else 3, f"--mesh.data 1 --mesh.fsdp {d * f} --mesh.fsdp-min-mbytes 0"))
    return [text for _, text in sorted(out, key=lambda x: x[0])]


def does_not_fit(plan: Plan) -> str:
    """One line: what the plan needs, its largest term, and the flags that would make it fit."""
    name = plan.largest
    fixes = _fixes(plan)
    advice = (
        "set " + ", or ".join(fixes)
        if fixes
        else "no single change of loss chunk, micro-batch, remat or FSDP fits: use more devices or a smaller model"
    )
    return (
        f"does not fit: needs {fmt_bytes(plan.total)} per device of {fmt_bytes(plan.capacity)} ({plan.kind}, keeping "
        f"{HEADROOM:.0%} free); the largest term is {name} ({fmt_bytes(plan.terms[name])}): {advice}"
    )


def resolve_grad_accum(
    cfg: TrainConfig,
    devices: Sequence[Any] | None = None,
    log: Callable[[str], None] | None = None,
    *,
    kind: str | None = None,
    count: int | None = None,
) -> TrainConfig:
    """`--grad-accum auto`: the global batch is `batch_size` sequences; split it into the fewest micro-batches
    that fit by the plan, so batch_size becomes the micro-batch and grad_accum their number (tokens per update
    unchanged). For `devices` (default: all of them), or `count` devices of a `kind`. Other configs are
    returned as they are. A ConfigError if one sequence per data-parallel device does not fit either."""
    if cfg.grad_accum != "auto":
        return cfg
    devices = list(devices if devices is not None else jax.devices())
    kind, count = kind or local_kind(devices[0]), count or len(devices)
    split = smallest_split(cfg, kind, count)
    if split is None:
        dp = math.prod(sharding.mesh_shape(cfg.mesh, count)[:2])
        smallest = make_plan(_split(cfg, cfg.batch_size // dp), kind, count)
        raise ConfigError(f"grad_accum auto: one sequence per device {does_not_fit(smallest)}")
    k, plan = split
    if log is not None:
        log(
            f"grad_accum auto: micro-batch {cfg.batch_size // k} x {k} = {cfg.batch_size} sequences per update "
            f"(plan: {fmt_bytes(plan.total)} of {fmt_bytes(plan.capacity)} per device)"
        )
    return _split(cfg, k)


QUICK_FLOATS = 16
"""float32 values per token and per width (model, feed-forward, query, key and value heads, an attention
row) that bound what a layer keeps for its backward pass or works on: the presets and the architectures
minigpt exchanges with transformers keep 6.1 at most (tests/test_plan.py)."""


def quick_bound(cfg: TrainConfig, kind: str, devices: int) -> int:
    """An upper bound on `make_plan(cfg, kind, devices).total` from the weights' count and arithmetic, where the
    plan traces the model (a second or more): every weight unsharded, eight float32 copies (the parameters,
    two moments, the average, two gradients, the update, and the casts and transposes autodiff keeps);
    QUICK_FLOATS per token and width for every layer, two more for the layer backward, and the embeddings;
    eight float32 copies of the logits (of a loss chunk's positions); the token batch."""
    cfg = planning_config(cfg)
    d, f, _ = sharding.mesh_shape(cfg.mesh, devices)
    m, T = cfg.model, cfg.data.seq_len
    tokens = cfg.batch_size // (d * f) * T
    widths = m.d_model + m.d_ff + (m.n_heads + 2 * m.kv_heads) * m.head_size + m.n_heads * T
    per_token = QUICK_FLOATS * ((m.n_layers + 2) * widths + m.d_model) + 2 * cfg.grad_accum
    chunk = loss.chunk_positions(m.loss_chunk or T, cfg.batch_size, T, m.padded_vocab, _platform(kind))
    logits = tokens // T * chunk * 8 * m.padded_vocab
    weights = sum(x.size for x in jax.tree.leaves(abstract_model(m, cfg.seed)[1]))
    return 4 * (8 * weights + tokens * per_token + logits)


def refuse_what_cannot_fit(cfg: TrainConfig, devices: Sequence[Any] | None = None) -> None:
    """Before anything is tokenized, compiled or allocated: a step whose plan needs more than the whole of a
    device's memory (the host's RAM share on a CPU) is refused in one line with the flags that fit, where XLA
    would fail minutes later with an allocation error. A device kind with no plan is not checked; a step whose
    quick bound is within half the usable memory is not planned."""
    plan = _plan_if_near(cfg, devices)
    if plan is not None and plan.total > plan.capacity:
        raise ConfigError(f"the train step {does_not_fit(plan)}")


def _plan_if_near(cfg: TrainConfig, devices: Sequence[Any] | None) -> Plan | None:
    """The plan of a step whose quick bound is past half the usable memory; None for one well within it, or
    a device kind with no plan."""
    devices = list(devices if devices is not None else jax.devices())
    try:
        kind = local_kind(devices[0])
        if quick_bound(cfg, kind, len(devices)) <= usable(capacity(kind, len(devices))[0]) / 2:
            return None
        return make_plan(cfg, kind, len(devices))
    except ConfigError:
        return None


SHORTEST_FITTED = 128
"""`fitted_seq_len` halves a window down to this at most."""


def fitted_seq_len(cfg: TrainConfig, context: int, devices: Sequence[Any] | None = None) -> int:
    """The longest window, `context` or that halved (to SHORTEST_FITTED at most), whose train step fits the
    memory plan with the run's batch; `context` where nothing is planned (`--grad-accum auto` splits the
    batch to fit instead, a device kind with no plan)."""
    seq = context
    if cfg.grad_accum == "auto":
        return seq
    while seq // 2 >= SHORTEST_FITTED:
        plan = _plan_if_near(
            dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=seq)), devices
        )
        if plan is None or plan.fits:
            return seq
        seq //= 2
    return seq
