"""The training run: state built sharded from abstract shapes, one jitted pure step, evaluation, the loop.

The NNX model is split once into (graphdef, params); the step is a pure function of a state pytree
`{step, params, opt_state, rng}` and a batch, jitted with explicit shardings and the state donated.
"""

from __future__ import annotations

import dataclasses
import math
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from minigpt import sharding
from minigpt.checkpoint import Checkpointer, abstract_with_shardings
from minigpt.config import ConfigError, TrainConfig, load_json, save_json
from minigpt.data import TokenStore, eval_batches, prepare, train_iterator
from minigpt.generate import generate
from minigpt.metrics import MetricsWriter, bits_per_byte, flops_per_token, plot_losses
from minigpt.model import abstract_model, count_params
from minigpt.optimizer import create_optimizer


@dataclasses.dataclass
class Setup:
    """Everything derived from a config before any array exists: model shape, mesh, optimizer, shardings."""

    cfg: TrainConfig
    mesh: jax.sharding.Mesh
    graphdef: nnx.GraphDef
    tx: optax.GradientTransformation
    lr_schedule: optax.Schedule
    abstract_state: Any
    state_shardings: Any


def resolve_model(cfg: TrainConfig, vocab_size: int) -> TrainConfig:
    """Fill the model's vocabulary from the tokenizer (or check that an explicit one is large enough)."""
    if cfg.model.vocab_size == 0:
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))
    if cfg.model.vocab_size < vocab_size:
        raise ConfigError(
            f"model.vocab_size={cfg.model.vocab_size} is smaller than the tokenizer's {vocab_size}"
        )
    return cfg


def make_run_mesh(cfg: TrainConfig, devices: list | None = None) -> jax.sharding.Mesh:
    """The mesh for this run, checked against the batch and model shapes before any data is read."""
    mesh = sharding.make_mesh(cfg.mesh, devices)
    dp, tp = sharding.data_parallel_size(mesh), mesh.shape[sharding.TENSOR_AXIS]
    if cfg.batch_size % dp:
        raise ConfigError(
            f"batch_size={cfg.batch_size} is not divisible by the data-parallel size {dp} (mesh data x fsdp); "
            f"use a multiple of {dp}"
        )
    if cfg.batch_size % jax.process_count():
        raise ConfigError(
            f"batch_size={cfg.batch_size} is not divisible by the {jax.process_count()} processes"
        )
    for name in ("n_heads", "d_ff"):
        if getattr(cfg.model, name) % tp:
            raise ConfigError(f"mesh.tensor={tp} does not divide model.{name}={getattr(cfg.model, name)}")
    return mesh


def build(cfg: TrainConfig, devices: list | None = None) -> Setup:
    mesh = make_run_mesh(cfg, devices)
    graphdef, abstract_params = abstract_model(cfg.model, cfg.seed)
    param_shardings = sharding.param_shardings(abstract_params, mesh, cfg.mesh.fsdp_min_mbytes)
    tx = create_optimizer(cfg.optimizer, cfg.schedule)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    opt_shardings = optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract_opt,
        param_shardings,
        transform_non_params=lambda _: sharding.replicated(mesh),
    )
    rep = sharding.replicated(mesh)
    abstract_state = {
        "step": jax.ShapeDtypeStruct((), jnp.int32),
        "params": abstract_params,
        "opt_state": abstract_opt,
        "rng": jax.ShapeDtypeStruct((2,), jnp.uint32),
    }
    state_shardings = {"step": rep, "params": param_shardings, "opt_state": opt_shardings, "rng": rep}
    return Setup(cfg, mesh, graphdef, tx, cfg.schedule.create(), abstract_state, state_shardings)


def init_state(setup: Setup) -> Any:
    """Initialise parameters directly into their shards: no full copy ever sits on one device."""
    cfg = setup.cfg

    def init():
        _, params = nnx.split(_model(cfg))
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": setup.tx.init(params),
            "rng": jax.random.PRNGKey(cfg.seed + 1),
        }

    return jax.jit(init, out_shardings=setup.state_shardings)()


def _model(cfg: TrainConfig):
    from minigpt.model import GPT

    return GPT(cfg.model, nnx.Rngs(cfg.seed))


def token_nll(graphdef: nnx.GraphDef, params: Any, tokens: jax.Array, key: jax.Array | None) -> jax.Array:
    """Per-position next-token negative log-likelihood (B, T) for windows of T + 1 tokens."""
    logits = nnx.merge(graphdef, params)(tokens[:, :-1], dropout_key=key)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])


def make_train_step(setup: Setup):
    graphdef, tx, lr_schedule = setup.graphdef, setup.tx, setup.lr_schedule
    accum = setup.cfg.grad_accum

    def loss_fn(params, tokens, key):
        return token_nll(graphdef, params, tokens, key).mean()

    def step_fn(state, batch_KBT):
        key = jax.random.fold_in(state["rng"], state["step"])

        def micro(carry, xs):
            i, tokens = xs
            loss, grads = jax.value_and_grad(loss_fn)(state["params"], tokens, jax.random.fold_in(key, i))
            return jax.tree.map(jnp.add, carry, (loss, grads)), None

        zeros = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, state["params"]))
        (loss, grads), _ = jax.lax.scan(micro, zeros, (jnp.arange(accum), batch_KBT))
        loss, grads = jax.tree.map(lambda x: x / accum, (loss, grads))
        updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": lr_schedule(state["step"])}
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "rng": state["rng"]}
        return new_state, metrics

    batch_sharding = jax.sharding.NamedSharding(
        setup.mesh, jax.sharding.PartitionSpec(None, sharding.BATCH_AXES)
    )
    return jax.jit(
        step_fn,
        in_shardings=(setup.state_shardings, batch_sharding),
        out_shardings=(setup.state_shardings, sharding.replicated(setup.mesh)),
        donate_argnums=(0,),
    )


def make_eval_step(setup: Setup, token_bytes: np.ndarray):
    graphdef = setup.graphdef
    table = jnp.asarray(token_bytes)

    def eval_fn(params, tokens, weight):
        nll = token_nll(graphdef, params, tokens, None)
        w = jnp.broadcast_to(weight[:, None], nll.shape)
        nbytes = table[tokens[:, 1:]] * w
        # Tokens with no bytes (end-of-text) are left out of bits per byte, as their bytes are out of its denominator.
        return {
            "nll": (nll * w).sum(),
            "tokens": w.sum(),
            "nll_bytes": (nll * (nbytes > 0)).sum(),
            "bytes": nbytes.sum(),
        }

    bs = sharding.batch_sharding(setup.mesh)
    return jax.jit(
        eval_fn,
        in_shardings=(setup.state_shardings["params"], bs, bs),
        out_shardings=sharding.replicated(setup.mesh),
    )


def evaluate(
    setup: Setup, eval_step, params: Any, store: TokenStore, max_batches: int = 0
) -> dict[str, float]:
    """Validation loss (nats/token) and bits per byte over the validation split, in a fixed order."""
    cfg = setup.cfg
    totals = {"nll": 0.0, "tokens": 0.0, "nll_bytes": 0.0, "bytes": 0.0}
    bs = sharding.batch_sharding(setup.mesh)
    batches = eval_batches(store, cfg.data.seq_len, cfg.batch_size, jax.process_index(), jax.process_count())
    for i, (tokens, weight) in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        out = eval_step(
            params,
            jax.make_array_from_process_local_data(bs, tokens),
            jax.make_array_from_process_local_data(bs, weight),
        )
        for k, v in jax.device_get(out).items():
            totals[k] += float(v)
    return {
        "loss": totals["nll"] / totals["tokens"],
        "bpb": bits_per_byte(totals["nll_bytes"], totals["bytes"]),
        "tokens": totals["tokens"],
    }


class Console:
    """Prints only on process 0, so multi-host runs log once."""

    def __init__(self) -> None:
        self.enabled = jax.process_index() == 0

    def __call__(self, *args: Any) -> None:
        if self.enabled:
            print(*args, flush=True)


def _fmt_time(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) training in cfg.run_dir. Returns the final validation metrics."""
    say = Console()
    run_dir = Path(cfg.run_dir)
    make_run_mesh(cfg)  # fail on a bad mesh or batch before spending time on data
    store = prepare(cfg.data)
    tokenizer = store.tokenizer()
    cfg = resolve_model(cfg, store.vocab_size)
    setup = build(cfg)
    is_main = jax.process_index() == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        save_json(cfg, str(run_dir / "config.json"))
        tokenizer.save(run_dir / "tokenizer")

    ckpt = Checkpointer(run_dir, keep=cfg.keep_checkpoints)
    local_batch = cfg.batch_size // jax.process_count()
    data_it = train_iterator(
        store,
        cfg.data.seq_len,
        local_batch * cfg.grad_accum,
        cfg.seed,
        jax.process_index(),
        jax.process_count(),
    )
    if ckpt.latest_step() is not None:
        target = abstract_with_shardings(setup.abstract_state, setup.state_shardings)
        state, data_state, _ = ckpt.restore(target)
        data_it.set_state(data_state)
        say(f"resumed from step {int(state['step'])} in {ckpt.directory}")
    else:
        state = init_state(setup)

    n_params = count_params(state["params"])
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.data.seq_len
    flops_per_step = flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step
    say(
        f"model {n_params / 1e6:.2f}M params | vocab {cfg.model.vocab_size} ({tokenizer.identity}) | "
        f"mesh {dict(setup.mesh.shape)} | {tokens_per_step} tokens/step | "
        f"train {store.meta['splits']['train']['tokens']:,} tokens, val {store.meta['splits']['val']['tokens']:,}"
    )
    train_step = make_train_step(setup)
    eval_step = make_eval_step(setup, tokenizer.token_bytes())
    writer = MetricsWriter(run_dir, enabled=is_main)
    batch_sharding = jax.sharding.NamedSharding(
        setup.mesh, jax.sharding.PartitionSpec(None, sharding.BATCH_AXES)
    )

    def next_batch() -> jax.Array:
        local = next(data_it).reshape(cfg.grad_accum, local_batch, cfg.data.seq_len + 1)
        return jax.make_array_from_process_local_data(batch_sharding, local)

    def run_eval(step: int) -> dict[str, float]:
        result = evaluate(setup, eval_step, state["params"], store, cfg.eval_batches)
        writer.write(step, "val", result)
        sample = generate(
            setup.graphdef,
            state["params"],
            tokenizer,
            cfg.sample_prompt,
            max_new_tokens=cfg.sample_tokens,
            max_seq_len=cfg.model.max_seq_len,
            key=jax.random.PRNGKey(step),
            temperature=0.8,
            top_k=40,
        )[0]
        say(
            f"step {step:6d} | val loss {result['loss']:.4f} | val bits/byte {result['bpb']:.4f}\n  sample: {sample!r}"
        )
        if is_main:
            with open(run_dir / "samples.txt", "a") as f:
                f.write(f"--- step {step}\n{sample}\n")
        return result

    def save(step: int, val: dict | None) -> None:
        meta = {"tokenizer": tokenizer.identity, "step": step, "val": val}
        ckpt.save(step, state, data_it.get_state(), meta)

    start_step = int(state["step"])
    t_start = time.time()
    t_window, window_losses = time.time(), []
    val: dict[str, float] | None = None
    step = start_step
    while step < cfg.steps:
        state, metrics = train_step(state, next_batch())
        step += 1
        window_losses.append(metrics["loss"])
        if step % cfg.log_every == 0 or step == cfg.steps:
            m = jax.device_get(metrics)
            loss = float(np.mean(jax.device_get(window_losses)))
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss became {loss} at step {step}; last good checkpoint is kept")
            dt = time.time() - t_window
            tok_s = len(window_losses) * tokens_per_step / dt
            mfu_flops = len(window_losses) * flops_per_step / dt
            eta = (cfg.steps - step) * dt / len(window_losses)
            record = {
                "loss": loss,
                "lr": float(m["lr"]),
                "grad_norm": float(m["grad_norm"]),
                "tokens_per_s": tok_s,
            }
            record["tflops"] = mfu_flops / 1e12
            writer.write(step, "train", record)
            say(
                f"step {step:6d}/{cfg.steps} | loss {loss:.4f} | lr {record['lr']:.2e} | "
                f"grad norm {record['grad_norm']:.3f} | {tok_s:,.0f} tok/s | ETA {_fmt_time(eta)}"
            )
            t_window, window_losses = time.time(), []
        out_of_time = cfg.max_time and time.time() - t_start > cfg.max_time
        if step % cfg.eval_every == 0 or step == cfg.steps or out_of_time:
            val = run_eval(step)
            t_window = time.time()
        if step % cfg.ckpt_every == 0 or step == cfg.steps or out_of_time:
            save(step, val)
        if out_of_time:
            say(f"stopping at step {step}: max_time {cfg.max_time:.0f}s reached")
            break
    if val is None:  # resumed a finished run: nothing trained, still report where it stands
        val = run_eval(step)
    ckpt.close()
    writer.close()
    if is_main:
        plot_losses(run_dir)
    say(
        f"done: {step} steps in {_fmt_time(time.time() - t_start)} | val bits/byte {val['bpb']:.4f} | {run_dir}"
    )
    return {**val, "step": step}


def load_run(run_dir: str | Path, devices: list | None = None) -> tuple[Setup, Any, Any]:
    """Config, restored train state and tokenizer of a run directory (for eval, generate)."""
    from minigpt.tokenizer import load_tokenizer

    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise ConfigError(
            f"{run_dir} is not a run directory (no config.json); train one with `minigpt train`"
        )
    cfg = load_json(str(run_dir / "config.json"))
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data=-1, fsdp=1, tensor=1))
    setup = build(cfg, devices)
    ckpt = Checkpointer(run_dir, keep=cfg.keep_checkpoints)
    state, _, _ = ckpt.restore(abstract_with_shardings(setup.abstract_state, setup.state_shardings))
    ckpt.close()
    return setup, state, load_tokenizer(run_dir / "tokenizer")
