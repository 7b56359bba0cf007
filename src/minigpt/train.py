"""The training run: state built sharded from abstract shapes, one jitted pure step, evaluation, the loop.

The NNX model is split once into (graphdef, params); the step is a pure function of a state pytree
`{step, params, opt_state, rng}` and a batch, jitted with explicit shardings and the state donated.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from minigpt import sharding
from minigpt.bench import ProfileWindow
from minigpt.checkpoint import (
    Checkpointer,
    abstract_with_shardings,
    export_config_and_tokenizer,
    read_export,
    write_export,
)
from minigpt.config import ConfigError, TrainConfig, from_dict, load_json, save_json, to_dict
from minigpt.data import TokenStore, eval_batches, prepare, train_iterator
from minigpt.generate import generate
from minigpt.metrics import (
    MetricsWriter,
    bits_per_byte,
    flops_per_token,
    mfu,
    peak_flops_per_device,
    plot_losses,
)
from minigpt.model import abstract_model, count_params
from minigpt.optimizer import accumulate_gradients, create_optimizer


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
    for name in ("n_heads", "kv_heads", "d_ff"):
        if getattr(cfg.model, name) % tp:
            raise ConfigError(f"mesh.tensor={tp} does not divide model.{name}={getattr(cfg.model, name)}")
    return mesh


def build(cfg: TrainConfig, devices: list | None = None) -> Setup:
    mesh = make_run_mesh(cfg, devices)
    graphdef, abstract_params = abstract_model(cfg.model, cfg.seed)
    param_shardings = sharding.param_shardings(abstract_params, mesh, cfg.mesh.fsdp_min_mbytes)
    tx = create_optimizer(cfg.optimizer, cfg.schedule)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    opt_shardings = sharding.like_params(
        abstract_opt, abstract_params, param_shardings, sharding.replicated(mesh)
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

    def loss_fn(params, tokens, key):
        return token_nll(graphdef, params, tokens, key).mean()

    def step_fn(state, batch_KBT):
        key = jax.random.fold_in(state["rng"], state["step"])
        loss, grads = accumulate_gradients(
            lambda p, tokens, i: loss_fn(p, tokens, jax.random.fold_in(key, i)), state["params"], batch_KBT
        )
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


RESUME_SAFE_FIELDS = (
    "run_dir", "overwrite", "steps", "max_time", "log_every", "eval_every", "eval_batches", "ckpt_every",
    "keep_checkpoints", "sample_prompt", "sample_tokens", "mesh.", "dist.", "data.cache_dir", "data.gpt2_dir",
    "profile_steps", "peak_tflops",
    "data.tokenize_workers",
)  # fmt: skip
"""Config fields a resumed run may change: bookkeeping, run length and device layout (checkpoints restore onto
any mesh). Anything else (model, data, optimizer, schedule, batch, seed) would silently change the run."""


def _flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out |= _flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(old: TrainConfig, new: TrainConfig) -> list[str]:
    """Unsafe differences between a run's saved config and the one it is resumed with, as 'field: old -> new'."""
    a, b = _flatten(to_dict(old)), _flatten(to_dict(new))
    changed = [k for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in changed if not k.startswith(RESUME_SAFE_FIELDS)]


def _prepare_run_dir(cfg: TrainConfig, run_dir: Path) -> None:
    """Clear the run directory for --overwrite, or refuse to resume it with an incompatible config."""
    if cfg.overwrite:
        if jax.process_index() == 0:
            for name in ("checkpoints", "tb", "metrics.jsonl", "samples.txt", "loss.png", "config.json"):
                path = run_dir / name
                shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
        return
    saved = run_dir / "config.json"
    has_checkpoints = (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir())
    if saved.is_file() and has_checkpoints:
        changes = config_changes(load_json(str(saved)), cfg)
        if changes:
            raise ConfigError(
                f"{run_dir} holds a run with a different config ({'; '.join(changes)}); resume it unchanged, "
                "pass --overwrite to start again, or choose another --run-dir"
            )


class StopRequest:
    """SIGTERM or Ctrl-C asks the loop to finish its step, save and exit; a second Ctrl-C aborts at once."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        print(
            f"\n{self.signal_name}: finishing this step and saving a checkpoint (Ctrl-C again to abort)",
            file=sys.stderr,
            flush=True,
        )

    def agreed(self) -> bool:
        """Whether any process was asked to stop (all processes must stop at the same step)."""
        local = self.signal_name is not None
        if jax.process_count() == 1:
            return local
        from jax.experimental import multihost_utils

        return bool(np.any(multihost_utils.process_allgather(np.array([local]))))


def check_tokenizer(saved_dir: Path, identity: str) -> None:
    """Refuse to train or evaluate a model with a tokenizer other than the one it was trained (or imported)
    with: the token ids would mean different text."""
    from minigpt.tokenizer import load_tokenizer

    if not (saved_dir / "minigpt_tokenizer.json").is_file():
        return
    saved = load_tokenizer(saved_dir).identity
    if saved != identity:
        raise ConfigError(
            f"the model's tokenizer ({saved}, in {saved_dir}) differs from the one the data was tokenized with "
            f"({identity}); minigpt tokenizes corpora only with GPT-2's BPE or a BPE it trains itself"
        )


def _prepare_data(cfg: TrainConfig) -> TokenStore:
    """Process 0 tokenizes (once); the others wait for it, then open the same token store."""
    if jax.process_count() == 1:
        return prepare(cfg.data)
    from jax.experimental import multihost_utils

    store = prepare(cfg.data) if jax.process_index() == 0 else None
    multihost_utils.sync_global_devices("minigpt: token store ready")
    return store or prepare(cfg.data)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) training in cfg.run_dir. Returns the final validation metrics and step."""
    sharding.initialize_distributed(cfg.dist)
    say = Console()
    run_dir = Path(cfg.run_dir)
    make_run_mesh(cfg)  # fail on a bad mesh or batch before spending time on data
    store = _prepare_data(cfg)
    tokenizer = store.tokenizer()
    if not cfg.overwrite and (run_dir / "checkpoints").is_dir():
        check_tokenizer(run_dir / "tokenizer", tokenizer.identity)
    cfg = resolve_model(cfg, store.vocab_size)
    setup = build(cfg)
    _prepare_run_dir(cfg, run_dir)
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
        state, data_state, _ = ckpt.restore(
            abstract_with_shardings(setup.abstract_state, setup.state_shardings)
        )
        data_it.set_state(data_state)
        say(f"resumed from step {int(state['step'])} in {ckpt.directory}")
    else:
        state = init_state(setup)

    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.data.seq_len
    flops_per_step = flops_per_token(cfg.model, cfg.data.seq_len) * tokens_per_step
    # Per device; on CPU the host's measured matmul peak split over its (possibly emulated) devices.
    peak = peak_flops_per_device(jax.devices()[0], cfg.model.dtype, cfg.peak_tflops or None)
    profiler = ProfileWindow(cfg.profile_steps or None, run_dir / "tb")
    say(
        f"model {count_params(state['params']) / 1e6:.2f}M params | vocab {cfg.model.vocab_size} "
        f"({tokenizer.identity}) | mesh {dict(setup.mesh.shape)} | {jax.process_count()} process(es) | "
        f"{tokens_per_step} tokens/step | train {store.meta['splits']['train']['tokens']:,} tokens, "
        f"val {store.meta['splits']['val']['tokens']:,}"
    )
    schedule_end = getattr(cfg.schedule, "total_steps", None) or getattr(cfg.schedule, "decay_steps", None)
    if schedule_end is not None and schedule_end < cfg.steps:
        say(
            f"warning: the learning-rate schedule ends at step {schedule_end} but the run is {cfg.steps} steps; "
            "the rest runs at its final rate (set --schedule.total-steps or --schedule.decay-steps)"
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
        writer.write(step, "val", {**result, "elapsed_s": train_time()})
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

    pending: list[tuple[int, dict]] = []  # per-step metrics not yet checked on the host

    def check_finite() -> None:
        """Stop before a NaN/Inf can reach a checkpoint: the last saved one stays the last good one."""
        for s, m in jax.device_get(pending):
            bad = [k for k in ("loss", "grad_norm") if not math.isfinite(float(m[k]))]
            if bad:
                raise FloatingPointError(
                    f"{' and '.join(bad)} became {float(m[bad[0]])} at step {s}; stopping. The last good "
                    f"checkpoint (step {ckpt.latest_step()}) is kept in {ckpt.directory}"
                )

    step = int(state["step"])
    t_start = t_window = time.time()
    paused = 0.0  # seconds spent evaluating and saving, left out of the training time

    def train_time() -> float:
        """Seconds of training so far in this session (compilation included, evaluation and saving not)."""
        return time.time() - t_start - paused

    window_start = step
    val: dict[str, float] | None = None
    try:
        with sharding.set_mesh(setup.mesh), StopRequest() as stop:
            while step < cfg.steps:
                state, metrics = profiler.run(step, lambda s=state: train_step(s, next_batch()))
                step += 1
                pending.append((step, metrics))
                log_now = step % cfg.log_every == 0 or step == cfg.steps
                out_of_time = bool(cfg.max_time) and train_time() > cfg.max_time
                stopping = (log_now or jax.process_count() == 1) and stop.agreed()
                if log_now:
                    check_finite()
                    m = jax.device_get(pending[-1][1])
                    n = step - window_start
                    losses = [float(x["loss"]) for _, x in jax.device_get(pending)]
                    dt = time.time() - t_window
                    record = {
                        "loss": float(np.mean(losses)),
                        "lr": float(m["lr"]),
                        "grad_norm": float(m["grad_norm"]),
                        "tokens_per_s": n * tokens_per_step / dt,
                        "tflops": n * flops_per_step / dt / 1e12,
                        "elapsed_s": train_time(),
                    }
                    utilisation = mfu(n * flops_per_step, dt, jax.device_count(), peak)
                    if utilisation is not None:
                        record["mfu"] = utilisation
                    writer.write(step, "train", record)
                    say(
                        f"step {step:6d}/{cfg.steps} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                        f"grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
                        + (f"MFU {record['mfu']:.1%} | " if "mfu" in record else "")
                        + f"ETA {_fmt_time((cfg.steps - step) * dt / n)}"
                    )
                    pending.clear()
                    t_window, window_start = time.time(), step
                final = step == cfg.steps or out_of_time or stopping
                evaluated = step % cfg.eval_every == 0 or final
                saving = step % cfg.ckpt_every == 0 or final
                if evaluated or saving:  # steps run asynchronously: finish them before timing the pause
                    jax.block_until_ready(state)
                t_pause = time.time()
                if evaluated:
                    check_finite()
                    val = run_eval(step)
                if saving:
                    check_finite()
                    meta = {"tokenizer": tokenizer.identity, "step": step, "val": val if evaluated else None}
                    ckpt.save(
                        step, state, data_it.get_state(), meta, val["loss"] if evaluated and val else None
                    )
                paused += time.time() - t_pause
                t_window += time.time() - t_pause
                if stopping:
                    say(
                        f"stopped by {stop.signal_name or 'another process'} at step {step}; checkpoint saved"
                    )
                    break
                if out_of_time:
                    say(f"stopping at step {step}: max_time {cfg.max_time:.0f}s reached")
                    break
            if val is None:  # resumed a finished run: nothing trained, still report where it stands
                val = run_eval(step)
    finally:  # in-flight saves complete even when the run stops on an error: the newest checkpoint stays good
        profiler.close()
        ckpt.close()
        writer.close()
        if is_main:
            plot_losses(run_dir)
    if profiler.traced_steps:
        say(
            f"profiled steps {profiler.traced_steps[0]}..{profiler.traced_steps[-1]} into {run_dir / 'tb'}: "
            f"tensorboard --logdir={run_dir / 'tb'} (tensorboard-plugin-profile) or xprof --logdir={run_dir / 'tb'}"
        )
    say(
        f"done: step {step} in {_fmt_time(time.time() - t_start)} | val bits/byte {val['bpb']:.4f} | {run_dir}"
    )
    return {**val, "step": step}


def load_model(path: str | Path, devices: list | None = None) -> tuple[Setup, Any, Any, int]:
    """(setup, params, tokenizer, step) of a run directory (newest checkpoint) or of an export file."""
    from minigpt.tokenizer import load_tokenizer

    path = Path(path)
    if path.is_file():
        config, tok_dir = export_config_and_tokenizer(path)
        cfg = from_dict(config)
    elif (path / "config.json").is_file():
        cfg, tok_dir = load_json(str(path / "config.json")), path / "tokenizer"
    else:
        raise ConfigError(
            f"{path} is neither a run directory (no config.json) nor an export; train with `minigpt train`"
        )
    n_devices = len(devices if devices is not None else jax.devices())
    # Inference uses all devices for data parallelism; any batch that fits does.
    cfg = dataclasses.replace(
        cfg,
        mesh=dataclasses.replace(cfg.mesh, data=-1, fsdp=1, tensor=1),
        batch_size=math.lcm(cfg.batch_size, n_devices),
    )
    setup = build(cfg, devices)
    if path.is_file():
        params = read_export(
            path, abstract_with_shardings(setup.abstract_state, setup.state_shardings)["params"]
        )
        step = int(config.get("step", 0))
    else:
        ckpt = Checkpointer(path, keep=cfg.keep_checkpoints)
        state, _, _ = ckpt.restore(abstract_with_shardings(setup.abstract_state, setup.state_shardings))
        ckpt.close()
        params, step = state["params"], int(state["step"])
    return setup, params, load_tokenizer(tok_dir), step


def export(run_dir: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write the newest checkpoint's parameters, config and tokenizer to one file."""
    out = Path(out)
    if out.exists() and not overwrite:
        raise ConfigError(f"{out} exists; pass --overwrite to replace it")
    setup, params, _, step = load_model(run_dir)
    write_export(out, params, {**to_dict(setup.cfg), "step": step}, Path(run_dir) / "tokenizer")
    return out
