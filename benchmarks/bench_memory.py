"""Peak memory per training token with the chunked output layer (`model.loss_chunk`) and without it (0).

    python benchmarks/bench_memory.py        # tutorial 48, 16 x 256; gpt2-124m 2 x 256
    python benchmarks/bench_memory.py --presets tutorial --batches tutorial=144,48 --steps 2
    python benchmarks/bench_memory.py --quick  # tutorial 2 x 64 chunked, one step
    python benchmarks/bench_memory.py --presets gpt2-124m --batches gpt2-124m=2,1 --seq-len gpt2-124m=1024

Each configuration (preset, batch, loss chunk) runs in its own fresh Python process, so its peak resident
memory (`ru_maxrss`: Python, JAX, compilation, parameters, optimizer state and the step's activations) is its
own. A process builds the preset's train step at the given batch and sequence length (grad_accum 1; the
GPT-2 vocabulary, 50257 padded to 50304; the preset's compute dtype, bfloat16 for gpt2-124m, also on CPU),
compiles it ahead of time, reads XLA's `memory_analysis()` of the compiled step (temporaries, and
arguments: parameters, optimizer state and the batch) and runs --warmup + --steps steps on random tokens
(memory and speed do not depend on the data), reporting the median step time. gpt2-124m runs at sequence
256 by default (--seq-len gpt2-124m=1024 for its own) and small batches, so that it takes minutes on a CPU.
--dtype, --remat and --scan-layers override the presets' model (e.g. `--remat full --scan-layers`, to see
the output layer's share once the layers' activations are recomputed).

Every batch of --batches runs chunked (the preset's loss_chunk, or --loss-chunk) and, with `--unchunked all`
(the default), unchunked too, except where the unchunked batch x seq x vocab float32 logits (x5, roughly what
the step keeps of them and their gradients) would not fit in the memory available when it starts: the
tutorial preset at its own 144 x 256 needs ~36 GB unchunked, so on a 24 GB machine it runs chunked only
(--force runs it anyway).

Ratios, per preset: unchunked / chunked memory per training token (peak RSS, and XLA's temp + arguments) at
the same batch; the chunked run's largest batch against the unchunked run's largest; and the marginal memory
per token (the slope between the unchunked runs' smallest and largest batch, which leaves out what does not
grow with the batch: parameters, optimizer state, the runtime). Step time chunked / unchunked at the same
batch. Other processes share this machine's cores, so absolute times are noise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from common import code_version, parser, print_tables, report, run_child, table, write_result

from minigpt.config import REMAT_POLICIES

PRESET_NAMES = ("tutorial", "gpt2-124m")
GPT2_VOCAB = 50257
DEFAULT_BATCHES = ["tutorial=48,16", "gpt2-124m=2"]
DEFAULT_SEQ = ["gpt2-124m=256"]


def parse_map(items: list[str], cast, what: str) -> dict[str, list]:
    """['tutorial=144,48', 'gpt2-124m=4'] -> {'tutorial': [144, 48], 'gpt2-124m': [4]}."""
    out = {}
    for item in items:
        name, sep, values = item.partition("=")
        if not sep or name not in PRESET_NAMES or not values:
            raise SystemExit(
                f"{what} entries are PRESET=VALUE[,VALUE...] with PRESET in {PRESET_NAMES}: {item!r}"
            )
        out[name] = [cast(v) for v in values.split(",")]
    return out


def train_config(preset: str, batch: int, seq_len: int | None, loss_chunk: int | None, model_overrides: dict):
    """The preset at this batch and sequence length, grad_accum 1, GPT-2's vocabulary; `model_overrides`
    (dtype, remat, scan_layers) replace the preset's where not None."""
    from minigpt.config import PRESETS

    cfg = PRESETS[preset]
    overrides = {k: v for k, v in model_overrides.items() if v is not None}
    model = dataclasses.replace(cfg.model, vocab_size=GPT2_VOCAB, **overrides)
    if loss_chunk is not None:
        model = dataclasses.replace(model, loss_chunk=loss_chunk)
    data = cfg.data if seq_len is None else dataclasses.replace(cfg.data, seq_len=seq_len)
    return dataclasses.replace(cfg, batch_size=batch, grad_accum=1, model=model, data=data)


def child(args: argparse.Namespace) -> None:
    """Compile, analyse and time one configuration; print its measurements as one JSON line."""
    from minigpt.tools.bench import compile_step, time_steps

    preset, batch, seq, chunk, overrides = json.loads(args.child)
    cfg = train_config(preset, batch, seq, chunk, overrides)
    step = compile_step(cfg)
    m = step.xla.memory_analysis()
    m = m[0] if isinstance(m, list | tuple) else m
    times, metrics = time_steps(step, args.warmup, args.steps)
    report({
        "preset": preset,
        "dtype": cfg.model.dtype,
        "remat": cfg.model.remat + (", scanned" if cfg.model.scan_layers else ""),
        "batch": batch,
        "seq_len": cfg.data.seq_len,
        "loss_chunk": cfg.model.loss_chunk,
        "tokens_per_step": cfg.batch_size * cfg.data.seq_len,
        "compile_s": step.compile_s,
        "step_s": times,
        "xla_temp_bytes": int(m.temp_size_in_bytes),
        "xla_argument_bytes": int(m.argument_size_in_bytes),
        "xla_output_bytes": int(m.output_size_in_bytes),
        "xla_alias_bytes": int(m.alias_size_in_bytes),
        "loss": float(metrics["loss"]),
    })  # fmt: skip


def available_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def summarise(r: dict) -> dict:
    tokens = r["tokens_per_step"]
    step_s = statistics.median(r["step_s"])
    xla = r["xla_temp_bytes"] + r["xla_argument_bytes"]
    return {
        **r,
        "xla_bytes": xla,
        "step_s_median": step_s,
        "tokens_per_s": tokens / step_s,
        "peak_rss_gb": r["peak_rss_bytes"] / 1e9,
        "peak_rss_kb_per_token": r["peak_rss_bytes"] / 1e3 / tokens,
        "xla_temp_gb": r["xla_temp_bytes"] / 1e9,
        "xla_argument_gb": r["xla_argument_bytes"] / 1e9,
        "xla_kb_per_token": xla / 1e3 / tokens,
    }


def ratios(results: list[dict]) -> list[dict]:
    """Per preset, unchunked / chunked memory per token (peak RSS, and XLA's temp + arguments) and step time
    chunked / unchunked: at the same batch; the chunked run's largest batch against the unchunked run's
    largest; and the marginal memory per token (the slope between two batches, which leaves out what does not
    grow with the batch: parameters, optimizer state, the runtime) over the same two batches."""
    out = []
    for preset in dict.fromkeys(r["preset"] for r in results):
        rows = {(r["batch"], bool(r["loss_chunk"])): r for r in results if r["preset"] == preset}
        out += [{"preset": preset, **r} for r in _preset_ratios(rows)]
    return out


def _compare(compare: str, u: dict, c: dict, step: bool) -> dict:
    """Unchunked row `u` against chunked row `c` (per-token figures, or slopes)."""
    return {
        "compare": compare,
        "rss_per_token": u["peak_rss_kb_per_token"] / c["peak_rss_kb_per_token"],
        "xla_per_token": u["xla_kb_per_token"] / c["xla_kb_per_token"],
        "step_time": c["step_s_median"] / u["step_s_median"] if step else None,
    }


def _slope(lo: dict, hi: dict) -> dict:
    """Bytes per extra token between two batches, as KB/token figures `_compare` reads."""
    tokens = hi["tokens_per_step"] - lo["tokens_per_step"]
    return {
        "peak_rss_kb_per_token": (hi["peak_rss_bytes"] - lo["peak_rss_bytes"]) / 1e3 / tokens,
        "xla_kb_per_token": (hi["xla_bytes"] - lo["xla_bytes"]) / 1e3 / tokens,
    }


def _preset_ratios(rows: dict[tuple[int, bool], dict]) -> list[dict]:
    chunked = sorted(b for b, c in rows if c)
    unchunked = sorted(b for b, c in rows if not c)
    out = [
        _compare(f"same batch {b}", rows[b, False], rows[b, True], True) for b in unchunked if b in chunked
    ]
    if chunked and unchunked and chunked[-1] != unchunked[-1]:
        out.append(
            _compare(
                f"chunked at {chunked[-1]} vs unchunked at {unchunked[-1]}",
                rows[unchunked[-1], False],
                rows[chunked[-1], True],
                False,
            )
        )
    lo, hi = (unchunked[0], unchunked[-1]) if unchunked else (0, 0)
    if lo != hi and lo in chunked and hi in chunked:
        u, c = _slope(rows[lo, False], rows[hi, False]), _slope(rows[lo, True], rows[hi, True])
        out.append(_compare(f"marginal, batch {lo} -> {hi}", u, c, False))
    return out


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--presets", nargs="+", default=list(PRESET_NAMES), choices=PRESET_NAMES)
    p.add_argument(
        "--batches", nargs="+", default=DEFAULT_BATCHES, help="PRESET=B[,B...]: batch sizes, each run chunked"
    )
    p.add_argument(
        "--seq-len", nargs="*", default=DEFAULT_SEQ, help="PRESET=T: sequence length (default: the preset's)"
    )
    p.add_argument(
        "--unchunked",
        choices=("smallest", "all", "none"),
        default="all",
        help="which batches also run unchunked (loss_chunk 0), memory permitting",
    )
    p.add_argument(
        "--loss-chunk", type=int, default=None, help="chunked runs' loss_chunk (default: the preset's)"
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="compute dtype (default: the preset's)")
    p.add_argument("--remat", choices=REMAT_POLICIES, help="model.remat (default: the preset's, none)")
    p.add_argument(
        "--scan-layers",
        action="store_true",
        default=None,
        help="model.scan_layers (remat only saves memory on CPU with scanned layers)",
    )
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after compilation")
    p.add_argument("--steps", type=int, default=2, help="timed steps (their median is reported)")
    p.add_argument("--force", action="store_true", help="run unchunked configurations that look too big")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.presets, args.batches, args.seq_len, args.warmup, args.steps, args.unchunked = (
            ["tutorial"], ["tutorial=2"], ["tutorial=64"], 0, 1, "none"
        )  # fmt: skip
    if args.loss_chunk is not None and args.loss_chunk <= 0:
        p.error("--loss-chunk must be positive (unchunked runs are chosen with --unchunked)")
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def make_plan(args: argparse.Namespace) -> list[tuple[str, int, int | None, int | None]]:
    """(preset, batch, seq_len, loss_chunk) per configuration: every batch chunked, then unchunked ones."""
    batches = {**parse_map(DEFAULT_BATCHES, int, "--batches"), **parse_map(args.batches, int, "--batches")}
    seqs = {name: v[0] for name, v in parse_map(args.seq_len, int, "--seq-len").items()}
    plan = []
    for preset in args.presets:
        bs = sorted(set(batches[preset]), reverse=True)
        plan += [(preset, b, seqs.get(preset), args.loss_chunk) for b in bs]
        unchunked = {"smallest": bs[-1:], "all": bs, "none": []}[args.unchunked]
        plan += [(preset, b, seqs.get(preset), 0) for b in unchunked]
    return plan


def too_big(cfg: Any, batch: int) -> str | None:
    """Why an unchunked configuration would not fit in the memory available now, or None."""
    logits = batch * cfg.data.seq_len * cfg.model.padded_vocab * 4
    free = available_bytes()
    if free is not None and 5 * logits > free:
        return f"unchunked logits {logits / 1e9:.1f} GB x5 > {free / 1e9:.1f} GB available (--force runs it)"
    return None


def run_plan(args: argparse.Namespace) -> tuple[list[dict], list[dict]]:
    """Each configuration in its own process: the summaries of those that ran, and why the others did not."""
    overrides = {"dtype": args.dtype, "remat": args.remat, "scan_layers": args.scan_layers}
    results, skipped = [], []
    for preset, batch, seq, chunk in make_plan(args):
        cfg = train_config(preset, batch, seq, chunk, overrides)
        m = cfg.model
        label = (
            f"{preset} {batch} x {cfg.data.seq_len} {m.dtype} remat={m.remat} scan_layers={m.scan_layers} "
            f"loss_chunk={m.loss_chunk}"
        )
        why = None if chunk != 0 or args.force else too_big(cfg, batch)
        if why is None:
            print(f"running {label} ...", file=sys.stderr, flush=True)
            spec = json.dumps([preset, batch, seq, chunk, overrides])
            forwarded = ["--warmup", str(args.warmup), "--steps", str(args.steps), "--child", spec]
            result, why = run_child([__file__, *forwarded])
            if result is not None:
                results.append(summarise(result))
                continue
        print(f"not run: {label}: {why}", file=sys.stderr, flush=True)
        skipped.append({"config": label, "why": why.splitlines()[0]})
    return results, skipped


def _chunk(loss_chunk: int) -> str:
    return {0: "off", -1: "auto"}.get(loss_chunk, str(loss_chunk))


def tables(results: list[dict], skipped: list[dict], rs: list[dict]) -> list[dict]:
    rows = [
        [r["preset"], r["dtype"], r["remat"], f"{r['batch']} x {r['seq_len']}", _chunk(r["loss_chunk"]),
         f"{r['step_s_median']:.2f}", f"{r['tokens_per_s']:,.0f}", f"{r['peak_rss_gb']:.2f}",
         f"{r['peak_rss_kb_per_token']:.1f}", f"{r['xla_temp_gb']:.2f}", f"{r['xla_argument_gb']:.2f}",
         f"{r['xla_kb_per_token']:.1f}"]
        for r in results
    ]  # fmt: skip
    columns = ["preset", "dtype", "remat", "batch x seq", "loss chunk", "median step s", "tokens/s",
               "peak RSS GB", "peak RSS KB/token", "XLA temp GB", "XLA args GB", "XLA temp+args KB/token"]  # fmt: skip
    note = "".join(f"Not run: {s['config']}: {s['why']}. " for s in skipped)
    out = [table(columns, rows, "Each configuration in its own process", note.strip())]
    if rs:
        rows = [
            [r["preset"], r["compare"], f"{r['rss_per_token']:.2f}x", f"{r['xla_per_token']:.2f}x",
             "-" if r["step_time"] is None else f"{r['step_time']:.2f}x"]
            for r in rs
        ]  # fmt: skip
        columns = ["preset", "comparison", "peak RSS/token unchunked / chunked",
                   "XLA temp+args/token unchunked / chunked", "step time chunked / unchunked"]  # fmt: skip
        note = "Targets: memory per token unchunked / chunked >= 4x; step time chunked / unchunked <= 1.10x."
        out.append(table(columns, rows, "Unchunked against chunked", note))
    return out


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    code = code_version()  # what the children will import
    results, skipped = run_plan(args)
    rs = ratios(results)
    out = tables(results, skipped, rs)
    print_tables(out)
    same = [r for r in rs if r["compare"].startswith("same batch") and r["preset"] == "tutorial"]
    headlines = [
        f"The chunked output layer trains the tutorial preset in {1 / r['rss_per_token']:.2f}x the memory per "
        f"token of full logits ({r['compare']}), with step time {r['step_time']:.2f}x"
        for r in same[:1]
    ]
    data = {"results": results, "ratios": rs, "skipped": skipped}
    write_result(
        args, "bench_memory", "Memory per training token", out, headlines=headlines, data=data, code=code
    )


if __name__ == "__main__":
    main()
