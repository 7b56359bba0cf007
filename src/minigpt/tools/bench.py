"""Benchmark and profile the training step: step time, tokens/s and MFU across batch sizes and mesh layouts.

`minigpt bench` sweeps batch sizes x `data x fsdp x tensor` layouts of the devices, training on random
tokens (no corpus needed) with the real `build` / `init_state` / `make_train_step`, and writes a Markdown
table, CSV, JSON and plots. A point that cannot run (indivisible shapes, out of memory, an XLA error) becomes
a row with the reason. `minigpt profile` writes a `jax.profiler` trace of a few steps where TensorBoard's
profile plugin and XProf find it (through `profiling.ProfileWindow`, as a training run's --profile-steps).

FLOPs and peak figures follow the convention in `metrics.py`.
"""

from __future__ import annotations

import csv
import dataclasses
import gc
import math
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import jax

from minigpt.config import ConfigError, MeshConfig, TrainConfig, to_dict
from minigpt.nn.model import abstract_model, count_params
from minigpt.parallel import sharding
from minigpt.runtime import compile_process, files
from minigpt.training import hardware
from minigpt.training.memory import resolve_grad_accum
from minigpt.training.metrics import flops_per_step
from minigpt.training.profiling import ProfileWindow, collective_share, open_command, trace_files
from minigpt.training.trainer import Setup, build, init_state, make_train_step, random_batch

T = TypeVar("T")
Layout = tuple[int, int, int]

GPT2_VOCAB = 50257


# --------------------------------------------------------------------------------------------- set-up


def bench_config(cfg: TrainConfig, vocab_size: int | None = None) -> TrainConfig:
    """The config with a concrete vocabulary, since no tokenizer is read: `vocab_size`, else the model's own,
    else the tokenizer's size (the BPE's `data.bpe_vocab_size`, 4096 in the cpu preset; GPT-2's 50257)."""
    if vocab_size is None:
        if cfg.model.vocab_size:
            vocab_size = cfg.model.vocab_size
        else:
            vocab_size = cfg.data.bpe_vocab_size if cfg.data.tokenizer == "bpe" else GPT2_VOCAB
    if vocab_size <= 0:
        raise ConfigError(f"--vocab-size must be positive, got {vocab_size}")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab_size))


def all_layouts(n_devices: int) -> list[Layout]:
    """Every (data, fsdp, tensor) whose product is n_devices, data-parallel-heavy first."""
    return sorted(
        ((d, f, n_devices // (d * f)) for d in range(1, n_devices + 1) for f in range(1, n_devices + 1)
         if n_devices % (d * f) == 0),
        reverse=True,
    )  # fmt: skip


def parse_layout(text: str) -> Layout:
    """'4x1x2' -> (4, 1, 2): data x fsdp x tensor."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"layout {text!r} must be DATAxFSDPxTENSOR with positive sizes, e.g. 4x1x2")
    return int(parts[0]), int(parts[1]), int(parts[2])


def layout_name(layout: Layout) -> str:
    return "x".join(map(str, layout))


def with_layout(cfg: TrainConfig, layout: Layout, batch_size: int | None = None) -> TrainConfig:
    d, f, t = layout
    mesh = MeshConfig(data=d, fsdp=f, tensor=t, fsdp_min_mbytes=cfg.mesh.fsdp_min_mbytes)
    return dataclasses.replace(cfg, mesh=mesh, batch_size=batch_size or cfg.batch_size)


def describe_error(e: BaseException) -> str:
    """One line for a point that failed: the config mistake, out of memory, or the XLA error's first line."""
    if isinstance(e, ConfigError):
        return str(e)
    text = str(e).strip()
    first = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
    if re.search(r"RESOURCE_EXHAUSTED|out of memory|\bOOM\b", text, re.IGNORECASE):
        return f"out of memory: {first}"[:300]
    return f"{type(e).__name__}: {first}"[:300]


def _peak_memory_bytes(devices: Iterable[Any]) -> int | None:
    """The largest `peak_bytes_in_use` of the devices, where the backend reports it (not on CPU)."""
    peaks = []
    for device in devices:
        try:
            stats = device.memory_stats()
        except Exception:
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) if peaks else None


def _compiled_memory_bytes(compiled: Any) -> int | None:
    """Per-device bytes the compiled step needs by XLA's own analysis: arguments + outputs - donated + temps."""
    try:
        m = compiled.memory_analysis()
        m = m[0] if isinstance(m, list | tuple) else m
        return int(
            m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes
        )
    except Exception:
        return None


# --------------------------------------------------------------------------------------------- one point


@dataclasses.dataclass
class Point:
    """One benchmark measurement; `error` set (and the timings None) when the point could not run."""

    layout: str
    batch_size: int
    devices: int
    tokens_per_step: int
    error: str | None = None
    compile_s: float | None = None
    step_ms: float | None = None
    step_ms_min: float | None = None
    tokens_per_s: float | None = None
    ms_per_sample: float | None = None
    tflops: float | None = None
    """Achieved model TFLOP/s, all devices together."""
    mfu: float | None = None
    xla_mem_mib: float | None = None
    """Per-device memory XLA's compiled step needs (arguments + outputs - donated + temporaries)."""
    peak_mem_mib: float | None = None
    """The devices' `peak_bytes_in_use` (backends that report it; a process-wide high-water mark)."""
    collectives: float | None = None
    """Share of step time the devices spent in collectives, from a profile of a few extra steps."""

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass
class CompiledStep:
    """A config's train step compiled ahead of time, with the state it updates and a batch of its shape: what
    every step-timing benchmark (`minigpt bench` and benchmarks/) builds, so they all time the same step."""

    setup: Setup
    state: Any
    batch: Any
    """Random tokens of the step's shape (timing does not depend on them)."""
    xla: Any
    """The `jax.stages.Compiled` step: its `memory_analysis()` is XLA's own view of the step's memory."""
    compile_s: float

    def __call__(self, batch: Any | None = None) -> dict[str, Any]:
        """One step on `batch` (default: the random one); updates `state` and returns the step's metrics."""
        self.state, metrics = self.xla(
            self.state, self.batch if batch is None else batch, self.setup.cfg.steps
        )
        return metrics

    @property
    def memory_bytes(self) -> int | None:
        return _compiled_memory_bytes(self.xla)


def compile_step(cfg: TrainConfig, devices: Sequence[Any] | None = None) -> CompiledStep:
    """Build `cfg` on `devices` (default: all), initialise its state in place and compile its train step for a
    random batch, timing the compilation alone."""
    setup = build(cfg, None if devices is None else list(devices))
    with sharding.set_mesh(setup.mesh):
        state = init_state(setup)
        batch = random_batch(setup, cfg.seed)
        t = time.perf_counter()
        xla = make_train_step(setup).lower(state, batch, cfg.steps).compile()
        compile_s = time.perf_counter() - t
    return CompiledStep(setup, state, batch, xla, compile_s)


def time_steps(
    step: CompiledStep, warmup: int, timed: int, next_batch: Callable[[], Any] | None = None
) -> tuple[list[float], dict[str, Any]]:
    """Seconds of each of `timed` steps after `warmup` untimed ones, each waited for, and the last metrics.
    `next_batch` (default: the step's random batch) is called inside the timed span, so a loader's cost counts."""
    metrics: dict[str, Any] = {}
    times = []
    for i in range(warmup + timed):
        t = time.perf_counter()
        metrics = step(None if next_batch is None else next_batch())
        jax.block_until_ready((step.state, metrics))
        if i >= warmup:
            times.append(time.perf_counter() - t)
    return times, metrics


def bench_point(
    cfg: TrainConfig,
    layout: Layout,
    batch_size: int,
    *,
    warmup_steps: int = 2,
    timed_steps: int = 5,
    peak_per_device: float | None = None,
    collectives: bool = True,
    devices: Sequence[Any] | None = None,
) -> Point:
    """Compile and time the train step of `cfg` on `layout` with `batch_size`: compile time, then the median of
    `timed_steps` steps (each waited for) after `warmup_steps`. Never raises for a point that cannot run."""
    n = math.prod(layout)
    run = with_layout(cfg, layout, batch_size)
    accum = 1 if run.grad_accum == "auto" else run.grad_accum
    point = Point(layout_name(layout), batch_size, n, batch_size * accum * run.data.seq_len)
    step = None
    try:
        all_devices = list(devices if devices is not None else jax.devices())
        if n > len(all_devices):
            raise ConfigError(f"layout {point.layout} needs {n} devices, there are {len(all_devices)}")
        run = resolve_grad_accum(run, all_devices[:n])  # --grad-accum auto: the micro-batch that fits
        step = compile_step(run, all_devices[:n])
        point.compile_s, point.xla_mem_mib = step.compile_s, _mib(step.memory_bytes)
        times, _ = time_steps(step, warmup_steps, timed_steps)
        if collectives:
            point.collectives = _profile_collectives(step, n)
        median = statistics.median(times)
        point.step_ms, point.step_ms_min = median * 1e3, min(times) * 1e3
        point.tokens_per_s = point.tokens_per_step / median
        point.ms_per_sample = median * 1e3 / (run.batch_size * run.grad_accum)
        flops = flops_per_step(run)
        point.tflops = flops / median / 1e12
        if peak_per_device:
            # Emulated CPU devices share the host's cores, so a layout on some of them still has all of them.
            cpu = all_devices[0].platform == "cpu"
            point.mfu = flops / median / ((len(all_devices) if cpu else n) * peak_per_device)
        point.peak_mem_mib = _mib(_peak_memory_bytes(step.setup.mesh.devices.flat))
    except Exception as e:  # a row with the reason, never a crash
        point.error = describe_error(e)
    finally:
        step = None  # free the point's buffers before the next one
        gc.collect()
    return point


def _profile_collectives(step: CompiledStep, n_devices: int, steps: int = 2) -> float | None:
    """Trace `steps` more steps into a scratch directory and measure their share of time in collectives."""
    if n_devices == 1:
        return 0.0
    with tempfile.TemporaryDirectory(prefix="minigpt-bench-") as tmp:
        with ProfileWindow((0, steps), tmp) as window:
            for i in range(steps):
                window.run(i, _waited, step)
        try:
            traces = trace_files(tmp)
            return (
                collective_share(jax.profiler.ProfileData.from_file(str(traces[-1])), n_devices)
                if traces
                else None
            )
        except Exception:  # an unreadable trace costs the column, not the point
            return None


def _waited(fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)`, returned only once its device work is done."""
    return jax.block_until_ready(fn(*args))


def _mib(nbytes: int | None) -> float | None:
    return None if nbytes is None else nbytes / 2**20


# --------------------------------------------------------------------------------------------- the sweep


def run_sweep(
    cfg: TrainConfig,
    batch_sizes: Sequence[int],
    layouts: Sequence[Layout] | None = None,
    *,
    warmup_steps: int = 2,
    timed_steps: int = 5,
    peak_tflops: float | None = None,
    collectives: bool = True,
    on_point: Callable[[Point], None] | None = None,
) -> tuple[list[Point], dict[str, Any]]:
    """Every layout x batch size (layouts default to all factorizations of the device count). Returns the
    points and a description of the run (devices, model, FLOPs per token, the peak used for MFU)."""
    if warmup_steps < 0 or timed_steps < 1:
        raise ConfigError("--warmup-steps must be >= 0 and --timed-steps >= 1")
    if not batch_sizes or any(b <= 0 for b in batch_sizes):
        raise ConfigError(f"--batch-sizes must be positive, got {list(batch_sizes)}")
    devices = jax.devices()
    layouts = list(layouts) if layouts else all_layouts(len(devices))
    found = hardware.peak(devices[0], peak_tflops)
    peak = None if found is None else found.flops
    dtype, why = hardware.compute_dtype(cfg.model.dtype, devices[0].platform)
    meta = {
        "device_kind": devices[0].device_kind,
        "platform": devices[0].platform,
        "devices": len(devices),
        "peak_tflops_per_device": None if peak is None else peak / 1e12,
        "peak_source": "unknown (pass --peak-tflops)" if found is None else found.source,
        "model_dtype": dtype,
        "dtype_reason": why,
        "seq_len": cfg.data.seq_len,
        "grad_accum": cfg.grad_accum,
        "train_flops_per_token": flops_per_step(dataclasses.replace(cfg, batch_size=1, grad_accum=1))
        / cfg.data.seq_len,
        "params": _param_count(cfg),
        "warmup_steps": warmup_steps,
        "timed_steps": timed_steps,
        "config": to_dict(cfg),
    }  # fmt: skip
    points = []
    for layout in layouts:
        for batch_size in batch_sizes:
            point = bench_point(
                cfg,
                layout,
                batch_size,
                warmup_steps=warmup_steps,
                timed_steps=timed_steps,
                peak_per_device=peak,
                collectives=collectives,
                devices=devices,
            )
            points.append(point)
            if on_point is not None:
                on_point(point)
        jax.clear_caches()
    return points, meta


def _param_count(cfg: TrainConfig) -> int:
    return count_params(abstract_model(cfg.model, cfg.seed)[1])


COLUMNS = (
    # (key, header, format)
    ("layout", "layout (data x fsdp x tensor)", "{}"),
    ("batch_size", "batch", "{}"),
    ("compile_s", "compile s", "{:.1f}"),
    ("step_ms", "step ms (median)", "{:.1f}"),
    ("tokens_per_s", "tokens/s", "{:,.0f}"),
    ("ms_per_sample", "ms/sample", "{:.2f}"),
    ("tflops", "TFLOP/s", "{:.3f}"),
    ("mfu", "MFU", "{:.1%}"),
    ("xla_mem_mib", "XLA mem/device MiB", "{:.1f}"),
    ("peak_mem_mib", "peak mem MiB", "{:.1f}"),
    ("collectives", "collectives", "{:.1%}"),
)


def _cell(point: Point, key: str, fmt: str) -> str:
    value = getattr(point, key)
    if value is None:
        return "n/a" if key == "collectives" and point.ok else ""
    return fmt.format(value)


def markdown_table(points: Sequence[Point]) -> str:
    header = [h for _, h, _ in COLUMNS] + ["note"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for p in points:
        cells = [_cell(p, k, f) for k, _, f in COLUMNS] + [
            ("failed: " + p.error.replace("|", "/")) if p.error else ""
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _record(point: Point) -> dict[str, Any]:
    return {**dataclasses.asdict(point), "status": "ok" if point.ok else "failed"}


def write_results(points: Sequence[Point], meta: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """bench.csv, bench.json (meta + points), bench.md, and the two plots, into out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    records = [_record(p) for p in points]
    paths = {"csv": out / "bench.csv", "json": out / "bench.json", "md": out / "bench.md"}
    with files.atomic_open(paths["csv"], "w") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]) if records else ["layout"])
        writer.writeheader()
        writer.writerows(records)
    files.write_json(paths["json"], {"meta": meta, "points": records})
    files.write_text(paths["md"], markdown_table(points) + "\n")
    paths |= plot_sweep(points, out, title=_title(meta))
    return paths


def _title(meta: dict[str, Any]) -> str:
    return (
        f"{meta.get('params', 0) / 1e6:.3g}M params, seq {meta.get('seq_len')}, {meta.get('model_dtype')} | "
        f"{meta.get('devices')} x {meta.get('device_kind')}"
    )


def plot_sweep(points: Sequence[Point], out_dir: str | Path, title: str = "") -> dict[str, Path]:
    """tokens_per_s.png and mfu.png: against batch size, one line per layout (points that ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    paths = {}
    for key, label, name in (("tokens_per_s", "tokens/s", "tokens_per_s"), ("mfu", "MFU (%)", "mfu")):
        fig, ax = plt.subplots(figsize=(8.5, 4.5))
        layouts = list(dict.fromkeys(p.layout for p in points))
        drawn = 0
        for layout in layouts:
            xy = [
                (p.batch_size, getattr(p, key))
                for p in points
                if p.layout == layout and getattr(p, key) is not None
            ]
            if xy:
                xs, ys = zip(*sorted(xy), strict=True)
                ax.plot(xs, [y * 100 for y in ys] if key == "mfu" else ys, "o-", label=layout)
                drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, f"no {label} to show", ha="center", va="center", transform=ax.transAxes)
        else:
            ax.legend(title="data x fsdp x tensor", fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        failed = [layout for layout in layouts if not any(p.ok for p in points if p.layout == layout)]
        if failed:
            ax.text(
                0.01, 0.01, f"failed (see table): {', '.join(failed)}", fontsize=7, transform=ax.transAxes
            )
        ax.set_xscale("log", base=2)
        sizes = sorted({p.batch_size for p in points})
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.minorticks_off()
        ax.set_xlabel("global batch size (sequences)")
        ax.set_ylabel(label)
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        paths[name] = out / f"{name}.png"
        with files.atomic_open(paths[name], "wb") as f:
            fig.savefig(f, format="png", dpi=110)
        plt.close(fig)
    return paths


def bench(
    cfg: TrainConfig,
    batch_sizes: Sequence[int],
    layouts: Sequence[str] = (),
    *,
    out_dir: str | Path = "runs/bench",
    warmup_steps: int = 2,
    timed_steps: int = 5,
    vocab_size: int | None = None,
    peak_tflops: float | None = None,
    collectives: bool = True,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr, flush=True),
) -> tuple[list[Point], dict[str, Path]]:
    """`minigpt bench`: the sweep, a line per point as it finishes, then the table on stdout and files."""
    compile_process.use()
    cfg = bench_config(cfg, vocab_size)
    parsed = [parse_layout(s) for s in layouts]

    def progress(p: Point) -> None:
        if p.ok:
            mfu = "" if p.mfu is None else f" | MFU {p.mfu:.1%}"
            log(f"{p.layout:>8} batch {p.batch_size:5d} | compile {p.compile_s:.1f}s | step {p.step_ms:.1f} ms | "
                f"{p.tokens_per_s:,.0f} tok/s{mfu}")  # fmt: skip
        else:
            log(f"{p.layout:>8} batch {p.batch_size:5d} | failed: {p.error}")

    dtype, why = hardware.compute_dtype(cfg.model.dtype, jax.default_backend())
    log(f"compute dtype {dtype} ({why})")
    points, meta = run_sweep(
        cfg,
        batch_sizes,
        parsed,
        warmup_steps=warmup_steps,
        timed_steps=timed_steps,
        peak_tflops=peak_tflops,
        collectives=collectives,
        on_point=progress,
    )
    paths = write_results(points, meta, out_dir)
    peak = meta["peak_tflops_per_device"]
    print(
        f"{meta['params'] / 1e6:.2f}M params | vocab {cfg.model.vocab_size} | seq {cfg.data.seq_len} | "
        f"{meta['model_dtype']} | {meta['devices']} x {meta['device_kind']} | peak "
        + (
            f"{peak:.3g} TFLOP/s per device ({meta['peak_source']})"
            if peak
            else "unknown (pass --peak-tflops)"
        )
        + f" | {meta['train_flops_per_token'] / 1e6:.1f} MFLOPs per token\n"
    )
    print(markdown_table(points))
    print(f"\nwrote {', '.join(str(p) for p in paths.values())}")
    return points, paths


# --------------------------------------------------------------------------------------------- profile


def profile(
    cfg: TrainConfig,
    logdir: str | Path,
    *,
    warmup_steps: int = 3,
    trace_steps: int = 5,
    vocab_size: int | None = None,
) -> Path:
    """`minigpt profile`: `trace_steps` steps of `cfg` (its mesh and batch size) on random tokens after
    `warmup_steps`, traced into logdir, each step waited for so that its `StepTraceAnnotation` spans the step's
    work. Returns the .xplane.pb written."""
    if warmup_steps < 0 or trace_steps < 1:
        raise ConfigError("--warmup-steps must be >= 0 and --trace-steps >= 1")
    compile_process.use()
    cfg = resolve_grad_accum(bench_config(cfg, vocab_size))
    logdir = Path(logdir)
    before = set(trace_files(logdir))
    step = compile_step(cfg)
    time_steps(step, warmup_steps, 0)
    with ProfileWindow((warmup_steps, warmup_steps + trace_steps), logdir) as window:
        t = time.perf_counter()
        for i in range(warmup_steps, warmup_steps + trace_steps):
            # Waiting for each step makes its "train" annotation span its device work, not only dispatch.
            window.run(i, _waited, step)
        elapsed = time.perf_counter() - t
    new = [p for p in trace_files(logdir) if p not in before]
    if not new:
        raise RuntimeError(f"jax.profiler wrote no trace under {logdir}")
    trace = new[-1]
    share = collective_share(jax.profiler.ProfileData.from_file(str(trace)), step.setup.mesh.devices.size)
    tokens = cfg.tokens_per_step
    print(
        f"traced steps {warmup_steps}..{warmup_steps + trace_steps - 1} (mesh {dict(step.setup.mesh.shape)}, batch "
        f"{cfg.batch_size}): {elapsed / trace_steps * 1e3:.1f} ms/step, {tokens * trace_steps / elapsed:,.0f} "
        f"tokens/s" + ("" if share is None else f", {share:.0%} of step time in collectives")
    )
    print(f"trace: {trace} ({trace.stat().st_size / 2**20:.1f} MiB)")
    print(f"open it with: {open_command(logdir)}")
    return trace
