"""The periodic work of a training run, as hooks the loop runs after each step.

Each hook is a small object with its own `every`: deciding to stop (a signal or the time limit, agreed by
all processes), laying the run's length out against a time budget, logging, evaluation, lm-eval tasks, a text
sample, a checkpoint. On the run's last step every hook runs. Hooks see the current state through the
`Progress` they are handed and keep no reference to it; a `Clock` keeps training time apart from the time
hooks spend evaluating and saving.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grain
import jax
import jax.numpy as jnp
import numpy as np

from minigpt.config import TrainConfig
from minigpt.data.mixture import Corpus
from minigpt.data.tokenizer import Tokenizer
from minigpt.inference.evaluate import evaluate, format_validation
from minigpt.inference.generate import SamplingConfig, generate
from minigpt.optim.optimizer import Schedule, average_start
from minigpt.parallel import distributed
from minigpt.parallel.distributed import is_main, say
from minigpt.training import hardware
from minigpt.training.checkpoint import Checkpointer
from minigpt.training.metrics import MetricsWriter, flops_per_step, mfu
from minigpt.training.trainer import Setup, TrainState, kept

# ----------------------------------------------------------------------------------------- the pieces


class Clock:
    """Training time: wall time since the start, less the pauses (evaluation, sampling, saving)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.paused_s = 0.0
        self._pause_start: float | None = None

    def train_time(self) -> float:
        """Seconds of training so far; a pause in progress does not count."""
        now = self._pause_start if self._pause_start is not None else time.perf_counter()
        return now - self.start - self.paused_s

    def wall_time(self) -> float:
        return time.perf_counter() - self.start

    @contextlib.contextmanager
    def pause(self, state: Any) -> Iterator[None]:
        """Leave the enclosed work out of training time. Steps run asynchronously, so `state` is waited for
        first: the pause must not swallow training work still on the devices."""
        jax.block_until_ready(state)
        self._pause_start = time.perf_counter()
        try:
            yield
        finally:
            self.paused_s += time.perf_counter() - self._pause_start
            self._pause_start = None


class StopRequest:
    """SIGTERM or Ctrl-C asks the loop to finish its step, save and exit; a second Ctrl-C aborts at once.

    With `at_once` (a run of one process), a Ctrl-C before the session has taken a step (`stepped`) stops the
    command at once, as it does before training starts: nothing was trained since the last checkpoint, and
    finishing the step would first wait for its compile, minutes on a busy machine."""

    def __init__(self, at_once: bool = False) -> None:
        self.signal_name: str | None = None
        self.at_once = at_once
        self.stepped = False
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
        if signum == signal.SIGINT and self.at_once and not self.stepped:
            previous = self._previous.get(signum)
            if callable(previous):  # the program's own: KeyboardInterrupt where it propagates
                return previous(signum, frame)
            raise KeyboardInterrupt
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.signal_name = signal.Signals(signum).name
        print(
            f"\n{self.signal_name}: finishing this step and saving a checkpoint (Ctrl-C again to abort)",
            file=sys.stderr,
            flush=True,
        )


@dataclasses.dataclass
class Progress:
    """Where the loop stands, handed to every hook after each step. The loop replaces `state` every step."""

    step: int
    state: TrainState
    end: int
    """The step the run ends at: --steps, or the length --max-time lays out once the step time is known."""
    budgeted: bool = False
    """`end` is where the time budget runs out, before --steps (saved with each checkpoint, kept on resume)."""
    spent_s: float = 0.0
    """Training time of the earlier sessions of this run (a budget counts them)."""
    final: bool = False
    """This is the session's last step (run length reached, stop agreed): every hook runs."""
    stop_message: str | None = None
    signalled: bool = False
    """The run stops on a signal (Ctrl-C, SIGTERM): it saves and exits, without evaluating or sampling first."""
    val: dict[str, float] | None = None
    """The newest evaluation's result, and the step it was made at."""
    val_step: int | None = None
    step_s: float | None = None
    """The pace the time budget measured (seconds per step), once it has."""


class StepMetrics:
    """Per-step metrics still on the devices: fetched only when logged, and checked for NaN/Inf before
    anything is logged, evaluated or saved, so that no checkpoint is written after a bad step."""

    def __init__(self, ckpt: Checkpointer) -> None:
        self.ckpt = ckpt
        self.pending: list[tuple[int, dict[str, jax.Array]]] = []

    def add(self, step: int, metrics: dict[str, jax.Array]) -> None:
        self.pending.append((step, metrics))

    def check_finite(self) -> list[tuple[int, dict[str, Any]]]:
        """The pending metrics on the host; raises at the first step whose loss or gradient is not finite."""
        fetched = jax.device_get(self.pending)
        for step, m in fetched:
            bad = [k for k in ("loss", "grad_norm") if not math.isfinite(float(m[k]))]
            if bad:
                raise FloatingPointError(
                    f"{' and '.join(bad)} became {float(m[bad[0]])} at step {step}; stopping. {self.ckpt.kept()}"
                )
        return fetched

    def take(self) -> list[tuple[int, dict[str, Any]]]:
        fetched = self.check_finite()
        self.pending.clear()
        return fetched


def format_time(seconds: float) -> str:
    """A duration as H:MM:SS, for the log's ETA and the run's total."""
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def format_sample(step: int, text: str) -> str:
    """A sample as the text it is, each line indented under a header, so a story's paragraphs read as
    paragraphs (an escaped one-liner hides them) and its lines stand apart from the log's."""
    lines = text.rstrip("\n").split("\n") or [""]
    return f"step {step:6d} | sample:\n" + "\n".join(f"    | {line}".rstrip() for line in lines)


# ----------------------------------------------------------------------------------------- the hooks


class Hook:
    """Periodic work: runs after every `every`-th step and after the last one. A hook that `pauses` has its
    time left out of training time (and waits for the step's device work first)."""

    every: int  # set by each hook; 0: only after the last step
    pauses = False
    on_signal = True
    """Whether it runs at a stop by a signal, when the user waits for the command to end."""

    def due(self, p: Progress) -> bool:
        if p.signalled and not self.on_signal:
            return False
        return p.final or (self.every > 0 and p.step % self.every == 0)

    def __call__(self, p: Progress) -> None:
        raise NotImplementedError


@dataclasses.dataclass
class StopHook(Hook):
    """Ends the run early on SIGTERM/Ctrl-C or at the time limit. Every process must stop at the same step,
    so the decision is agreed by all (a collective: with several processes, only every `every` steps)."""

    every: int
    stop: StopRequest
    clock: Clock
    max_time: float

    def due(self, p: Progress) -> bool:
        return not p.final and p.step % self.every == 0

    def __call__(self, p: Progress) -> None:
        self.stop.stepped = True  # from now on a Ctrl-C saves what the steps trained
        spent = p.spent_s + self.clock.train_time()
        out_of_time = bool(self.max_time) and not p.budgeted and spent > self.max_time
        if distributed.any_process(self.stop.signal_name is not None or out_of_time):
            p.final = True
            if out_of_time and self.stop.signal_name is None:
                p.stop_message = f"stopping at step {p.step}: max_time {self.max_time:.0f}s reached"
            else:
                by = self.stop.signal_name or "another process"
                p.signalled = True
                p.stop_message = f"stopped by {by} at step {p.step}; writing its checkpoint"


@dataclasses.dataclass
class BudgetHook(Hook):
    """--max-time: lays the run's length out against the budget, so that the schedule ends when the budget
    does. It times every `every` steps after this session's first (which compiles); the pace is the median of
    the newest `window` timings, so it follows a machine whose speed drifts and passes over a short slow patch.

    While no step already taken would have had another learning rate in a run of the new length (a WSD
    schedule's stable phase, a cosine's warmup), the length follows the pace at every timing. Once the
    schedule depends on it, the length moves only when it misses the steps the rest of the budget holds by
    more than `tolerance` of them: the steps still to come then decay to the new end (the ones taken keep the
    rates they had). So after every timing the run's end is within `tolerance` of where the budget runs out
    at the current pace, and the last timing comes at most `every` steps before the end: the run ends within
    `tolerance` of its budget plus what the pace changes over those last steps. On a steady machine the
    length never moves after the decay has begun, and the run is exactly a run of that length. All processes
    agree (the smallest length), and decide from the agreed lengths alone."""

    clock: Clock
    max_time: float
    cap: int
    """--steps: the longest the run may be."""
    schedule: Schedule
    every: int = 10
    window: int = 5
    tolerance: float = 0.02
    marks: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    """(step, training time) at each timing, the first right after the step that compiles."""
    committed: bool = False
    """The schedule has begun to depend on the length (said once)."""

    def due(self, p: Progress) -> bool:
        if p.final:
            return False
        return not self.marks or (p.step - self.marks[0][0]) % self.every == 0

    def __call__(self, p: Progress) -> None:
        jax.block_until_ready(p.state)
        now = self.clock.train_time()
        self.marks.append((p.step, now))
        if len(self.marks) == 1:
            return
        newest = self.marks[-self.window - 1 :]
        p.step_s = float(
            np.median([(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in itertools.pairwise(newest)])
        )
        left_s = self.max_time - p.spent_s - now
        steps_left = min(left_s / p.step_s, self.cap)  # a budget of 1e308 s holds inf steps: floor overflows
        end = distributed.smallest(min(self.cap, p.step + max(0, math.floor(steps_left))))
        laid_out = p.budgeted or len(self.marks) > 2  # a length already used by steps taken (or saved)
        committing = laid_out and not self.committed and not self._same_past(p.step, p.end, 2 * p.end)
        free = not laid_out or self._same_past(p.step, p.end, end)
        if end != p.end and (free or abs(end - p.end) > self.tolerance * end):
            if not laid_out and end < self.cap:
                say(
                    f"max_time {self.max_time:.0f}s at {p.step_s:.3f} s/step: about {end} steps "
                    f"(re-timed every {self.every} steps until the schedule's decay begins)"
                )
            elif not free and not committing:
                say(f"step {p.step}: the pace moved to {p.step_s:.3f} s/step; the run now ends at step {end}")
            p.end, p.budgeted = end, end < self.cap  # the budget, not --steps, ends the run
            p.final = p.step >= p.end
        if committing:  # said after any move of this timing, so its end is the one the run keeps
            self.committed = True
            say(
                f"step {p.step}: the schedule's decay has begun; the run ends at step {p.end} (moved only if "
                f"the pace changes by more than {self.tolerance:.0%})"
            )

    def _same_past(self, step: int, end: int, new_end: int) -> bool:
        """Whether the steps taken so far had the same learning rate in a run ending at `new_end`. Our
        schedules depend on the length from some step on, so the last step taken decides."""
        before = self.schedule.create(end)(step - 1)
        return bool(before == self.schedule.create(new_end)(step - 1))


@dataclasses.dataclass
class LogHook(Hook):
    """Training loss (mean over the window), learning rate, gradient norm, throughput, MFU and ETA."""

    every: int
    cfg: TrainConfig
    metrics: StepMetrics
    clock: Clock
    writer: MetricsWriter
    peak: hardware.Peak | None
    last_step: int
    last_time: float = 0.0

    def __call__(self, p: Progress) -> None:
        window = self.metrics.take()
        n, dt = p.step - self.last_step, self.clock.train_time() - self.last_time
        flops = n * flops_per_step(self.cfg)
        m = window[-1][1]
        record = {
            "loss": float(np.mean([float(x["loss"]) for _, x in window])),
            "lr": float(m["lr"]),
            "grad_norm": float(m["grad_norm"]),
            "tokens_per_s": n * self.cfg.tokens_per_step / dt,
            "tflops": flops / dt / 1e12,
            "elapsed_s": self.clock.train_time(),
        }
        utilisation = mfu(flops, dt, jax.device_count(), self.peak and self.peak.flops)
        if utilisation is not None and utilisation > 1 and self.peak.source != "--peak-tflops":
            self.peak = self.raised_peak(flops / dt / jax.process_count())
            utilisation = mfu(flops, dt, jax.device_count(), self.peak.flops)
        if utilisation is not None:
            record["mfu"] = utilisation
        self.writer.write(p.step, "train", record)
        say(
            f"step {p.step:6d}{'' if self.by_budget(p, dt / n) else f'/{p.end}'} | loss {record['loss']:.4f} | "
            f"lr {record['lr']:.2e} | grad norm {record['grad_norm']:.3f} | {record['tokens_per_s']:,.0f} tok/s | "
            + (f"MFU {record['mfu']:.1%} | " if "mfu" in record else "")
            + self.eta(p, dt / n)
        )
        self.last_step, self.last_time = p.step, self.clock.train_time()

    def raised_peak(self, achieved_flops: float) -> hardware.Peak:
        """A window beat the peak: on a CPU, measure it again (the cached one was measured under load)."""
        if jax.default_backend() != "cpu":
            return self.peak
        hardware.remeasure_peak(achieved_flops)
        peak = hardware.peak(jax.devices()[0])
        say(
            f"these steps ran faster than the cached peak: measured it again, {peak.flops / 1e12:.3g} TFLOP/s per device"
        )
        return peak

    def by_budget(self, p: Progress, step_s: float) -> bool:
        """Whether the time budget, not --steps, ends the run: it does, or it is still being timed and --steps
        would not end the run first at this window's pace."""
        if p.budgeted:
            return True
        return (
            bool(self.cfg.max_time) and p.step_s is None and (p.end - p.step) * step_s >= self._budget_left(p)
        )

    def _budget_left(self, p: Progress) -> float:
        return max(0.0, self.cfg.max_time - p.spent_s - self.clock.train_time())

    def eta(self, p: Progress, step_s: float) -> str:
        """The time left: the budget's, once it ends the run (a steady count, where a step total laid out
        from a pace still being measured would jump); until the budget has timed the steps, that they are
        being timed, unless --steps ends the run first at this window's pace; otherwise the steps left at it."""
        if p.budgeted:
            return f"ETA {format_time(self._budget_left(p))} of the {format_time(self.cfg.max_time)} budget"
        if self.by_budget(p, step_s):
            return f"timing steps for the {format_time(self.cfg.max_time)} budget ..."
        return f"ETA {format_time((p.end - p.step) * step_s)}"


@dataclasses.dataclass
class EvalHook(Hook):
    """Validation loss and bits per byte over the whole validation split (or `eval_batches` of it)."""

    on_signal = False

    every: int
    setup: Setup
    corpus: Corpus
    eval_step: Any
    metrics: StepMetrics
    clock: Clock
    writer: MetricsWriter
    epoch: int | None = None
    """Steps of one pass over the training text; a run longer than one keeps its best evaluated weights."""
    pauses: bool = True
    best: Best | None = None

    def __call__(self, p: Progress) -> None:
        self.metrics.check_finite()
        self.corpus.check_unchanged()
        result = evaluate(
            self.setup, self.eval_step, p.state.params, self.corpus, self.setup.cfg.eval_batches
        )
        result = self._keep_best(p, self._average_or_last(p, result))
        self.writer.write(p.step, "val", {**result, "elapsed_s": self.clock.train_time()})
        say(f"step {p.step:6d} | {format_validation(result)}")
        p.val, p.val_step = result, p.step

    def _average_or_last(self, p: Progress, result: dict[str, Any]) -> dict[str, Any]:
        """--average-weights: at the run's end, its weight average replaces the last weights where it evaluates
        better (a run that keeps its best evaluated weights then compares the average with those)."""
        cfg = self.setup.cfg
        first = average_start(p.end, cfg.average_weights) + 1
        if p.state.average is None or p.step != p.end or first >= p.end:
            return result
        averaged = p.state.with_average()
        mean = evaluate(self.setup, self.eval_step, averaged.params, self.corpus, cfg.eval_batches)
        better = mean["loss"] < result["loss"]
        say(
            f"step {p.step} | the average of steps {first}-{p.end}'s weights: val bits/byte {mean['bpb']:.4f} "
            f"against the last weights' {result['bpb']:.4f}: the run ends with "
            + ("the average" if better else "the last weights")
        )
        summary = {"steps": f"{first}-{p.end}", "loss": mean["loss"], "bpb": mean["bpb"]}
        if not better:
            return {**result, "average": summary}
        p.state = averaged
        return {**mean, "weights": "average", "average": summary, "last": result}

    def _keep_best(self, p: Progress, result: dict[str, Any]) -> dict[str, Any]:
        """A run that reads its training text more than once ends with the best weights it evaluated, never
        worse ones: they are kept (a copy on the devices) at each evaluation that improves on them, and put back
        at the run's end if its last evaluation is worse. Only at the end: a stopped run resumes exactly."""
        if self.epoch is None or p.end <= self.epoch:
            return result
        if self.best is None or result["loss"] <= self.best.result["loss"]:
            self.best = Best(p.step, result, jax.tree.map(jnp.copy, p.state.params))
            return result
        if p.step < p.end:
            return result
        best = self.best
        say(
            f"step {p.step} | val bits/byte {result['bpb']:.4f}, worse than step {best.step}'s "
            f"{best.result['bpb']:.4f} ({p.step / self.epoch:.1f} passes over the training text overfit it): "
            f"the run ends with step {best.step}'s weights"
        )
        p.state = dataclasses.replace(p.state, params=best.params)
        return {**best.result, "weights_of_step": best.step, "last": result}


@dataclasses.dataclass
class Best:
    """The best evaluated weights of a run so far, with their step and evaluation."""

    step: int
    result: dict[str, Any]
    params: Any


@dataclasses.dataclass
class TasksHook(Hook):
    """lm-evaluation-harness tasks (--eval-tasks) scored with the current parameters; each task's metrics go
    to metrics.jsonl (kind "tasks"), TensorBoard and the plot. The backend is built once, so its compiled
    forward passes serve every scoring."""

    on_signal = False

    every: int
    setup: Setup
    tokenizer: Tokenizer
    task_manager: Any
    """lm-eval's task registry, its task names already checked."""
    writer: MetricsWriter
    clock: Clock
    pauses: bool = True
    lm: Any = None

    def __call__(self, p: Progress) -> None:
        from minigpt.inference import harness

        cfg = self.setup.cfg
        if self.lm is None:
            loaded = (self.setup, p.state.params, self.tokenizer)
            self.lm = harness.MiniGPTLM(loaded=loaded, batch_size=cfg.batch_size, progress=False)
        self.lm.set_params(p.state.params)
        results = harness.run_tasks(
            self.lm, cfg.eval_tasks, self.task_manager, limit=cfg.eval_tasks_limit, bootstrap_iters=0
        )
        values = harness.flat_metrics(results)
        self.writer.write(p.step, "tasks", {**values, "elapsed_s": self.clock.train_time()})
        say(f"step {p.step:6d} | " + " | ".join(f"{k} {v:.4f}" for k, v in values.items()))


@dataclasses.dataclass
class SampleHook(Hook):
    """A short continuation of the sample prompt, printed and appended to samples.txt."""

    on_signal = False

    every: int
    setup: Setup
    tokenizer: Tokenizer
    run_dir: Path
    pauses: bool = True

    def __call__(self, p: Progress) -> None:
        cfg = self.setup.cfg
        sample = generate(
            self.setup.graphdef,
            p.state.params,
            self.tokenizer,
            cfg.sample_prompt,
            SamplingConfig(max_new_tokens=cfg.sample_tokens, temperature=0.8, top_k=40, seed=p.step),
            max_seq_len=cfg.model.max_seq_len,
        )[0]
        say(format_sample(p.step, sample))
        if is_main():
            with open(self.run_dir / "samples.txt", "a") as f:
                f.write(f"--- step {p.step}\n{sample}\n")


@dataclasses.dataclass
class CheckpointHook(Hook):
    """The state, the data position and metadata; the step's validation loss, if it was evaluated, ranks it
    for keeping the best checkpoint."""

    every: int
    ckpt: Checkpointer
    data_it: grain.DatasetIterator
    metrics: StepMetrics
    tokenizer_identity: str
    clock: Clock
    pauses: bool = True

    def __call__(self, p: Progress) -> None:
        self.metrics.check_finite()
        val = p.val if p.val_step == p.step else None
        meta = {
            "tokenizer": self.tokenizer_identity,
            "step": p.step,
            "val": val,
            "run_steps": p.end if p.budgeted else None,
            "train_time_s": p.spent_s + self.clock.train_time(),
        }
        self.ckpt.save(
            p.step, kept(p.state).saved(), self.data_it.get_state(), meta, val["loss"] if val else None
        )


def run_hook(hook: Hook, p: Progress, clock: Clock) -> None:
    if hook.pauses:
        with clock.pause(p.state):
            hook(p)
    else:
        hook(p)
