"""Training tokens/s in mixed precision (`--model.dtype auto`) and in float32, and nanoGPT's model at the same
shapes in torch, float32 and with bfloat16 autocast, side by side on this machine.

    python benchmarks/bench_speed.py --nanogpt ~/src/nanoGPT       # tutorial 16 and 48, cpu 48; nanoGPT too
    NANOGPT_DIR=~/src/nanoGPT python -m benchmarks bench_speed      # the same through the runner
    python benchmarks/bench_speed.py --configs tutorial=16 --rounds 2
    python benchmarks/bench_speed.py --quick                          # a small model, one timed step
    python benchmarks/bench_speed.py --baseline e6bfc80               # float32 as minigpt trained it then

Each side runs in a fresh process, one after the other (alternating over --rounds), on random tokens (the
step's speed does not depend on them):

- `minigpt float32` and `minigpt auto`: the preset's train step as `minigpt train` runs it: the CPU split into
  its devices (FSDP over them, `trainer.cpu_layout`), malloc set to keep freed memory (`allocator`), the step
  compiled ahead of time in the compiler process (`compile_process`) with no compilation cache, as in a
  config's first run, and timed step by step after --warmup untimed steps. auto is the dtype
  `hardware.compute_dtype` picks here.
- `minigpt float32 then` (with --baseline REV): float32 as `minigpt train` ran it at an earlier commit of this
  repository (its src/ from git, its own CPU split, layout and malloc), at the preset's current shapes: the
  "today's float32" that a speed target was set against. e6bfc80 is the commit before mixed precision.
- `nanoGPT float32` and `nanoGPT bf16 autocast`: nanoGPT's own model.py (pass --nanogpt, a checkout of
  github.com/karpathy/nanoGPT or its model.py; it is not part of minigpt) at the tutorial preset's shapes (4
  layers, d 256, 8 heads, context 256, GPT-2's vocabulary padded to 50304 as nanoGPT's train.py pads it,
  biases, dropout 0.1), its AdamW from `configure_optimizers`, with `torch.amp.autocast('cpu', bfloat16)` for
  the second, as nanoGPT's train.py does; torch uses every core. Its MLP is 4 d wide where the preset's is d,
  so it does more FLOPs per token: compare tokens/s, which is what a user waits for.

MFU divides the model FLOPs (metrics.py's convention, minigpt's shapes) by the machine's real peak, the fastest
matmul it offers (`hardware.peak`). Rates come from the median timed step of all rounds. Absolute times on a
shared machine are noise: compare the sides, measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from common import REPO, code_version, parser, print_tables, report, run_child, table, write_result

SIDES = (
    "minigpt float32",
    "minigpt auto",
    "nanoGPT float32",
    "nanoGPT bf16 autocast",
    "minigpt float32 then",
)
THEN = SIDES[-1]
HOW_IT_COMPUTES = ("dtype", "attention", "remat", "loss_chunk", "scan_layers")
"""Model fields the baseline keeps its own defaults for: they say how its code computes, not what."""
DEFAULT_CONFIGS = ["tutorial=16", "tutorial=48", "cpu=48"]


def minigpt_config(preset: str, batch: int, dtype: str, quick: bool):
    from minigpt.config import PRESETS
    from minigpt.tools.bench import bench_config

    cfg = bench_config(PRESETS[preset])
    model = dataclasses.replace(cfg.model, dtype=dtype)
    if quick:
        model = dataclasses.replace(model, d_model=64, n_layers=1, n_heads=2, d_ff=128, max_seq_len=64)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=64))
    return dataclasses.replace(cfg, model=model, batch_size=batch, grad_accum=1)


def run_minigpt(args: argparse.Namespace) -> dict:
    from minigpt.runtime import allocator, compile_process

    allocator.keep_freed_memory()  # as the minigpt program does, before JAX starts
    import jax

    from minigpt.tools.bench import compile_step, time_steps
    from minigpt.training import hardware
    from minigpt.training.metrics import flops_per_step
    from minigpt.training.trainer import cpu_layout, split_cpu

    cfg = minigpt_config(args.preset, args.batch, args.child.split()[-1], args.quick)
    cfg = cpu_layout(cfg, split_cpu(cfg, multi_process=False))
    compile_process.use()
    step = compile_step(cfg)
    times, _ = time_steps(step, args.warmup, args.steps)
    peak = hardware.peak(jax.devices()[0])
    return {
        "step_s": times,
        "tokens_per_step": cfg.batch_size * cfg.data.seq_len,
        "flops_per_step": flops_per_step(step.setup.cfg),
        "host_peak_flops": None if peak is None else peak.flops * jax.device_count(),
        "peak_source": None if peak is None else peak.source,
        "dtype": step.setup.cfg.model.dtype,
        "devices": jax.device_count(),
    }


def architecture(preset: str, batch: int, quick: bool) -> dict:
    """What the baseline must build: the preset's model fields that differ from ModelConfig's defaults, but
    not how it computes, and the sequence length."""
    from minigpt.config import ModelConfig

    cfg = minigpt_config(preset, batch, "float32", quick)
    default = ModelConfig()
    model = {
        f.name: getattr(cfg.model, f.name)
        for f in dataclasses.fields(cfg.model)
        if f.name not in HOW_IT_COMPUTES and getattr(cfg.model, f.name) != getattr(default, f.name)
    }
    return {"model": model, "seq_len": cfg.data.seq_len}


def run_then(args: argparse.Namespace) -> dict:
    """float32 as `minigpt train` ran it at the baseline commit: that commit's src/ first on sys.path (before
    anything imports minigpt), the preset's current architecture."""
    sys.path.insert(0, args.then_src)
    import jax

    from minigpt.config import PRESETS
    from minigpt.tools.bench import bench_config, compile_step, time_steps
    from minigpt.training.trainer import split_cpu

    if not sys.modules["minigpt"].__file__.startswith(args.then_src):
        raise SystemExit(f"minigpt was imported from {sys.modules['minigpt'].__file__}, not {args.then_src}")
    want = json.loads(args.then_shape)
    cfg = PRESETS[args.preset]
    missing = sorted(set(want["model"]) - {f.name for f in dataclasses.fields(cfg.model)})
    if missing:
        raise SystemExit(f"the baseline's code cannot build this preset's model: no {', '.join(missing)}")
    model = dataclasses.replace(cfg.model, **want["model"], dtype="float32")
    data = dataclasses.replace(cfg.data, seq_len=want["seq_len"])
    cfg = bench_config(dataclasses.replace(cfg, model=model, data=data, batch_size=args.batch, grad_accum=1))
    split_cpu(cfg, multi_process=False)  # as its train did; its default layout follows from the devices
    step = compile_step(cfg)
    times, _ = time_steps(step, args.warmup, args.steps)
    return {
        "step_s": times,
        "tokens_per_step": cfg.batch_size * cfg.data.seq_len,
        "devices": jax.device_count(),
    }


def checkout_src(rev: str, into: str) -> str:
    """`rev`'s src/ from git, unpacked under `into`; its full commit id."""
    git = lambda *a, **kw: subprocess.run(["git", *a], cwd=REPO, capture_output=True, check=False, **kw)
    commit = git("rev-parse", "--verify", f"{rev}^{{commit}}", text=True)
    if commit.returncode:
        raise SystemExit(f"--baseline {rev}: not a commit of {REPO} (git rev-parse: {commit.stderr.strip()})")
    archive = Path(into) / "src.tar"
    archive.write_bytes(git("archive", "--format=tar", commit.stdout.strip(), "src").stdout)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return commit.stdout.strip()


def load_nanogpt(path: str):
    """nanoGPT's model.py (a checkout's, or the file) as a module, and the commit it is at, where git says."""
    file = Path(path).expanduser()
    file = file / "model.py" if file.is_dir() else file
    spec = importlib.util.spec_from_file_location("nanogpt_model", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    git = subprocess.run(["git", "-C", str(file.parent), "rev-parse", "HEAD"], capture_output=True, text=True)
    return module, git.stdout.strip() or None


def run_nanogpt(args: argparse.Namespace) -> dict:
    import contextlib

    import torch

    nanogpt, commit = load_nanogpt(args.nanogpt)
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.manual_seed(0)
    small = dict(n_layer=1, n_head=2, n_embd=64, block_size=64) if args.quick else {}
    config = nanogpt.GPTConfig(
        **{"block_size": 256, "vocab_size": 50304, "n_layer": 4, "n_head": 8, "n_embd": 256, **small},
        dropout=0.1,
        bias=True,
    )
    model = nanogpt.GPT(config)
    optimizer = model.configure_optimizers(0.0, 1e-3, (0.9, 0.999), "cpu")
    T = config.block_size
    bf16 = args.child.endswith("autocast")
    autocast = torch.amp.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    tokens = torch.randint(0, 50257, (args.batch, T + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()  # as nanoGPT's get_batch makes them
    times = []
    for _ in range(args.warmup + args.steps):
        t = time.perf_counter()
        with autocast:
            _, loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t)
    return {"step_s": times[args.warmup :], "tokens_per_step": args.batch * T, "commit": commit,
            "torch": torch.__version__}  # fmt: skip


def child(args: argparse.Namespace) -> None:
    if args.child == THEN:
        return report(run_then(args))
    report(run_minigpt(args) if args.child.startswith("minigpt") else run_nanogpt(args))


def summarise(runs: list[dict]) -> dict:
    step = statistics.median(t for r in runs for t in r["step_s"])
    first = runs[0]
    out = {"step_s": step, "tokens_per_s": first["tokens_per_step"] / step, "raw": runs}
    if first.get("host_peak_flops"):
        out["mfu"] = first["flops_per_step"] / step / first["host_peak_flops"]
    return out


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="PRESET=BATCH (tutorial, cpu)")
    p.add_argument(
        "--nanogpt",
        default=os.environ.get("NANOGPT_DIR"),
        help="a nanoGPT checkout or its model.py (default $NANOGPT_DIR; the peer's rows are left out without it)",
    )
    p.add_argument(
        "--nanogpt-sides",
        nargs="+",
        choices=SIDES[2:],
        default=list(SIDES[2:]),
        help="nanoGPT's sides to measure: where torch emulates bfloat16 (no AVX-512 BF16 or AMX), the autocast "
        "one takes minutes a step",
    )
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--steps", type=int, default=5, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=2, help="times each side runs, alternating")
    p.add_argument(
        "--baseline",
        metavar="REV",
        help="also float32 as minigpt trained at REV, a commit of this repository (e6bfc80: before mixed precision)",
    )
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    p.add_argument("--then-src", help=argparse.SUPPRESS)
    p.add_argument("--then-shape", help=argparse.SUPPRESS)
    p.add_argument("--preset", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.configs, args.warmup, args.steps, args.rounds = ["tutorial=2"], 1, 1, 1
    return args


def measure(args: argparse.Namespace) -> dict[str, dict[str, dict]]:
    """{config: {side: summary}}, the sides alternating within each round."""
    sides = [*SIDES[:2], *(s for s in SIDES[2:4] if args.nanogpt and s in args.nanogpt_sides)]
    sides += [THEN] if args.baseline else []
    raw: dict[str, dict[str, list]] = {}
    for config in args.configs:
        preset, _, batch = config.partition("=")
        shape = json.dumps(architecture(preset, int(batch), args.quick)) if args.baseline else ""
        for _ in range(args.rounds):
            for side in sides:
                if side.startswith("nanoGPT") and preset != "tutorial":
                    continue  # nanoGPT's model has the tutorial's block, not the cpu preset's
                argv = [__file__, "--child", side, "--preset", preset, "--batch", batch,
                        "--warmup", str(args.warmup), "--steps", str(args.steps), "--out", args.out,
                        *(["--nanogpt", args.nanogpt] if args.nanogpt else []), *(["--quick"] if args.quick else []),
                        *(["--then-src", args.then_src, "--then-shape", shape] if side == THEN else [])]  # fmt: skip
                result, why = run_child(argv)
                if result is None:
                    raise SystemExit(f"{config} {side} failed: {why}")
                print(
                    f"{config:>12} {side:>22}: {statistics.median(result['step_s']):.3f} s/step", flush=True
                )
                raw.setdefault(config, {}).setdefault(side, []).append(result)
    return {
        config: {side: summarise(runs) for side, runs in by_side.items()} for config, by_side in raw.items()
    }


def side_name(side: str, r: dict, args: argparse.Namespace) -> str:
    if side == THEN:
        return f"minigpt float32 at {args.baseline_commit[:7]}"
    return side + (f" ({r['raw'][0]['dtype']})" if side == "minigpt auto" else "")


def tables(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> list[dict]:
    rows = []
    for config, by_side in results.items():
        f32 = by_side["minigpt float32"]["tokens_per_s"]
        peer = by_side.get("nanoGPT bf16 autocast", {}).get("tokens_per_s")
        then = by_side.get(THEN, {}).get("tokens_per_s")
        for side, r in by_side.items():
            rows.append([config.replace("=", " batch "), side_name(side, r, args),
                         f"{r['step_s']:.3f}", f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / f32:.2f}x",
                         *([f"{r['tokens_per_s'] / then:.2f}x"] if args.baseline else []),
                         f"{r['tokens_per_s'] / peer:.2f}x" if peer else "-",
                         f"{r['mfu']:.1%}" if "mfu" in r else "-"])  # fmt: skip
    first = next(iter(next(iter(results.values())).values()))["raw"][0]
    note = (
        f"MFU against {first.get('peak_source')}. Rounds: {args.rounds} of {args.warmup} warmup + {args.steps} "
        "timed steps; median step."
    )
    then = [f"/ float32 at {args.baseline_commit[:7]}"] if args.baseline else []
    columns = ["preset, batch", "side", "median step s", "tokens/s", "/ minigpt float32", *then, "/ nanoGPT bf16",
               "MFU"]  # fmt: skip
    return [table(columns, rows, "Training throughput: mixed precision, float32, and nanoGPT in torch", note)]


def headlines(results: dict[str, dict[str, dict]], args: argparse.Namespace) -> list[str]:
    lines = []
    for config, by_side in results.items():
        auto, f32 = by_side["minigpt auto"], by_side["minigpt float32"]
        name = config.replace("=", " preset at batch ")
        text = (
            f"The {name} trains {auto['tokens_per_s']:,.0f} tokens/s with `--model.dtype auto` "
            f"({auto['raw'][0]['dtype']}), {auto['tokens_per_s'] / f32['tokens_per_s']:.2f}x float32"
        )
        if then := by_side.get(THEN):
            text += (
                f" ({auto['tokens_per_s'] / then['tokens_per_s']:.2f}x float32 at {args.baseline_commit[:7]})"
            )
        if "mfu" in auto:
            text += f", MFU {auto['mfu']:.0%} of this CPU's fastest matmul"
        if peer := by_side.get("nanoGPT bf16 autocast"):
            text += f"; {auto['tokens_per_s'] / peer['tokens_per_s']:.2f}x nanoGPT's model with bf16 autocast"
        lines.append(text)
    return lines


def main() -> None:
    args = parse_args()
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory(prefix="bench_speed_baseline_") as tmp:
        if args.baseline:
            args.baseline_commit = checkout_src(args.baseline, tmp)
            args.then_src = str(Path(tmp) / "src")
        results = measure(args)
    out = tables(results, args)
    print_tables(out)
    nano = next(
        (r["raw"][0] for by in results.values() for s, r in by.items() if s.startswith("nanoGPT")), None
    )
    code = {**code_version(), **({"nanogpt_commit": nano["commit"], "torch": nano["torch"]} if nano else {})}
    code.update({"baseline_commit": args.baseline_commit} if args.baseline else {})
    slim = {
        c: {s: {k: v for k, v in r.items() if k != "raw"} for s, r in by.items()} for c, by in results.items()
    }
    write_result(args, "bench_speed", "Mixed precision, float32 and nanoGPT: training throughput", out,
                 headlines=headlines(results, args), data=slim, code=code)  # fmt: skip


if __name__ == "__main__":
    main()
