"""The step library: the devices a CPU is split into, the train state, building it sharded from abstract
shapes, the jitted train and eval steps, and evaluation over the validation split.

The NNX model is split once into (graphdef, params); the train step is a pure function of a `TrainState` and
a batch, jitted with explicit shardings and the state donated, so no Python object is walked per step.
Nothing here knows about run directories, logging or checkpoints: the loop (`train.py`), the benchmarks
(`bench.py`), inference (`runs.py`) and the transformers import (`hf.py`) all build on it.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

from minigpt.config import ConfigError, TrainConfig
from minigpt.data import packing
from minigpt.data.encode import usable_cores
from minigpt.nn import lora
from minigpt.nn.model import GPT, abstract_model
from minigpt.optim.optimizer import accumulate_gradients, average_rate, create_optimizer
from minigpt.parallel import sharding
from minigpt.training import hardware


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    """Everything a train step reads and writes (a checkpoint adds the data position). Updated with
    `dataclasses.replace`; its leaves are jax arrays, or ShapeDtypeStructs for the abstract state."""

    step: Any
    """() int32: optimizer updates done."""
    params: nnx.State
    opt_state: optax.OptState
    rng: Any
    """(2,) uint32: the run's dropout key; each step folds in its step number, so no key is carried forward."""
    average: nnx.State | None = None
    """--average-weights: the running average of the trained parameters (`optimizer.average_rate`), or None."""

    @classmethod
    def create(cls, params: nnx.State, tx: optax.GradientTransformation, cfg: TrainConfig) -> TrainState:
        """Step 0 of a run of `cfg`: given parameters and a fresh optimizer state (and weight average, where
        the run keeps one) for the trained ones only."""
        train = trained(params)[0]
        return cls(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(train),
            rng=jax.random.PRNGKey(cfg.seed + 1),
            average=jax.tree.map(jnp.copy, train) if cfg.average_weights else None,
        )

    def saved(self) -> dict[str, Any]:
        """The state as a checkpoint holds it: its fields by name, without an average it does not keep (so a
        checkpoint written without one has the same structure as those from before there was one)."""
        return {f.name: v for f in dataclasses.fields(self) if (v := getattr(self, f.name)) is not None}

    def with_average(self) -> TrainState:
        """The state with its average as its parameters (a LoRA run's frozen base kept as it is)."""
        frozen = trained(self.params)[1]
        return dataclasses.replace(
            self, params=self.average if frozen is None else lora.merge(self.average, frozen)
        )

    @classmethod
    def restored(cls, saved: dict[str, Any], average: bool) -> TrainState:
        """A state from what a checkpoint held (`saved`), keeping an average if the run does (`average`): one
        the checkpoint lacks (saved without --average-weights) starts from its weights."""
        kept_average = saved.get("average")
        if average and kept_average is None:
            kept_average = jax.tree.map(jnp.copy, saved["params"])
        return cls(**{**saved, "average": kept_average if average else None})


def trained(params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
    """(the parameters that train, the frozen rest or None): a model with LoRA adapters trains only them."""
    adapters, rest = lora.split(params)
    return (adapters, rest) if jax.tree.leaves(adapters) else (params, None)


def kept(state: TrainState) -> TrainState:
    """What a checkpoint holds of a state (or abstract state): all of it, or of a LoRA run everything but the
    frozen base, which is written once beside its checkpoints (`checkpoint.save_base`)."""
    return dataclasses.replace(state, params=trained(state.params)[0])


def with_base(state: TrainState, base: nnx.State | None) -> TrainState:
    """A state restored from a checkpoint (`kept`), whole again with its base parameters."""
    return state if base is None else dataclasses.replace(state, params=lora.merge(state.params, base))


@dataclasses.dataclass(frozen=True)
class Setup:
    """Everything derived from a config before any array exists: model structure, mesh, optimizer, and the
    abstract state (ShapeDtypeStructs carrying their target shardings, what a checkpoint restores onto)."""

    cfg: TrainConfig
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    abstract_state: TrainState
    state_shardings: TrainState

    def tx(self, run_steps: Any) -> optax.GradientTransformation:
        """The optimizer for a run of `run_steps` (a traced scalar inside the step: see `train_step`)."""
        return create_optimizer(
            self.cfg.optimizer, self.cfg.schedule, run_steps=run_steps, compute_dtype=self.cfg.model.dtype
        )


def resolve_model(cfg: TrainConfig, vocab_size: int, eot_id: int) -> TrainConfig:
    """Fill the model's vocabulary and end-of-text token from the tokenizer (or check explicit ones)."""
    model = cfg.model
    if model.vocab_size and model.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's {vocab_size}")
    if model.eot_id not in (-1, eot_id):
        raise ConfigError(
            f"model.eot_id={model.eot_id} is not the tokenizer's end-of-text token {eot_id}; leave it -1"
        )
    model = dataclasses.replace(model, vocab_size=model.vocab_size or vocab_size, eot_id=eot_id)
    return dataclasses.replace(cfg, model=model)


def weight_decay_floor(cfg: TrainConfig, epoch: int | None) -> float | None:
    """--weight-decay-passes' least weight decay: 1 / (peak lr x the steps of that many passes over the
    training text). Decoupled decay shrinks a weight by lr x decay per step, so what a weight learned fades
    within those passes instead of being memorised from text read again and again. None for a run from a
    checkpoint (decay would wipe what it starts from) or of unknown pass length (`epoch`)."""
    if not cfg.weight_decay_passes or epoch is None or cfg.init_from:
        return None
    return 1.0 / (cfg.schedule.peak_lr * cfg.weight_decay_passes * epoch)


def resolve_weight_decay(cfg: TrainConfig, epoch: int | None) -> TrainConfig:
    """The config with the optimizer's weight decay raised to `weight_decay_floor` where that is larger."""
    floor = weight_decay_floor(cfg, epoch)
    if floor is None or floor <= cfg.optimizer.weight_decay:
        return cfg
    return dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, weight_decay=floor))


CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def split_cpu(cfg: TrainConfig, multi_process: bool) -> int:
    """Split the CPU into `cfg.mesh.cpu_devices` XLA devices before JAX starts; returns the count set (0: left
    alone, or the run trains on an accelerator). XLA runs each device's program on its own thread, so the
    small fusions one program runs a core at a time spread over every core; devices beyond the cores only add
    overhead, so -1 stops at the core count."""
    n = cfg.mesh.cpu_devices
    if n == -1 and (multi_process or CPU_DEVICES_FLAG in os.environ.get("XLA_FLAGS", "")):
        return 0
    n = n if n != -1 else cpu_devices_that_fit(cfg, usable_cores())
    try:
        jax.config.update("jax_num_cpu_devices", n)
    except RuntimeError:  # JAX already started in this process (a notebook, a test): its devices stay
        if cfg.mesh.cpu_devices != -1 and jax.local_device_count("cpu") != n:
            raise ConfigError(
                f"mesh.cpu_devices={n} cannot be set: JAX has already started in this process with "
                f"{jax.local_device_count('cpu')} CPU devices; set it in a fresh process"
            ) from None
        return 0
    return n if jax.default_backend() == "cpu" else 0  # an accelerator's run does not train on them


def cpu_layout(cfg: TrainConfig, split: int) -> TrainConfig:
    """The default mesh (data -1, fsdp 1, tensor 1) over a CPU that `split_cpu` split into `split` > 1 devices,
    laid out as FSDP instead: the devices share one memory, so FSDP's gathers are copies, and each device
    updates its share of the large arrays' optimizer state where data parallelism repeats the whole update
    on every device. Explicit mesh sizes are kept."""
    mesh = cfg.mesh
    if split <= 1 or (mesh.data, mesh.fsdp, mesh.tensor) != (-1, 1, 1):
        return cfg
    return dataclasses.replace(cfg, mesh=dataclasses.replace(mesh, data=1, fsdp=-1))


def cpu_devices_that_fit(cfg: TrainConfig, cores: int) -> int:
    """The most devices, at most one per core, that the mesh's sizes fill and the batch and model split over."""
    for n in range(cores, 1, -1):
        try:
            data, fsdp, tensor = sharding.mesh_shape(cfg.mesh, n)
            check_layout(cfg, data * fsdp, tensor)
        except ConfigError:
            continue
        return n
    return 1


def make_run_mesh(cfg: TrainConfig, devices: list | None = None) -> jax.sharding.Mesh:
    """The mesh for this run, checked against the batch and model shapes before any data is read."""
    mesh = sharding.make_mesh(cfg.mesh, devices)
    check_layout(cfg, sharding.data_parallel_size(mesh), mesh.shape[sharding.TENSOR_AXIS])
    if cfg.batch_size % jax.process_count():
        raise ConfigError(
            f"batch_size={cfg.batch_size} is not divisible by the {jax.process_count()} processes"
        )
    return mesh


def check_layout(cfg: TrainConfig, dp: int, tp: int) -> None:
    """The batch splits over the data-parallel size `dp` (data x fsdp), the heads and MLP over the tensor size."""
    if cfg.batch_size % dp:
        raise ConfigError(
            f"batch_size={cfg.batch_size} is not divisible by the data-parallel size {dp} (mesh data x fsdp); "
            f"use a multiple of {dp}"
        )
    for name in ("n_heads", "kv_heads", "d_ff"):
        if getattr(cfg.model, name) % tp:
            raise ConfigError(f"mesh.tensor={tp} does not divide model.{name}={getattr(cfg.model, name)}")


def with_compute_dtype(cfg: TrainConfig, platform: str) -> TrainConfig:
    """`--model.dtype auto` made the dtype this platform trains fastest in (`hardware.compute_dtype`)."""
    dtype, _ = hardware.compute_dtype(cfg.model.dtype, platform)
    if cfg.model.dtype == "auto" and jax.process_count() > 1:  # every process compiles the same program
        dtype = ("float32", "bfloat16")[
            int(multihost_utils.broadcast_one_to_all(np.int32(dtype == "bfloat16")))
        ]
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype=dtype))


def build(cfg: TrainConfig, devices: list | None = None, *, optimizer: bool = True) -> Setup:
    """The run's structure from shapes alone: nothing is allocated or compiled. Without `optimizer`
    (generation, evaluation, export) the abstract state holds only the step and the parameters. The setup's
    config has the compute dtype resolved."""
    mesh = make_run_mesh(cfg, devices)
    cfg = with_compute_dtype(cfg, mesh.devices.flat[0].platform)
    graphdef, abstract_params = abstract_model(cfg.model, cfg.seed)
    if optimizer:
        tx = create_optimizer(cfg.optimizer, cfg.schedule, run_steps=cfg.steps)  # the state's structure only
        shapes = jax.eval_shape(functools.partial(TrainState.create, tx=tx, cfg=cfg), abstract_params)
    else:
        shapes = TrainState(jax.ShapeDtypeStruct((), jnp.int32), abstract_params, opt_state=None, rng=None)
    shardings = sharding.fsdp_sharding(shapes, mesh, min_size_mbytes=cfg.mesh.fsdp_min_mbytes)
    abstract = jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings
    )
    return Setup(cfg, mesh, graphdef, abstract, shardings)


def init_state(setup: Setup) -> TrainState:
    """Initialise parameters directly into their shards: no full copy ever sits on one device."""
    cfg = setup.cfg

    def init() -> TrainState:
        _, params = nnx.split(GPT(cfg.model, nnx.Rngs(cfg.seed)))
        return TrainState.create(params, setup.tx(cfg.steps), cfg)

    return jax.jit(init, out_shardings=setup.state_shardings)()


def random_batch(setup: Setup, seed: int = 0) -> jax.Array:
    """A (grad_accum, batch, seq_len + 1) batch of uniformly random token ids, sharded as the train step wants."""
    cfg = setup.cfg
    shape = (cfg.grad_accum, cfg.batch_size // jax.process_count(), cfg.data.seq_len + 1)
    tokens = np.random.default_rng(seed).integers(0, cfg.model.vocab_size, shape, dtype=np.int32)
    return sharding.global_batch(setup.mesh, tokens, micro_batches=True)


def step_seconds(cfg: TrainConfig, timed: int = 2) -> float:
    """The fastest of `timed` train steps of `cfg` (vocabulary resolved) on random tokens, after one untimed
    step. The programs it compiles are the run's own, so the run reads them back from the compilation cache."""
    setup = build(cfg)
    with sharding.set_mesh(setup.mesh):
        state, batch = init_state(setup), random_batch(setup, cfg.seed)
        step = make_train_step(setup)
        times = []
        for _ in range(timed + 1):
            t = time.perf_counter()
            state, metrics = step(state, batch, cfg.steps)  # an int, as the loop passes it
            jax.block_until_ready((state, metrics))
            times.append(time.perf_counter() - t)
    return min(times[1:])


@dataclasses.dataclass(frozen=True)
class Rows:
    """Rows of T + 1 tokens taken apart for the model: inputs, targets, which targets count, and for packed
    examples the attention segments and positions (None for text, where every target counts)."""

    inputs: jax.Array
    targets: jax.Array
    counted: jax.Array
    segments: dict[str, jax.Array | None]

    @classmethod
    def of(cls, tokens: jax.Array, examples: bool) -> Rows:
        """`tokens` (B, T + 1) as the loader gives them: text, or with `examples` the flags of
        `minigpt.data.packing` (an example starts a segment at position 0; flagged tokens are no targets)."""
        if not examples:
            counted = jnp.ones((tokens.shape[0], tokens.shape[1] - 1), jnp.float32)
            return cls(tokens[:, :-1], tokens[:, 1:], counted, {})
        ids = tokens & packing.ID_MASK
        start = (tokens & packing.START) != 0
        counted = cls.counted_in(tokens)
        t = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        positions = t - jax.lax.cummax(jnp.where(start, t, 0), axis=1)
        segment = jnp.cumsum(start, axis=1, dtype=jnp.int32)
        segments = {"segment_ids": segment[:, :-1], "positions_BT": positions[:, :-1]}
        return cls(ids[:, :-1], ids[:, 1:], counted, segments)

    def nll(self, graphdef: nnx.GraphDef, params: Any) -> jax.Array:
        """Per-position next-token negative log-likelihood (B, T) of the rows' targets."""
        return nnx.merge(graphdef, params).token_nll(self.inputs, self.targets, **self.segments)

    @staticmethod
    def counted_in(tokens: jax.Array) -> jax.Array:
        """Which next tokens of rows of examples (..., T + 1) are targets, as float32 (..., T)."""
        return ((tokens & (packing.START | packing.MASKED)) == 0)[..., 1:].astype(jnp.float32)


def token_nll(graphdef: nnx.GraphDef, params: Any, tokens: jax.Array, examples: bool = False) -> jax.Array:
    """Per-position next-token negative log-likelihood (B, T) for rows of T + 1 tokens (`Rows.of`)."""
    return Rows.of(tokens, examples).nll(graphdef, params)


def rows_loss(
    graphdef: nnx.GraphDef, params: Any, rows: Rows, key: jax.Array | None, per_target: jax.Array | float
) -> jax.Array:
    """NLL summed over the rows' counted targets, each weighted `per_target`, dropout driven by `key`."""
    weights = rows.counted * per_target
    return nnx.merge(graphdef, params).loss(rows.inputs, rows.targets, weights, key, **rows.segments)


def mean_nll(graphdef: nnx.GraphDef, params: Any, tokens: jax.Array, key: jax.Array | None) -> jax.Array:
    """The training loss on text: mean next-token NLL over windows of T + 1 tokens."""
    B, T = tokens.shape[0], tokens.shape[1] - 1
    return rows_loss(graphdef, params, Rows.of(tokens, False), key, 1.0 / (B * T))


def train_step(
    setup: Setup, state: TrainState, batch_KBT: jax.Array, run_steps: jax.Array
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer update from K micro-batches of windows (K, B, T + 1): the mean loss's gradient over all
    K x B windows, each micro-batch with its own dropout key. `run_steps` is the run's length, an argument
    rather than a constant so that a time-budgeted run can fix it once its step time is measured without
    recompiling (schedules whose length follows the run's read it)."""
    key = jax.random.fold_in(state.rng, state.step)
    examples = setup.cfg.data.examples
    K, B, T = batch_KBT.shape[0], batch_KBT.shape[1], batch_KBT.shape[2] - 1
    # The mean over the whole batch's counted targets: each micro-batch's loss is scaled so their mean is it.
    per_target = 1.0 / (B * T)
    if examples:
        per_target = K / jnp.maximum(Rows.counted_in(batch_KBT).sum(), 1.0)

    train, frozen = trained(state.params)
    whole = lambda train: train if frozen is None else lora.merge(train, frozen)

    def loss_fn(train: Any, tokens: jax.Array, i: jax.Array) -> jax.Array:
        rows = Rows.of(tokens, examples)
        return rows_loss(setup.graphdef, whole(train), rows, jax.random.fold_in(key, i), per_target)

    loss, grads = accumulate_gradients(loss_fn, train, batch_KBT)
    with jax.named_scope("optimizer"):  # a profile's category (tools/breakdown.py)
        updates, opt_state = setup.tx(run_steps).update(grads, state.opt_state, train)
        train = optax.apply_updates(train, updates)
    average = state.average
    if average is not None:
        rate = average_rate(state.step + 1, run_steps, setup.cfg.average_weights)
        average = jax.tree.map(lambda a, w: a + rate * (w - a), average, train)
    lr = setup.cfg.schedule.create(run_steps)(state.step)
    metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr}
    state = dataclasses.replace(state, params=whole(train), opt_state=opt_state, average=average)
    return dataclasses.replace(state, step=state.step + 1), metrics


def make_train_step(setup: Setup):
    """`train_step` jitted for this setup: state donated, batch split over data x fsdp, metrics replicated.
    Called as step(state, batch, run_steps)."""
    replicated = sharding.replicated(setup.mesh)
    return jax.jit(
        functools.partial(train_step, setup),
        in_shardings=(
            setup.state_shardings,
            sharding.batch_sharding(setup.mesh, micro_batches=True),
            replicated,
        ),
        out_shardings=(setup.state_shardings, replicated),
        donate_argnums=(0,),
    )


def eval_step(
    setup: Setup,
    token_bytes: jax.Array,
    dummy: tuple[jax.Array, jax.Array] | None,
    params: Any,
    tokens: jax.Array,
    weight: jax.Array,
) -> dict[str, jax.Array]:
    """Sums over a batch of (tokens (B, T + 1), row weight (B,)): NLL and token count for the loss, and the
    NLL and UTF-8 bytes of the targets that encode bytes, for bits per byte (`make_eval_step`'s tables)."""
    rows = Rows.of(tokens, setup.cfg.data.examples)
    nll = rows.nll(setup.graphdef, params)
    w = weight[:, None] * rows.counted
    target_bytes = token_bytes[rows.targets]
    if dummy is not None:  # a dummy prefix is no text byte (`PretrainedTokenizer.dummy_tables`)
        opens, prefixed = dummy
        target_bytes = target_bytes - opens[rows.inputs] * prefixed[rows.targets]
    nbytes = target_bytes * w
    # Tokens with no bytes (end-of-text) are left out of bits per byte, as their bytes are out of its denominator.
    return {
        "nll": (nll * w).sum(),
        "tokens": w.sum(),
        "nll_bytes": (nll * (nbytes > 0)).sum(),
        "bytes": nbytes.sum(),
    }


def make_eval_step(setup: Setup, token_bytes: np.ndarray, dummy: tuple | None = None):
    """`eval_step` jitted for this setup and a tokenizer's bytes-per-token table, and its `dummy_tables`
    where it has them."""
    bs = sharding.batch_sharding(setup.mesh)
    dummy = None if dummy is None else (jnp.asarray(dummy[0]), jnp.asarray(dummy[1]))
    return jax.jit(
        functools.partial(eval_step, setup, jnp.asarray(token_bytes), dummy),
        in_shardings=(setup.state_shardings.params, bs, bs),
        out_shardings=sharding.replicated(setup.mesh),
    )
