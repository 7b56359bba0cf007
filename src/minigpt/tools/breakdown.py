"""Where a compiled program's device time goes: its ops' time from a `jax.profiler` trace, each op put in a
category by the named scope of the JAX code it came from (`nn/model.py` and `training/trainer.py` name the
attention, the output layer's loss and the optimizer update), the rest split into matrix products and
everything else, and the time the device sat idle between them.

An op is found by its HLO instruction name (the trace's `hlo_op`) in the compiled program's text, whose
metadata holds the JAX name stack (`jit(train_step)/transpose(jvp(attention))/dot_general`); a fusion takes
the category of the instructions fused into it. On an accelerator the device's own timeline is read
("XLA Ops"); on a CPU, the XLA worker threads of the host, where ops of one program overlap (idle is then
left out).
"""

from __future__ import annotations

import collections
import dataclasses
import re
import tempfile
from collections.abc import Callable
from typing import Any

import jax

from minigpt.training.profiling import trace_files

SCOPES = ("attention", "loss", "optimizer")
"""Named scopes of the model and the step, each a category of its own (the first one an op's name stack
holds wins)."""
CATEGORIES = (*SCOPES, "matmul", "other")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = ")
_CALLS = re.compile(r"calls=%([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) .*\{\s*$")


def _category(op_names: list[str], has_product: bool) -> str:
    for scope in SCOPES:
        if any(re.search(rf"[(/]{scope}[)/]", name) for name in op_names):
            return scope
    return "matmul" if has_product else "other"


def _instructions(hlo_text: str) -> list[tuple[str, str, str]]:
    """(computation, instruction name, its whole text) for every instruction; an instruction's attributes may
    run over several lines (a Pallas kernel's metadata), so its text reaches to the next one's start."""
    out, computation, current = [], "", None
    for line in hlo_text.splitlines():
        if (c := _COMPUTATION.match(line)) is not None:
            computation = c.group(1)
        elif (m := _INSTRUCTION.match(line)) is not None:
            current = [computation, m.group(1), line]
            out.append(current)
            continue
        elif current is not None and line.strip() != "}":
            current[2] += "\n" + line
            continue
        current = None
    return [tuple(i) for i in out]


def op_categories(hlo_text: str) -> dict[str, str]:
    """Every instruction of a compiled program's HLO (`compiled.as_text()`) by name: its category."""
    names: dict[str, list[str]] = collections.defaultdict(list)  # computation -> op_names inside it
    products: set[str] = set()
    calls: dict[str, tuple[list[str], str | None, bool]] = {}  # instruction -> (op_name, called, product)
    for computation, name, text in _instructions(hlo_text):
        own = _OP_NAME.findall(text)[:1]
        names[computation] += own
        product = bool(re.search(r"\b(convolution|dot)\(", text))
        if product:
            products.add(computation)
        called = _CALLS.search(text)
        calls[name] = (own, called.group(1) if called else None, product)
    out = {}
    for name, (own, called, product) in calls.items():
        inside = names.get(called, []) if called else []
        out[name] = _category(inside or own, product or called in products)
    return out


@dataclasses.dataclass(frozen=True)
class Breakdown:
    """Seconds per step in each category (CATEGORIES), the step's wall time, and the device's idle time."""

    seconds: dict[str, float]
    step_s: float
    idle_s: float | None
    top: list[tuple[str, str, float]]
    """The ops that took longest: (HLO name, category, seconds per step)."""

    def shares(self) -> dict[str, float]:
        """Each category's share of the step, and idle's where known."""
        out = {k: v / self.step_s for k, v in self.seconds.items()}
        if self.idle_s is not None:
            out["idle"] = self.idle_s / self.step_s
        return out


_CONTAINER = re.compile(r"(while|conditional|call)(\.\d+)?$")
"""Ops that only hold others (a loop's body is timed op by op inside it)."""


def _op_name(event: Any) -> str:
    """An op event's HLO instruction name: its `hlo_op` stat, or the name an accelerator's trace gives it,
    which may be the whole instruction (`%fusion.3 = f32[...] fusion(...)`)."""
    name = str(dict(event.stats).get("hlo_op", event.name))
    m = re.match(r"%?([\w.\-]+)", name)
    return m.group(1) if m else name


def _union_s(spans: list[tuple[int, int]]) -> float:
    total, end = 0, -1
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e9


def _op_events(profile: Any, module: str) -> tuple[list[Any], bool]:
    """The op events of `module` on the first device's timeline (accelerators), else on the host's XLA
    threads (CPU); and whether they come from a device's own timeline."""
    for plane in profile.planes:
        if plane.name.startswith("/device:") and "CPU" not in plane.name:
            events = [e for line in plane.lines if line.name == "XLA Ops" for e in line.events]
            if events:
                return [e for e in events if module in str(dict(e.stats).get("hlo_module", module))], True
    host = [p for p in profile.planes if p.name == "/host:CPU"]
    events = [e for p in host for line in p.lines if line.name.startswith("tf_XLA") for e in line.events]
    return [e for e in events if dict(e.stats).get("hlo_module") == module], False


def breakdown(compiled: Any, run: Callable[[], Any], steps: int = 3) -> Breakdown:
    """Profile `steps` calls of `run()` (which runs `compiled`, the `jax.stages.Compiled` program) and split
    their device time into categories."""
    categories = op_categories(compiled.as_text())
    module = re.search(r"HloModule ([\w.\-]+)", compiled.as_text())
    module_name = module.group(1) if module else ""
    jax.block_until_ready(run())
    with tempfile.TemporaryDirectory(prefix="minigpt-breakdown-") as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(steps):
            out = run()
        jax.block_until_ready(out)
        jax.profiler.stop_trace()
        profile = jax.profiler.ProfileData.from_file(str(trace_files(tmp)[-1]))
    events, on_device = _op_events(profile, module_name)
    events = [e for e in events if not _CONTAINER.match(_op_name(e))]
    seconds: dict[str, float] = dict.fromkeys(CATEGORIES, 0.0)
    per_op: dict[str, float] = collections.Counter()
    for e in events:
        name = _op_name(e)
        seconds[categories.get(name, "other")] += e.duration_ns / 1e9 / steps
        per_op[name] += e.duration_ns / 1e9 / steps
    spans = [(e.start_ns, e.start_ns + e.duration_ns) for e in events]
    wall = (max(b for _, b in spans) - min(a for a, _ in spans)) / 1e9 / steps if spans else 0.0
    idle = max(0.0, wall - _union_s(spans) / steps) if on_device else None
    top = [(n, categories.get(n, "other"), s) for n, s in sorted(per_op.items(), key=lambda x: -x[1])[:25]]
    return Breakdown(seconds, wall or 1.0, idle, top)
