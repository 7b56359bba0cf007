"""Learning-rate schedules and optimizers as frozen dataclass configs.

Every config validates itself on construction, so a bad CLI value fails before any
compilation, and exposes `create()`, which builds the optax object. A bad value raises
`ConfigError`, which the CLI prints as one line. This module imports nothing from minigpt
but the leaf `minigpt.runtime.errors`, so `minigpt.config` can import the dataclasses and tyro can
build `--optimizer` / `--schedule` subcommands from the `Optimizer` and `Schedule` unions. JAX and optax are
imported by the functions that use them: the command line checks its flags before JAX starts.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from minigpt.runtime.errors import ConfigError

if TYPE_CHECKING:
    import jax
    import optax

# A pytree of bools shaped like the params, or a callable params -> such a pytree.
WeightDecayMask = Any

_HEAD_NAME = "lm_head"
_EMBEDDING_OR_HEAD_NAMES = ("wte", "wpe", "wve", _HEAD_NAME)
# Norm scales and biases are vectors per layer, but 2-D once layers are stacked for scan.
_VECTOR_PARAM_NAMES = ("scale", "bias")


def _check_positive(owner: str, name: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{owner}.{name} must be > 0, got {value}")


def _check_non_negative(owner: str, name: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{owner}.{name} must be >= 0, got {value}")


def _check_beta(owner: str, name: str, value: float) -> None:
    if not 0 <= value < 1:
        raise ConfigError(f"{owner}.{name} must be in [0, 1), got {value}")


def _check_clip(owner: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(
            f"{owner}.clip_gradient_norm must be > 0, got {value}; use float('inf') to disable clipping"
        )


def _linear_warmup(warmup_steps: int, peak_lr: float) -> optax.Schedule:
    """Linear ramp from peak_lr / (warmup_steps + 1) so the very first step is not at lr 0."""
    import optax

    return optax.linear_schedule(
        init_value=peak_lr / (warmup_steps + 1), end_value=peak_lr, transition_steps=warmup_steps
    )


RunSteps = Any  # int | jax.Array
"""The run's length in optimizer steps, for schedules whose own length is 0 ("follow the run"). It may be a
traced scalar: a run under --max-time fixes its length only once the step time is measured, and passes it
to the compiled step as an argument, so no recompilation is needed and the schedule before that point is
the same whatever the length turns out to be (warmup, and WSD's stable phase)."""


def _length(owner: str, field: str, own: int, run_steps: RunSteps) -> RunSteps:
    """A schedule's own length, or the run's when its own is 0."""
    if own:
        return own
    if isinstance(run_steps, int) and run_steps <= 0:
        raise ConfigError(f"{owner}.{field} is 0 (follow the run's length) but no run length was given")
    return run_steps


@runtime_checkable
class LRScheduleConfig(Protocol):
    def ends_at(self, run_steps: int) -> int | None: ...

    def create(self, run_steps: RunSteps = 0) -> optax.Schedule: ...


@dataclasses.dataclass(frozen=True)
class CosineDecaySchedule(LRScheduleConfig):
    """Linear warmup to peak_lr, then cosine decay to decay_lr at step decay_steps (which includes warmup)."""

    warmup_steps: int = 1_000
    peak_lr: float = 2.5e-5
    decay_steps: int = 0
    """The step the decay ends at; 0: the run's length (--steps, or what --max-time lays out)."""
    decay_lr: float = 2.5e-6

    def __post_init__(self) -> None:
        _check_non_negative("CosineDecaySchedule", "warmup_steps", self.warmup_steps)
        _check_positive("CosineDecaySchedule", "peak_lr", self.peak_lr)
        if not 0 <= self.decay_lr <= self.peak_lr:
            raise ConfigError(
                f"CosineDecaySchedule.decay_lr must be in [0, peak_lr={self.peak_lr}], got {self.decay_lr}"
            )
        _check_non_negative("CosineDecaySchedule", "decay_steps", self.decay_steps)
        if self.decay_steps and not self.decay_steps > self.warmup_steps:
            raise ConfigError(
                f"CosineDecaySchedule.decay_steps must be > warmup_steps={self.warmup_steps} "
                f"(it counts warmup too; 0 follows the run's length), got {self.decay_steps}"
            )

    def ends_at(self, run_steps: int) -> int | None:
        """The step the schedule reaches its final rate at, in a run of `run_steps`."""
        return self.decay_steps or run_steps

    def create(self, run_steps: RunSteps = 0) -> optax.Schedule:
        import jax.numpy as jnp
        import optax

        end = _length("CosineDecaySchedule", "decay_steps", self.decay_steps, run_steps)
        warmup = _linear_warmup(self.warmup_steps, self.peak_lr)
        alpha = self.decay_lr / self.peak_lr

        def cosine(
            step: jax.Array,
        ) -> jax.Array:  # optax's cosine_decay_schedule, with a length that may be traced
            progress = jnp.clip(step / jnp.maximum(end - self.warmup_steps, 1), 0.0, 1.0)
            return self.peak_lr * ((1 - alpha) * 0.5 * (1 + jnp.cos(jnp.pi * progress)) + alpha)

        return optax.join_schedules([warmup, cosine], [self.warmup_steps])


@dataclasses.dataclass(frozen=True)
class RsqrtDecaySchedule(LRScheduleConfig):
    """Linear warmup, then peak_lr / sqrt((timescale + t) / timescale) with t counted from the end of warmup.

    Never reaches zero, so training can be extended without choosing a horizon up front.
    """

    warmup_steps: int = 1_000
    peak_lr: float = 5e-5
    timescale: float = 10_000

    def __post_init__(self) -> None:
        _check_non_negative("RsqrtDecaySchedule", "warmup_steps", self.warmup_steps)
        _check_positive("RsqrtDecaySchedule", "peak_lr", self.peak_lr)
        if not self.timescale > 0:
            raise ConfigError(f"RsqrtDecaySchedule.timescale must be > 0, got {self.timescale}")

    def ends_at(self, run_steps: int) -> int | None:
        return None

    def create(self, run_steps: RunSteps = 0) -> optax.Schedule:
        import jax.numpy as jnp
        import optax

        def rsqrt_decay(step: jax.Array) -> jax.Array:
            return self.peak_lr / jnp.sqrt((self.timescale + step) / self.timescale)

        return optax.join_schedules(
            [_linear_warmup(self.warmup_steps, self.peak_lr), rsqrt_decay], [self.warmup_steps]
        )


@dataclasses.dataclass(frozen=True)
class WSDSchedule(LRScheduleConfig):
    """Warmup-stable-decay: linear warmup, constant peak_lr, then decay over the last decay_fraction of steps.

    The long constant phase lets a run be branched into decays of different lengths, and lets a time-budgeted
    run fix its length late (the steps before the decay are the same whatever the length); "1-sqrt" decays
    faster at first and usually ends at a lower loss than "linear" for the same budget.
    """

    warmup_steps: int = 1_000
    peak_lr: float = 3e-4
    total_steps: int = 0
    """The step the decay ends at; 0: the run's length (--steps, or what --max-time lays out)."""
    decay_fraction: float = 0.2
    final_lr_fraction: float = 0.0
    shape: Literal["linear", "1-sqrt"] = "1-sqrt"

    def __post_init__(self) -> None:
        _check_non_negative("WSDSchedule", "warmup_steps", self.warmup_steps)
        _check_positive("WSDSchedule", "peak_lr", self.peak_lr)
        _check_non_negative("WSDSchedule", "total_steps", self.total_steps)
        if not 0 < self.decay_fraction <= 1:
            raise ConfigError(f"WSDSchedule.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if not 0 <= self.final_lr_fraction <= 1:
            raise ConfigError(
                f"WSDSchedule.final_lr_fraction must be in [0, 1], got {self.final_lr_fraction}"
            )
        if self.shape not in ("linear", "1-sqrt"):
            raise ConfigError(f"WSDSchedule.shape must be 'linear' or '1-sqrt', got {self.shape!r}")
        if self.total_steps:  # the run's own length (0) may be short: the decay then cuts the warmup short
            decay = self.decay_steps(self.total_steps)
            if decay < 1:
                raise ConfigError(
                    f"WSDSchedule.decay_fraction={self.decay_fraction} gives 0 decay steps out of "
                    f"total_steps={self.total_steps}; increase it"
                )
            if self.warmup_steps + decay > self.total_steps:
                raise ConfigError(
                    f"WSDSchedule.warmup_steps={self.warmup_steps} plus the {decay} decay steps exceed "
                    f"total_steps={self.total_steps}; lower warmup_steps or decay_fraction"
                )

    def ends_at(self, run_steps: int) -> int | None:
        """The step the schedule reaches its final rate at, in a run of `run_steps`."""
        return self.total_steps or run_steps

    def decay_steps(self, total: RunSteps) -> RunSteps:
        """Steps of the decay in a schedule of `total` steps (traced when the run's length is)."""
        if isinstance(total, int):
            return round(self.decay_fraction * total)
        import jax.numpy as jnp

        return jnp.round(self.decay_fraction * total)

    def create(self, run_steps: RunSteps = 0) -> optax.Schedule:
        import jax.numpy as jnp

        total = _length("WSDSchedule", "total_steps", self.total_steps, run_steps)
        decay_steps = self.decay_steps(total)
        floor = self.final_lr_fraction * self.peak_lr
        warmup = _linear_warmup(self.warmup_steps, self.peak_lr)

        def decay(step: jax.Array) -> jax.Array:  # peak_lr until the decay starts
            # The fraction left, as (total - step) / decay: 1 - progress would cancel to a few float32 ulps
            # in a long run's last steps, where the rate is a small fraction of the peak.
            left = jnp.clip((total - step) / jnp.maximum(decay_steps, 1), 0.0, 1.0)
            remaining = left if self.shape == "linear" else 1.0 - jnp.sqrt(1.0 - left)
            return floor + (self.peak_lr - floor) * remaining

        def schedule(step: jax.Array) -> jax.Array:
            # A run shorter than warmup + decay starts decaying during the warmup: the smaller rate wins.
            return jnp.where(step < self.warmup_steps, jnp.minimum(warmup(step), decay(step)), decay(step))

        return schedule


@dataclasses.dataclass(frozen=True)
class ConstantSchedule(LRScheduleConfig):
    """Linear warmup, then peak_lr forever."""

    warmup_steps: int = 1_000
    peak_lr: float = 3e-4

    def __post_init__(self) -> None:
        _check_non_negative("ConstantSchedule", "warmup_steps", self.warmup_steps)
        _check_positive("ConstantSchedule", "peak_lr", self.peak_lr)

    def ends_at(self, run_steps: int) -> int | None:
        return None

    def create(self, run_steps: RunSteps = 0) -> optax.Schedule:
        # linear_schedule holds end_value after transition_steps.
        return _linear_warmup(self.warmup_steps, self.peak_lr)


def is_embedding_or_head(path: jax.tree_util.KeyPath) -> bool:
    """Whether a param belongs to the token/position embedding or the output head."""
    import jax

    key = jax.tree_util.keystr(path)
    return any(name in key for name in _EMBEDDING_OR_HEAD_NAMES)


def _leaf_name(path: jax.tree_util.KeyPath) -> str:
    """The param's own name, e.g. "kernel"; nnx.State paths end in an extra "value"."""
    import jax

    names = jax.tree_util.keystr(path, simple=True, separator="/").split("/")
    return names[-2] if len(names) > 1 and names[-1] == "value" else names[-1]


def _is_matrix(path: jax.tree_util.KeyPath, x: Any) -> bool:
    """Weight matrices and embeddings: ndim >= 2, minus the norm scales and biases of scan-stacked layers."""
    return len(x.shape) >= 2 and _leaf_name(path) not in _VECTOR_PARAM_NAMES


def default_weight_decay_mask(params: Any) -> Any:
    """True for weight matrices and embeddings (ndim >= 2); norms, biases and scalars are not decayed.

    Leaves named "scale" or "bias" are excluded even when 2-D, so scan-stacked layers get the same mask.
    Works on arrays and on jax.ShapeDtypeStruct leaves.
    """
    import jax

    return jax.tree_util.tree_map_with_path(_is_matrix, params)


def muon_labels(params: Any, head: bool = False) -> Any:
    """Label each leaf "muon" (hidden weight matrix) or "adam" (embeddings, head, norms, biases, scalars);
    with `head`, the untied output layer's "head" (its own learning rate).

    Embeddings and the head are matrices too, but they are lookup tables / a classifier rather than
    hidden linear maps, and Muon's orthogonalized updates are known to hurt them.
    """
    import jax

    def label(path: jax.tree_util.KeyPath, x: Any) -> str:
        if _is_matrix(path, x) and not is_embedding_or_head(path):
            return "muon"
        return "head" if head and _HEAD_NAME in jax.tree_util.keystr(path) else "adam"

    return jax.tree_util.tree_map_with_path(label, params)


def _scale_lr(lr: optax.ScalarOrSchedule, factor: float) -> optax.ScalarOrSchedule:
    if callable(lr):
        return lambda step: lr(step) * factor
    return lr * factor


@runtime_checkable
class OptimizerConfig(Protocol):
    def create(
        self,
        lr: optax.ScalarOrSchedule,
        weight_decay_mask: WeightDecayMask = None,
        compute_dtype: str = "float32",
    ) -> optax.GradientTransformation:
        """The optax object. `compute_dtype` is the model's, for an optimizer with products of its own."""
        ...


@dataclasses.dataclass(frozen=True)
class AdamW(OptimizerConfig):
    """AdamW with global-norm gradient clipping; b2=0.95 is the usual choice for transformer LMs."""

    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_gradient_norm: float = 1.0

    def __post_init__(self) -> None:
        _check_beta("AdamW", "b1", self.b1)
        _check_beta("AdamW", "b2", self.b2)
        _check_positive("AdamW", "eps", self.eps)
        _check_non_negative("AdamW", "weight_decay", self.weight_decay)
        _check_clip("AdamW", self.clip_gradient_norm)

    def create(
        self,
        lr: optax.ScalarOrSchedule,
        weight_decay_mask: WeightDecayMask = None,
        compute_dtype: str = "float32",
    ) -> optax.GradientTransformation:
        import optax

        return optax.chain(
            optax.clip_by_global_norm(self.clip_gradient_norm),
            optax.adamw(
                lr, self.b1, self.b2, self.eps, weight_decay=self.weight_decay, mask=weight_decay_mask
            ),
        )


@dataclasses.dataclass(frozen=True)
class SGD(OptimizerConfig):
    """SGD with (Nesterov) momentum and decoupled weight decay (SGDW).

    The decay is added after the momentum buffer and scaled by lr, like AdamW, so it shrinks weights
    by lr * weight_decay per step instead of accumulating in the momentum as L2 would.
    """

    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 0.0
    clip_gradient_norm: float = 1.0

    def __post_init__(self) -> None:
        _check_beta("SGD", "momentum", self.momentum)
        _check_non_negative("SGD", "weight_decay", self.weight_decay)
        _check_clip("SGD", self.clip_gradient_norm)

    def create(
        self,
        lr: optax.ScalarOrSchedule,
        weight_decay_mask: WeightDecayMask = None,
        compute_dtype: str = "float32",
    ) -> optax.GradientTransformation:
        import optax

        return optax.chain(
            optax.clip_by_global_norm(self.clip_gradient_norm),
            optax.trace(decay=self.momentum, nesterov=self.nesterov),
            optax.add_decayed_weights(self.weight_decay, weight_decay_mask),
            optax.scale_by_learning_rate(lr),
        )


@dataclasses.dataclass(frozen=True)
class Lion(OptimizerConfig):
    """Lion (sign of interpolated momentum). Updates are +-1 per entry: use a ~3-10x smaller lr than AdamW."""

    b1: float = 0.9
    b2: float = 0.99
    weight_decay: float = 0.1
    clip_gradient_norm: float = 1.0

    def __post_init__(self) -> None:
        _check_beta("Lion", "b1", self.b1)
        _check_beta("Lion", "b2", self.b2)
        _check_non_negative("Lion", "weight_decay", self.weight_decay)
        _check_clip("Lion", self.clip_gradient_norm)

    def create(
        self,
        lr: optax.ScalarOrSchedule,
        weight_decay_mask: WeightDecayMask = None,
        compute_dtype: str = "float32",
    ) -> optax.GradientTransformation:
        import optax

        return optax.chain(
            optax.clip_by_global_norm(self.clip_gradient_norm),
            optax.lion(lr, self.b1, self.b2, weight_decay=self.weight_decay, mask=weight_decay_mask),
        )


@dataclasses.dataclass(frozen=True)
class Muon(OptimizerConfig):
    """Muon for hidden weight matrices, AdamW for everything else, as in the modded-nanogpt speedruns.

    The schedule's lr is Muon's lr (~0.02 is typical, far above AdamW's). The AdamW part runs at
    lr * adam_lr_ratio; the default 0.015 is the reference setup from Keller Jordan's Muon repo
    (Muon lr 0.02, AdamW lr 3e-4). An untied output layer can take its own, lr * head_lr_ratio: a
    classifier that every token's loss reaches directly wants smaller steps than the embedding, whose rows
    each see few tokens. Kernels with ndim > 2 are treated as stacks of (in, out) matrices
    over their leading axes, so scan-stacked layers are orthogonalized per layer; a multi-head kernel
    must therefore be stored as (in, heads * head_dim), not (in, heads, head_dim). Weight decay is
    decoupled and scaled by each part's lr, and the weight-decay mask applies to both parts. The
    orthogonalization's products take the model's compute dtype (`minigpt.optim.muon`).
    """

    momentum: float = 0.95
    nesterov: bool = True
    adam_lr_ratio: float = 0.015
    b1: float = 0.9
    b2: float = 0.95
    weight_decay: float = 0.01
    clip_gradient_norm: float = 1.0
    head_lr_ratio: float | None = None
    """The untied output layer's AdamW lr as a multiple of the schedule's (None: adam_lr_ratio, as every
    other AdamW parameter). A tied one is the embedding too, and keeps adam_lr_ratio."""

    def __post_init__(self) -> None:
        _check_beta("Muon", "momentum", self.momentum)
        _check_positive("Muon", "adam_lr_ratio", self.adam_lr_ratio)
        if self.head_lr_ratio is not None:
            _check_positive("Muon", "head_lr_ratio", self.head_lr_ratio)
        _check_beta("Muon", "b1", self.b1)
        _check_beta("Muon", "b2", self.b2)
        _check_non_negative("Muon", "weight_decay", self.weight_decay)
        _check_clip("Muon", self.clip_gradient_norm)

    def create(
        self,
        lr: optax.ScalarOrSchedule,
        weight_decay_mask: WeightDecayMask = None,
        compute_dtype: str = "float32",
    ) -> optax.GradientTransformation:
        import jax.numpy as jnp
        import optax

        from minigpt.optim import muon

        dtype = jnp.dtype(compute_dtype)
        hidden = muon.muon(lr, self.momentum, self.nesterov, self.weight_decay, weight_decay_mask, dtype)
        adam = lambda ratio: optax.adamw(
            _scale_lr(lr, ratio), self.b1, self.b2, weight_decay=self.weight_decay, mask=weight_decay_mask
        )
        parts = {"muon": hidden, "adam": adam(self.adam_lr_ratio)}
        if self.head_lr_ratio is not None:
            parts["head"] = adam(self.head_lr_ratio)
        labels = functools.partial(muon_labels, head=self.head_lr_ratio is not None)
        return optax.chain(
            optax.clip_by_global_norm(self.clip_gradient_norm), optax.multi_transform(parts, labels)
        )


Optimizer = AdamW | SGD | Lion | Muon
Schedule = CosineDecaySchedule | RsqrtDecaySchedule | WSDSchedule | ConstantSchedule


def create_optimizer(
    optimizer: OptimizerConfig,
    lr_schedule: LRScheduleConfig,
    weight_decay_mask: WeightDecayMask = None,
    run_steps: RunSteps = 0,
    compute_dtype: str = "float32",
) -> optax.GradientTransformation:
    """The full optimizer: `optimizer` driven by `lr_schedule` (over `run_steps`, if its length follows the
    run's), decaying the leaves `weight_decay_mask` selects (by default `default_weight_decay_mask`: weight
    matrices and embeddings, not norms or biases). Muon's Newton-Schulz products take `compute_dtype`, the
    model's resolved one. The state's structure depends on neither the schedule nor the dtype."""
    if weight_decay_mask is None:
        weight_decay_mask = default_weight_decay_mask
    return optimizer.create(lr_schedule.create(run_steps), weight_decay_mask, compute_dtype)


def average_start(run_steps: RunSteps, fraction: float) -> RunSteps:
    """The last step before a weight average over the last `fraction` of a run of `run_steps` begins."""
    if isinstance(run_steps, int):
        return run_steps - round(fraction * run_steps)
    import jax.numpy as jnp

    return run_steps - jnp.round(fraction * run_steps).astype(run_steps.dtype)


def average_rate(step: jax.Array, run_steps: RunSteps, fraction: float) -> jax.Array:
    """How far the weight average moves towards the weights after update `step`: avg += rate x (w - avg).

    Step start + n gets weight n in the average (later weights, nearer the end of the decay, count more), and
    2 / (n + 1) is that weighted mean's streaming update. Up to start + 1 the rate is 1, so the average is the
    weights themselves until the averaged steps begin, wherever a run of `run_steps` (traced under --max-time)
    places them."""
    import jax.numpy as jnp

    n = jnp.maximum(step - average_start(run_steps, fraction), 1)
    return 2.0 / (n + 1.0)


def accumulate_gradients(
    loss_fn: Callable[[Any, Any, jax.Array], jax.Array], params: Any, micro_batches: Any
) -> tuple[jax.Array, Any]:
    """Mean loss and gradient over K micro-batches (the leading axis of `micro_batches`), computed one
    micro-batch at a time under `lax.scan`: exactly the K-times larger batch's gradient (clipping and the
    optimizer then see that mean, once per update) in the activation memory of one micro-batch.

    `loss_fn(params, micro_batch, i)` gets the micro-batch index, e.g. to fold it into a dropout key."""
    import jax
    import jax.numpy as jnp

    k = jax.tree.leaves(micro_batches)[0].shape[0]

    def one(total, xs):
        i, batch = xs
        loss, grads = jax.value_and_grad(loss_fn)(params, batch, i)
        return jax.tree.map(jnp.add, total, (loss, grads)), None

    zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
    total, _ = jax.lax.scan(one, zeros, (jnp.arange(k), micro_batches))
    return jax.tree.map(lambda x: x / k, total)
