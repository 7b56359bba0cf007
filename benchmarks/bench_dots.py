"""Every matrix product of the compiled train step, forward and backward: its shapes, the dtype its operands
reach it in, whether XLA:CPU runs it in its fast library (YNNPACK's bfloat16 kernels on AMX / AVX-512 BF16),
and its time and throughput in the step, read off a profile of the real step.

    python benchmarks/bench_dots.py                         # tutorial batch 16 and cpu batch 24, auto dtype
    python benchmarks/bench_dots.py --configs tutorial=48 --dtype float32
    python benchmarks/bench_dots.py --quick                 # a small model

Each preset's step is compiled for one CPU device (the kernels, not the split into devices, are what this
looks at), run --warmup times, then profiled for --steps steps (`tools/dots.py`: the HLO says which fusion
holds which dot, the profile how long each ran). Products of the same kind and shapes are summed into one
row (the layers' q projections, say). The step's other work (norms, softmax, the optimizer, copies) is the
"everything else" row. The chunked output layer computes its weight and input gradients in its forward pass,
so they are listed as forward products. Times on a shared machine are noise; shares and throughputs within
one step compare.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses

from common import code_version, parser, print_tables, report, run_child, table, write_result

DEFAULT_CONFIGS = ["tutorial=16", "cpu=24"]


def run(args: argparse.Namespace) -> dict:
    from minigpt.runtime import allocator

    allocator.keep_freed_memory()
    import jax

    from minigpt.config import PRESETS
    from minigpt.tools.bench import bench_config, compile_step, time_steps
    from minigpt.tools.dots import dots, profile_events, timed

    cfg = bench_config(PRESETS[args.preset])
    model = dataclasses.replace(cfg.model, dtype=args.dtype)
    if args.quick:
        model = dataclasses.replace(model, d_model=64, n_layers=1, n_heads=2, d_ff=128, vocab_size=512)
    cfg = dataclasses.replace(cfg, model=model, batch_size=args.batch, grad_accum=1)
    step = compile_step(cfg, jax.devices()[:1])
    times, _ = time_steps(step, args.warmup, 1)
    seconds, count = profile_events(step, args.steps)
    rows = collections.defaultdict(lambda: {"flops": 0.0, "seconds": 0.0, "calls": 0})
    for t in timed(dots(step.xla.as_text()), seconds, count):
        key = (t.dot.kind, t.dot.shapes, t.dot.fast)
        rows[key]["flops"] += t.dot.flops * t.calls
        rows[key]["seconds"] += t.seconds
        rows[key]["calls"] += t.calls
    return {
        "dtype": step.setup.cfg.model.dtype,
        "step_s": min(times),
        "busy_s": sum(seconds.values()),
        "dots": [{"kind": k, "shapes": s, "fast": f, **v} for (k, s, f), v in rows.items()],
    }


def child(args: argparse.Namespace) -> None:
    report(run(args))


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="PRESET=BATCH")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=2, help="steps profiled")
    p.add_argument("--top", type=int, default=12, help="rows per preset; the rest are summed")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.configs, args.warmup, args.steps = ["tutorial=2"], 1, 1
    return args


def dot_table(config: str, r: dict, top: int) -> dict:
    dots = sorted(r["dots"], key=lambda d: -d["seconds"])
    busy = r["busy_s"]
    row = lambda d: [d["kind"], d["shapes"], "yes" if d["fast"] else "no", d["calls"],
                     f"{1e3 * d['seconds']:.1f}", f"{d['seconds'] / busy:.1%}",
                     f"{d['flops'] / d['seconds'] / 1e9:,.0f}"]  # fmt: skip
    rest = dots[top:]
    rows = [row(d) for d in dots[:top]]
    if rest:
        summed = {"flops": sum(d["flops"] for d in rest), "seconds": sum(d["seconds"] for d in rest)}
        fast = sum(d["flops"] for d in rest if d["fast"]) / summed["flops"]
        rows.append(["", f"{len(rest)} more products", f"{fast:.0%} of FLOPs", sum(d["calls"] for d in rest),
                     f"{1e3 * summed['seconds']:.1f}", f"{summed['seconds'] / busy:.1%}",
                     f"{summed['flops'] / summed['seconds'] / 1e9:,.0f}"])  # fmt: skip
    other = busy - sum(d["seconds"] for d in dots)
    rows.append(["", "everything else", "", "", f"{1e3 * other:.1f}", f"{other / busy:.1%}", ""])
    columns = [
        "pass",
        "lhs x rhs -> out",
        "fast path",
        "calls/step",
        "ms/step",
        "share of op time",
        "GFLOP/s",
    ]
    preset, _, batch = config.partition("=")
    title = f"{preset} preset, batch {batch}, {r['dtype']}: the step's products (step {r['step_s']:.3f} s)"
    note = "Op time is the worker threads' time in the step's ops (two threads: it can exceed the step's)."
    return table(columns, rows, title, note)


def summary(results: dict[str, dict]) -> tuple[dict, list[str]]:
    rows, lines = [], []
    for config, r in results.items():
        flops = sum(d["flops"] for d in r["dots"])
        fast = sum(d["flops"] for d in r["dots"] if d["fast"]) / flops
        dot_s = sum(d["seconds"] for d in r["dots"])
        rate = flops / dot_s / 1e9
        preset, _, batch = config.partition("=")
        rows.append([preset, batch, r["dtype"], f"{fast:.1%}", f"{dot_s / r['busy_s']:.0%}", f"{rate:,.0f}"])
        lines.append(
            f"In the {preset} preset's {r['dtype']} train step (batch {batch}), {fast:.0%} of the matmul FLOPs "
            f"run on the CPU's fast path, at {rate:,.0f} GFLOP/s on average"
        )
    columns = ["preset", "batch", "dtype", "FLOPs on the fast path", "products' share of op time", "GFLOP/s"]
    return table(columns, rows, "Summary"), lines


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    results = {}
    for config in args.configs:
        preset, _, batch = config.partition("=")
        argv = [__file__, "--child", "--preset", preset, "--batch", batch, "--dtype", args.dtype, "--warmup",
                str(args.warmup), "--steps", str(args.steps), *(["--quick"] if args.quick else [])]  # fmt: skip
        result, why = run_child(argv)
        if result is None:
            raise SystemExit(f"{config} failed: {why}")
        results[config] = result
    first, lines = summary(results)
    out = [first, *(dot_table(c, r, args.top) for c, r in results.items())]
    print_tables(out)
    write_result(args, "bench_dots", "The train step's matrix products", out, headlines=lines,
                 data=results, code=code_version())  # fmt: skip


if __name__ == "__main__":
    main()
