"""The training run: open (or resume) a run directory, then step until done, with periodic work as hooks.

    run, state, meta = open_run(cfg)     # data, tokenizer, run directory, state (fresh or restored)
    while progress.step < progress.end:  # --steps, or the length --max-time lays out once steps are timed
        state, metrics = train_step(state, next batch)
        for hook in hooks: if hook.due(progress): hook(progress)

The hooks (stopping, the time budget, logging, evaluation, a sample, a checkpoint) live in `hooks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp

from minigpt.app.hooks import (
    BudgetHook,
    CheckpointHook,
    Clock,
    EvalHook,
    Hook,
    LogHook,
    Progress,
    SampleHook,
    StepMetrics,
    StopHook,
    StopRequest,
    TasksHook,
    format_time,
    run_hook,
)
from minigpt.app.initial import ignored_flags, initial_state, with_initial
from minigpt.app.length import (
    describe_passes,
    epoch_steps,
    longest,
    repeats,
    run_tokens,
    say_finished,
    say_short,
)
from minigpt.app.startup import StartupHook, timed
from minigpt.config import ConfigError, TrainConfig, config_changes, load_json, save_json
from minigpt.data.loader import eval_batches, restore_position, train_iterator
from minigpt.data.mixture import Corpus, prepare_corpus
from minigpt.data.tokenizer import Tokenizer, dummy_tables
from minigpt.inference.evaluate import import_harness
from minigpt.nn import lora
from minigpt.parallel import distributed, sharding
from minigpt.parallel.distributed import is_main, say
from minigpt.runtime import compile_process
from minigpt.runtime.files import RunDirLock
from minigpt.training import hardware
from minigpt.training.checkpoint import Checkpointer, nothing_to_resume, restore_base, save_base, set_aside
from minigpt.training.memory import refuse_what_cannot_fit, resolve_grad_accum
from minigpt.training.metrics import WANDB_MISSING, MetricsWriter, plot_losses, preload_plotting
from minigpt.training.profiling import ProfileWindow
from minigpt.training.runs import (
    DATA_FILE,
    check_data,
    check_sources,
    check_tokenizer,
    record_data,
    recorded_extent,
    trained_tokenizer,
)
from minigpt.training.trainer import (
    Setup,
    TrainState,
    build,
    cpu_layout,
    init_state,
    kept,
    make_eval_step,
    make_run_mesh,
    make_train_step,
    resolve_model,
    resolve_weight_decay,
    split_cpu,
    trained,
    with_base,
)

RUN_FILES = (
    "checkpoints",
    "base",
    "tb",
    "metrics.jsonl",
    "samples.txt",
    "loss.png",
    "config.json",
    "evals",
    DATA_FILE,
)
"""What a run writes in its directory, and what --overwrite clears (the tokenizer is rewritten)."""


def _resumes(cfg: TrainConfig, run_dir: Path) -> bool:
    ckpts = run_dir / "checkpoints"
    return not cfg.overwrite and ckpts.is_dir() and any(ckpts.iterdir())


def _saved_config(run_dir: Path) -> TrainConfig | None:
    saved = run_dir / "config.json"
    if not saved.is_file():
        return None
    old = load_json(str(saved))
    return dataclasses.replace(old, data=old.data.absolute())


def _another_run(run_dir: Path, changes: list[str]) -> ConfigError:
    data = any(c.startswith(("data.paths", "data.val_paths")) for c in changes)
    return ConfigError(
        f"{run_dir} holds another run{' on other data' * data}, with a different config ({'; '.join(changes)}); "
        "choose another --run-dir for this one, pass --overwrite to start that one again, or resume it unchanged"
    )


def check_same_data(cfg: TrainConfig, run_dir: Path) -> None:
    """Before any tokenizing: other data in a run directory (the default runs/cpu, reused with --data) is
    another run, which is what to say, rather than what differs once that data is tokenized."""
    old = _saved_config(run_dir) if _resumes(cfg, run_dir) else None
    changes = [
        f"data.{name}: {getattr(old.data, name)!r} -> {getattr(cfg.data, name)!r}"
        for name in ("paths", "val_paths")
        if old is not None and getattr(old.data, name) != getattr(cfg.data, name)
    ]
    if changes:
        raise _another_run(run_dir, changes)


def check_resumable(cfg: TrainConfig, run_dir: Path, corpus: Corpus, tokenizer: Tokenizer) -> None:
    """Refuse to resume a run with another config, tokenizer or data; nothing in the run is touched."""
    if not _resumes(cfg, run_dir):
        return
    old = _saved_config(run_dir)
    if old is not None:
        # Saved before the end-of-text token was recorded: the tokenizer's, checked below.
        if old.model.eot_id == -1:
            old = dataclasses.replace(old, model=dataclasses.replace(old.model, eot_id=cfg.model.eot_id))
        if changes := config_changes(old, cfg):
            raise _another_run(run_dir, changes)
    check_tokenizer(run_dir / "tokenizer", tokenizer.identity, trained_tokenizer(run_dir))
    check_data(run_dir, corpus)


def clear_run_dir(run_dir: Path) -> None:
    """--overwrite: called only once the whole command has been validated."""
    for name in RUN_FILES:
        path = run_dir / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


@dataclasses.dataclass
class Run:
    """An opened run: its config (vocabulary resolved), structure, data and where it writes."""

    cfg: TrainConfig
    setup: Setup
    corpus: Corpus
    tokenizer: Tokenizer
    ckpt: Checkpointer
    data_it: grain.DatasetIterator
    writer: MetricsWriter
    task_manager: Any = None
    """lm-eval's task registry when --eval-tasks names tasks."""
    repeats_after: int | None = None
    """The step after which the run reads again windows of a store built for a shorter run (see `repeats`)."""
    epoch: int | None = None
    """Steps of one pass over the training text (see `epoch_steps`); None for a store built for a shorter run."""
    startup: dict[str, float] = dataclasses.field(default_factory=dict)
    """Seconds of startup's stages so far (`timed`), which the first step's line itemises."""

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.run_dir)


def task_manager(cfg: TrainConfig) -> Any:
    """lm-eval's task registry for --eval-tasks, its task names checked before any work; None without tasks.
    lm-eval is an optional dependency, imported only when tasks are named."""
    if not cfg.eval_tasks:
        return None
    return import_harness("--eval-tasks").task_manager(cfg.eval_tasks, cfg.eval_tasks_include_path)


def open_run(cfg: TrainConfig) -> tuple[Run, TrainState, dict]:
    """Tokenize (once) and validate everything the run needs; only then clear (--overwrite) or resume the run
    directory: the newest checkpoint with its data position and metadata, or a fresh state (and empty
    metadata). Its config, tokenizer and data identity are written last."""
    cfg = dataclasses.replace(cfg, data=cfg.data.absolute())
    run_dir = Path(cfg.run_dir)
    tasks = _check_before_data(cfg, run_dir)
    extent = None if cfg.overwrite else recorded_extent(run_dir)  # resumed: the stores' extent it read
    phases: dict[str, float] = {}

    def sized() -> int | None:
        with timed(phases, "sizing the budget"):
            return run_tokens(cfg)

    tokens = functools.cache(sized) if extent is None else None  # only if tokenizing
    with timed(phases, "data"):
        corpus = distributed.main_first(lambda: prepare_corpus(cfg.data, tokens, extent or None))
    phases["data"] -= phases.get("sizing the budget", 0.0)  # timed within it
    tokenizer = corpus.tokenizer()
    cfg = resolve_model(cfg, corpus.vocab_size, tokenizer.eot_id)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, examples=corpus.examples))
    epoch = epoch_steps(cfg, corpus)
    cfg = resolve_weight_decay(cfg, epoch)
    cfg = dataclasses.replace(cfg, sample_prompt=cfg.sample_prompt or corpus.opening("val"))
    with timed(phases, "model"):
        setup = build(cfg)
    with timed(phases, "data"):
        data_it = _train_iterator(cfg, corpus)  # refuses a training split smaller than one batch
        for part in corpus.parts:
            next(
                eval_batches(
                    part.store, cfg.data.seq_len, cfg.batch_size, jax.process_index(), jax.process_count()
                )
            )
    check_resumable(cfg, run_dir, corpus, tokenizer)
    if cfg.overwrite and is_main():
        clear_run_dir(run_dir)
    ckpt = Checkpointer(run_dir, keep=cfg.keep_checkpoints)
    with timed(phases, "model"):
        state, meta = _start_state(cfg, setup, ckpt, data_it)
    if is_main():
        save_json(cfg, str(run_dir / "config.json"))
        tokenizer.save(run_dir / "tokenizer")
        record_data(run_dir, corpus)
    writer = MetricsWriter(run_dir, enabled=is_main(), config=cfg, resumed=ckpt.latest_step() is not None)
    run = Run(
        cfg, setup, corpus, tokenizer, ckpt, data_it, writer, tasks, repeats(cfg, corpus), epoch, phases
    )
    return run, state, meta


def _check_before_data(cfg: TrainConfig, run_dir: Path) -> Any:
    """Refuse what would fail later before spending time on data; lm-eval's task registry where tasks are
    named."""
    make_run_mesh(cfg)  # a bad mesh or batch
    if cfg.model.lora.rank and not cfg.init_from:
        raise ConfigError(
            "--lora.rank trains adapters on a trained model: name it with --init-from FOLDER or RUN"
        )
    tasks = task_manager(cfg)
    if cfg.wandb.enabled and is_main() and importlib.util.find_spec("wandb") is None:
        raise ConfigError(WANDB_MISSING)
    if not cfg.overwrite:
        check_sources(run_dir, cfg.data)  # a resumed run's files or sources changed: refuse before tokenizing
        check_same_data(cfg, run_dir)
    return tasks


def _start_state(
    cfg: TrainConfig, setup: Setup, ckpt: Checkpointer, data_it: grain.DatasetIterator
) -> tuple[TrainState, dict]:
    """The newest checkpoint's state and metadata, else a fresh (or --init-from) state and no metadata."""
    if ckpt.latest_step() is not None:
        state, meta = restore_state(setup, ckpt, data_it)
        say(f"resumed from step {int(state.step)} in {ckpt.directory}")
        return state, meta
    run_dir = Path(cfg.run_dir)
    if not cfg.overwrite and set_aside(run_dir):
        raise nothing_to_resume(run_dir)  # step 0 again would repeat (and log twice) the steps trained
    state = initial_state(setup) if cfg.init_from else init_state(setup)
    if cfg.init_from:
        say(f"starting from the weights of {cfg.init_from}")
    if (base := trained(state.params)[1]) is not None:
        save_base(run_dir, base)
    return state, {}


def restore_state(
    setup: Setup, ckpt: Checkpointer, data_it: grain.DatasetIterator
) -> tuple[TrainState, dict]:
    """The newest checkpoint's state and metadata, a LoRA run's base put back, the data position restored. A
    weight average is read where the checkpoint holds one (`TrainState.restored` keeps it if the run does)."""
    target = kept(setup.abstract_state).saved()
    optional = {"average": target.pop("average", target["params"])}
    saved, data_state, meta = ckpt.restore(target, optional=optional)
    state = TrainState.restored(saved, average=bool(setup.cfg.average_weights))
    base = trained(setup.abstract_state.params)[1]
    state = with_base(state, None if base is None else restore_base(ckpt.directory.parent, base))
    restore_position(data_it, data_state)
    return state, meta


def _train_iterator(cfg: TrainConfig, corpus: Corpus) -> grain.DatasetIterator:
    local_batch = cfg.batch_size // jax.process_count()
    return train_iterator(
        [part.store for part in corpus.parts],
        cfg.data.seq_len,
        local_batch * cfg.grad_accum,
        cfg.seed,
        jax.process_index(),
        jax.process_count(),
        weights=[part.weight for part in corpus.parts],
        window_start=cfg.data.window_start,
    )


def describe(run: Run, state: TrainState) -> None:
    cfg, corpus = run.cfg, run.corpus
    train, val = corpus.split_totals("train"), corpus.split_totals("val")
    dtype, why = hardware.compute_dtype(cfg.model.dtype, jax.default_backend())
    say(f"compute dtype {dtype} ({why})")
    adapters, total = lora.size(state.params)
    trains = f" (LoRA: {adapters / 1e6:.3g}M of them train)" if adapters else ""
    say(
        f"model {total / 1e6:.2f}M params{trains} | vocab {cfg.model.vocab_size} "
        f"({run.tokenizer.identity}) | mesh {dict(run.setup.mesh.shape)} | {jax.process_count()} process(es) | "
        f"{cfg.tokens_per_step} tokens/step | train {train['tokens']:,} tokens, val {val['tokens']:,}"
    )
    for part in corpus.parts if corpus.is_mixture else ():
        tokens = part.store.meta["splits"]["train"]["tokens"]
        say(f"  source {part.name}: weight {part.weight:.3g}, train {tokens:,} tokens")
    single = [
        p.name or "the corpus" for p in corpus.parts if p.store.meta["splits"]["train"]["documents"] < 2
    ]
    if cfg.model.document_attention and single:
        say(
            f"warning: --model.document-attention masks nothing: the training text of {', '.join(single)} is one "
            "document (no <|endoftext|> inside it); to split it, pass --data.separator blank-line"
        )
    describe_passes(cfg, run.epoch)
    if cfg.average_weights:
        say(
            f"averaging the weights of the last {cfg.average_weights:.0%} of the steps (--average-weights): the run "
            "ends with the average where it evaluates better than the last weights"
        )
    schedule_end = cfg.schedule.ends_at(cfg.steps)
    if schedule_end is not None and schedule_end < cfg.steps:
        say(
            f"warning: the learning-rate schedule ends at step {schedule_end} but the run is {cfg.steps} steps; "
            "the rest runs at its final rate (set its length to 0 to follow the run's)"
        )
    if cfg.max_time and schedule_end is not None and schedule_end != cfg.steps:
        say(
            f"warning: --max-time lays out the run's length, but the schedule has its own ({schedule_end} steps); "
            "set its length to 0 to end it with the budget"
        )


@dataclasses.dataclass(frozen=True)
class Steps:
    """The run's train step compiled ahead of time for its batch, and its eval step (jitted, its program
    compiled for the evaluation batch already), so the time budget's clock never counts compiling."""

    train: Any
    eval: Any


def compile_steps(run: Run, state: TrainState) -> Steps:
    """Compile the train and eval steps before the clock starts, and say how long that took."""
    cfg, setup = run.cfg, run.setup
    say("compiling the train and eval steps ...")
    started = time.perf_counter()
    rows = (cfg.batch_size, cfg.data.seq_len + 1)
    batch = jax.ShapeDtypeStruct(
        (cfg.grad_accum, *rows), jnp.int32, sharding=sharding.batch_sharding(setup.mesh, micro_batches=True)
    )
    train = make_train_step(setup).lower(state, batch, cfg.steps).compile()
    eval_step = make_eval_step(
        setup, run.tokenizer.token_bytes(), dummy_tables(run.tokenizer, setup.cfg.data.examples)
    )
    by_rows = sharding.batch_sharding(setup.mesh)
    tokens = jax.ShapeDtypeStruct(rows, jnp.int32, sharding=by_rows)
    weight = jax.ShapeDtypeStruct(rows[:1], jnp.float32, sharding=by_rows)
    eval_step.lower(state.params, tokens, weight).compile()  # the jitted step's calls find it compiled
    run.startup["compiling"] = time.perf_counter() - started
    say(f"compiled the train and eval steps in {run.startup['compiling']:.1f} s")
    return Steps(train, eval_step)


def make_hooks(
    run: Run, step: int, clock: Clock, stop: StopRequest, metrics: StepMetrics, eval_step: Any
) -> list[Hook]:
    """The periodic work of a training run, in the order it runs after a step."""
    cfg, setup = run.cfg, run.setup
    peak = hardware.peak(jax.devices()[0], cfg.peak_tflops or None)
    if peak is not None:
        say(f"MFU against {peak.flops / 1e12:.3g} TFLOP/s per device: {peak.source}")
    return [
        StartupHook(phases=run.startup),
        *([BudgetHook(clock, cfg.max_time, longest(cfg, run.epoch), cfg.schedule)] if cfg.max_time else []),
        StopHook(cfg.log_every if jax.process_count() > 1 else 1, stop, clock, cfg.max_time),
        LogHook(cfg.log_every, cfg, metrics, clock, run.writer, peak, last_step=step),
        EvalHook(cfg.eval_every, setup, run.corpus, eval_step, metrics, clock, run.writer, run.epoch),
        *(
            [TasksHook(cfg.eval_tasks_every, setup, run.tokenizer, run.task_manager, run.writer, clock)]
            if cfg.eval_tasks
            else []
        ),
        *([SampleHook(cfg.eval_every, setup, run.tokenizer, run.run_dir)] if cfg.sample_tokens else []),
        CheckpointHook(cfg.ckpt_every, run.ckpt, run.data_it, metrics, run.tokenizer.identity, clock),
    ]


def next_batch(run: Run) -> jax.Array:
    """The next (grad_accum, batch, seq_len + 1) global batch; each process reads only its own rows."""
    cfg = run.cfg
    local = next(run.data_it).reshape(cfg.grad_accum, -1, cfg.data.seq_len + 1)
    return sharding.global_batch(run.setup.mesh, local, micro_batches=True)


def loop(
    run: Run, p: Progress, hooks: list[Hook], clock: Clock, metrics: StepMetrics, train_step: Any
) -> None:
    """Step until the run's length or an agreed stop, running the hooks after each step."""
    cfg = run.cfg
    with ProfileWindow(cfg.profile_window, run.run_dir / "tb") as profiler:
        while p.step < p.end:
            p.state, step_metrics = profiler.run(p.step, train_step, p.state, next_batch(run), p.end)
            p.step += 1
            if p.step == run.repeats_after:
                say(
                    f"step {p.step}: the run has read the tokens tokenized for it and now reads them again; "
                    "`minigpt prepare` with the same --data flags first tokenizes the whole corpus"
                )
            metrics.add(p.step, step_metrics)
            p.final = p.step == p.end
            for hook in hooks:
                if hook.due(p):
                    run_hook(hook, p, clock)
            if p.stop_message:
                say(p.stop_message)
                break
    if profiler.traced_steps:
        tb = run.run_dir / "tb"
        say(
            f"profiled steps {profiler.traced_steps[0]}..{profiler.traced_steps[-1]} into {tb}: "
            f"tensorboard --logdir={tb} (tensorboard-plugin-profile) or xprof --logdir={tb}"
        )


def train(cfg: TrainConfig, on_accelerator: Callable[[], TrainConfig] | None = None) -> dict[str, Any]:
    """Run (or resume) training in cfg.run_dir. Returns the final validation metrics and step. Where JAX finds
    a TPU or GPU, `on_accelerator` (`minigpt train` without a preset) gives the config to train instead."""
    multi_process = distributed.initialize(cfg.dist)
    if (devices := split_cpu(cfg, multi_process)) > 1:
        cfg = cpu_layout(cfg, devices)
        fsdp = cfg.mesh.fsdp == -1  # the default layout: the mesh line shows it as {'data': 1, 'fsdp': N}
        how = f", FSDP over them (--mesh.data {devices} trains data parallel instead)" if fsdp else ""
        say(f"the CPU split into {devices} XLA devices{how}; --mesh.cpu-devices 1 keeps one")
    elif on_accelerator is not None and jax.default_backend() != "cpu":
        cfg = on_accelerator()
        say(
            f"no --preset: training the accelerator preset on this {jax.devices()[0].device_kind} "
            "(--preset cpu for the CPU's model)"
        )
    compile_process.use()
    if multi_process:
        distributed.check_process_counts(cfg.dist)
        distributed.check_same_config(cfg)
    with RunDirLock(cfg.run_dir) if is_main() else contextlib.nullcontext():
        return _train(cfg)


def progress(cfg: TrainConfig, state: TrainState, meta: dict, cap: int) -> Progress:
    """Where a (resumed) run starts: its length is the longest it may be (`longest`), or the one a time budget
    laid out before, kept (with the training time already spent) so the resumed run follows the same
    schedule."""
    budgeted = bool(cfg.max_time) and meta.get("run_steps") is not None
    end = min(cap, meta["run_steps"]) if budgeted else cap
    spent = float(meta.get("train_time_s", 0.0)) if cfg.max_time else 0.0
    return Progress(step=int(state.step), state=state, end=end, budgeted=budgeted, spent_s=spent)


def _train(cfg: TrainConfig) -> dict[str, Any]:
    asked, cfg = (
        cfg.model,
        with_initial(cfg),
    )  # --init-from: the source's model and tokenizer, before any check
    if ignored := ignored_flags(asked, cfg.model):  # none without --init-from: the model is unchanged
        say(f"--init-from {cfg.init_from} decides the architecture; ignoring {', '.join(ignored)}")
    cfg = resolve_grad_accum(cfg, log=say)  # --grad-accum auto: the micro-batch that fits, as ints
    refuse_what_cannot_fit(cfg)
    run, state, meta = open_run(cfg)
    describe(run, state)
    p = progress(run.cfg, state, meta, longest(run.cfg, run.epoch))
    start_step = p.step
    if p.step >= p.end:
        say_finished(run.cfg, p)
    metrics = StepMetrics(run.ckpt)
    interrupted = False
    try:
        with sharding.set_mesh(run.setup.mesh), StopRequest(at_once=jax.process_count() == 1) as stop:
            if is_main():
                preload_plotting()  # drawn at the end
            steps = compile_steps(run, p.state)
            clock = Clock()  # training time starts once the steps are compiled
            hooks = make_hooks(run, p.step, clock, stop, metrics, steps.eval)
            loop(run, p, hooks, clock, metrics, steps.train)
            if p.val is None and not p.signalled:  # resumed a finished run: still report where it stands
                for hook in hooks:
                    if isinstance(hook, EvalHook | SampleHook):
                        run_hook(hook, p, clock)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:  # in-flight saves complete even when the run stops on an error: the newest checkpoint stays good
        run.ckpt.close()
        run.writer.close()
        if is_main() and not (interrupted or p.signalled):  # stopping: the next session draws it
            plot_losses(run.run_dir)
    if p.signalled:
        say(f"the same command resumes it from step {p.step} | {run.run_dir}")
        return {**(p.val or {}), "step": p.step}
    say(
        f"done: step {p.step} in {format_time(clock.wall_time())} | val bits/byte {p.val['bpb']:.4f} | "
        f"{run.run_dir}"
    )
    say_short(run.cfg, p, start_step)
    return {**p.val, "step": p.step}
