"""The matrix products of a compiled program, read off its HLO, and their time read off a profile.

Each dot gets its shapes, FLOPs, the dtype its operands arrive in, whether it runs in XLA:CPU's fast
library (a `__ynn_fusion`, YNNPACK) and which pass it belongs to: `forward` and `backward` from JAX's op
names (autodiff's transposes are `transpose(jvp(...))`), `other` for products outside the model (the
optimizer's). Time comes from a `jax.profiler` trace of the same program: the events on XLA's CPU worker
threads are named for the HLO instruction that ran (the fusion holding a dot, or the dot itself), so a
dot's time per step is its events' total over the traced steps, and its throughput its FLOPs over that.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
import tempfile
from collections.abc import Callable, Iterable
from typing import Any

_COMPUTATION = re.compile(r"^(?:ENTRY )?%([\w.\-]+) ")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (\w+)\[([\d,]*)\]\S* ([\w\-]+)\(([^)]*)\)(.*)$")
_DIMS = {name: re.compile(name + r"=\{([\d,]*)\}") for name in ("lhs_contracting_dims", "lhs_batch_dims")}


@dataclasses.dataclass(frozen=True)
class Dot:
    """One dot instruction of a compiled program."""

    event: str
    """The instruction a profile names when it runs: the fusion holding the dot, or the dot."""
    shapes: str
    """lhs x rhs -> out, with dtypes, as the dot receives its operands."""
    flops: float
    operand_dtype: str
    fast: bool
    """Runs in the fast library (YNNPACK) with bfloat16 operands."""
    library: bool
    """Runs in the fast library at all (float32 operands included)."""
    kind: str
    """forward, backward, or other."""
    op_name: str


def _dims(text: str) -> list[int]:
    return [int(d) for d in text.split(",") if d]


def _computations(hlo: str) -> dict[str, list[re.Match]]:
    """Each computation's instructions, parsed."""
    out: dict[str, list[re.Match]] = {}
    current: list[re.Match] | None = None
    for line in hlo.splitlines():
        if (head := _COMPUTATION.match(line)) is not None and line.rstrip().endswith("{"):
            current = out.setdefault(head.group(1), [])
        elif current is not None and (m := _INSTRUCTION.match(line)) is not None:
            current.append(m)
    return out


def _pass(op_name: str) -> str:
    if "transpose(" in op_name:
        return "backward"
    return "forward" if "jvp(" in op_name else "other"


def _dot(m: re.Match, shapes: dict[str, tuple[str, list[int]]], event: str, library: bool) -> Dot:
    _, dtype, dims, _, operands, attrs = m.groups()
    (ldt, lhs), (rdt, rhs) = (shapes[o.strip().lstrip("%")] for o in operands.split(",")[:2])
    contracting = _DIMS["lhs_contracting_dims"].search(attrs)
    k = math.prod(lhs[i] for i in _dims(contracting.group(1))) if contracting else 1
    op_name = re.search(r'op_name="([^"]*)"', attrs)
    text = op_name.group(1) if op_name else ""
    described = f"{ldt}{lhs} x {rdt}{rhs} -> {dtype}{_dims(dims)}"
    fast = library and ldt == rdt == "bf16"
    return Dot(event, described, 2.0 * math.prod(_dims(dims)) * k, ldt, fast, library, _pass(text), text)


def dots(hlo: str) -> list[Dot]:
    """Every dot of a compiled program's HLO text (`compiled.as_text()`)."""
    computations = _computations(hlo)
    callers: dict[str, tuple[str, bool]] = {}  # fused computation -> (fusion instruction, in the library)
    for instructions in computations.values():
        for m in instructions:
            if m.group(4) == "fusion" and (called := re.search(r"calls=%([\w.\-]+)", m.group(6))):
                callers[called.group(1)] = (m.group(1), "__ynn_fusion" in m.group(6))
    found = []
    for computation, instructions in computations.items():
        shapes = {m.group(1): (m.group(2), _dims(m.group(3))) for m in instructions}
        for m in instructions:
            if m.group(4) == "dot":
                event, library = callers.get(computation, (m.group(1), False))
                found.append(_dot(m, shapes, event, library))
    return found


def profile_events(run: Callable[[], Any], steps: int) -> tuple[dict[str, float], dict[str, int]]:
    """Seconds and occurrences per step of every op XLA:CPU's worker threads ran while `run()` was called
    `steps` times under `jax.profiler` (container events, such as a whole thunk sequence, left out)."""
    import jax

    from minigpt.training.profiling import trace_files

    with tempfile.TemporaryDirectory(prefix="minigpt-dots-") as tmp:
        jax.profiler.start_trace(tmp)
        for _ in range(steps):
            jax.block_until_ready(run())
        jax.profiler.stop_trace()
        profile = jax.profiler.ProfileData.from_file(str(trace_files(tmp)[-1]))
    seconds: dict[str, float] = collections.Counter()
    count: dict[str, int] = collections.Counter()
    for plane in profile.planes:
        for line in plane.lines if plane.name == "/host:CPU" else ():
            for e in line.events if line.name.startswith("tf_XLA") else ():
                if not re.match(r"ThunkExecutor|SlinkyThreadPool|while|call|conditional", e.name):
                    seconds[e.name] += e.duration_ns / 1e9 / steps
                    count[e.name] += 1
    return dict(seconds), {k: v // steps for k, v in count.items()}


@dataclasses.dataclass(frozen=True)
class TimedDot:
    dot: Dot
    calls: int
    """Times per step it runs (a dot in a loop body runs once per iteration)."""
    seconds: float
    """Per step, all calls."""

    @property
    def gflops(self) -> float:
        return self.dot.flops * self.calls / self.seconds / 1e9 if self.seconds else 0.0


def timed(found: Iterable[Dot], seconds: dict[str, float], count: dict[str, int]) -> list[TimedDot]:
    """The dots a profile saw run, slowest first. A fusion holding several dots is timed as a whole, under
    its first."""
    rows, seen = [], set()
    for d in found:
        if d.event in seconds and d.event not in seen:
            seen.add(d.event)
            rows.append(TimedDot(d, count[d.event], seconds[d.event]))
    return sorted(rows, key=lambda r: -r.seconds)
