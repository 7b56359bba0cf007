"""lm-eval loglikelihood requests per second: the `minigpt` backend against lm-eval's own `hf` backend, on the
same model, the same requests and this machine's CPU.

    python benchmarks/bench_lm_eval.py                       # trains a 30-step cpu-preset model first
    python benchmarks/bench_lm_eval.py --run runs/cpu --items 250 --repeats 2
    python benchmarks/bench_lm_eval.py --run runs/cpu --hf-batches 1 32 64 --rolling-items 0
    python benchmarks/bench_lm_eval.py --quick               # a 2-step model, a few requests, one pass

The model is `--run` (a run directory or an export file), or else a cpu-preset model trained for 30 steps into
WORK/model (speed does not depend on how well it is trained). It is exported with `minigpt export --format hf`
into WORK/hf (kept when newer than the run), which lm-eval's `hf` backend loads in float32 on the CPU.

The workload is multiple choice like HellaSwag, built from TinyStories validation stories (seeded, never
written): --items items, each a story's first 40-60 words as context and 4 choices, the true next 15-25
words and three spans of as many words from other stories, so 4 `loglikelihood` requests per item. A second
workload (--rolling-items whole stories, `loglikelihood_rolling`, disjoint windows of the model's context)
is a second set of rows unless --rolling-items 0.

Each backend gets one untimed warm-up call first on a small subset (the shortest and the longest requests,
so minigpt compiles its smallest and largest length buckets there): its time is "first call s". Then the
full workload runs --repeats times, the backends taking turns, and the fastest pass counts. Backends: minigpt
at batch 32 (its default), hf at batch 1 (lm-eval's default) and at batch 32. Torch gets one thread per core
(torch.set_num_threads(os.cpu_count())) and XLA's CPU client uses every core by default, so neither side is
held back. Each hf row also shows the largest |difference| of its per-request log-likelihoods from
minigpt's and how many is_greedy flags agree: the speeds compare equal results. Other processes on the
machine make absolute times noise (the 1-minute load average before and after is printed): compare the
rows of one run. No network: the Hugging Face hub is set offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE).
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import contextlib
import importlib.metadata
import io
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import torch
from common import REPO, SHARED, need, parser, table, write_result
from lm_eval.api.instance import Instance

CONTEXT_WORDS, CHOICE_WORDS = (40, 60), (15, 25)


# ------------------------------------------------------------------------------------------------ workload


def read_stories(path: Path) -> list[str]:
    """The file's stories (separated by lines "<|endoftext|>"), whitespace-normalised; the first is left out,
    since the file may start in the middle of one."""
    stories = [" ".join(s.split()) for s in path.read_text().split("<|endoftext|>")[1:]]
    return [s for s in stories if s]


def build_items(stories: list[str], n: int, seed: int) -> list[dict[str, Any]]:
    """n multiple-choice items: a story's opening words, its true next words and three spans of other
    stories of as many words, shuffled (`gold` is the true one's place)."""
    rng = random.Random(seed)
    words = [s.split() for s in stories]
    need = CONTEXT_WORDS[1] + CHOICE_WORDS[1]
    order = [i for i in range(len(words)) if len(words[i]) >= need]
    rng.shuffle(order)
    if len(order) < n:
        raise SystemExit(f"only {len(order)} stories have {need}+ words; ask for fewer --items")
    items = []
    for i in order[:n]:
        c, k = rng.randint(*CONTEXT_WORDS), rng.randint(*CHOICE_WORDS)
        choices = [" ".join(words[i][c : c + k])]
        for j in rng.sample([j for j in order if j != i], 3):
            start = rng.randint(0, len(words[j]) - k)
            choices.append(" ".join(words[j][start : start + k]))
        perm = list(range(4))
        rng.shuffle(perm)
        items.append(
            {"context": " ".join(words[i][:c]), "choices": [choices[p] for p in perm], "gold": perm.index(0)}
        )
    return items


def mc_requests(items: list[dict[str, Any]]) -> list[Instance]:
    return [
        Instance(request_type="loglikelihood", doc={}, arguments=(it["context"], " " + choice), idx=k)
        for it in items
        for k, choice in enumerate(it["choices"])
    ]


def rolling_requests(stories: list[str], n: int, seed: int) -> list[Instance]:
    picked = random.Random(seed + 1).sample(stories, min(n, len(stories)))
    return [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(s,), idx=0) for s in picked]


def warmup_subset(requests: list[Instance], size: int) -> list[Instance]:
    """The size // 2 shortest and size - size // 2 longest requests (by characters)."""
    order = sorted(requests, key=lambda r: sum(len(a) for a in r.args))
    if size >= len(order):
        return order
    return order[: size // 2] + order[len(order) - (size - size // 2) :]


# ------------------------------------------------------------------------------------------------ the model


def newest_mtime(path: Path) -> float:
    if path.is_file():
        return path.stat().st_mtime
    return max((p.stat().st_mtime for p in path.rglob("*") if p.is_file()), default=0.0)


def minigpt_cmd(*args: str) -> None:
    cmd = [sys.executable, "-m", "minigpt.cli", *args]
    print(f"$ minigpt {' '.join(args)}", file=sys.stderr, flush=True)
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"minigpt {args[0]} failed:\n{out.stderr[-3000:]}")


def ensure_model(args: argparse.Namespace) -> tuple[Path, Path]:
    """(the run, its transformers export): trains OUT/model when no --run is given and none is there yet,
    exports into OUT/hf unless an export newer than the run is there."""
    out = Path(args.work)
    run = Path(args.run) if args.run else out / "model"
    if not args.run and not any((run / "checkpoints").glob("*")):
        data = str(Path(args.shared) / "tinystories" / "valid.txt")
        flags = ["--preset", "cpu", "--data", data, "--max-time", "0", "--steps", str(args.train_steps)]
        minigpt_cmd("train", *flags, "--run-dir", str(run), "--overwrite")
    hf = out / "hf"
    weights = hf / "model.safetensors"
    if not weights.exists() or weights.stat().st_mtime < newest_mtime(run):
        minigpt_cmd("export", "--run", str(run), "--format", "hf", "--out", str(hf), "--overwrite")
    return run, hf


def load_backends(run: Path, hf: Path, minigpt_batch: int, hf_batches: list[int]) -> dict[str, Any]:
    """{row name: lm-eval model}: minigpt first (the reference of the comparisons), then hf per batch size."""
    from lm_eval.models.huggingface import HFLM

    from minigpt.inference.harness import MiniGPTLM

    lms: dict[str, Any] = {
        f"minigpt b{minigpt_batch}": MiniGPTLM(run=str(run), batch_size=minigpt_batch, progress=False)
    }
    for b in hf_batches:
        lms[f"hf b{b}"] = HFLM(pretrained=str(hf), dtype="float32", device="cpu", batch_size=b)
    return lms


def describe_model(lms: dict[str, Any]) -> str:
    hf = next(lm for name, lm in lms.items() if name.startswith("hf"))
    c = hf.model.config
    n = sum(p.numel() for p in hf.model.parameters())
    return (
        f"{c.architectures[0]}: d_model {c.hidden_size}, {c.num_hidden_layers} layers, context "
        f"{hf.max_length}, vocab {c.vocab_size}, {n / 1e6:.2f}M parameters"
    )


# ------------------------------------------------------------------------------------------------ timing


def call(lm: Any, kind: str, requests: list[Instance]) -> list:
    """lm.loglikelihood or lm.loglikelihood_rolling on the requests, progress bars silenced (lm-eval's hf
    rolling path shows one per batch whatever disable_tqdm says)."""
    fn: Callable[..., list] = getattr(lm, kind)
    with contextlib.redirect_stderr(io.StringIO()):
        return fn(requests, disable_tqdm=True)


def measure(
    lms: dict[str, Any], kind: str, requests: list[Instance], warm: list[Instance], repeats: int
) -> dict:
    """Per backend: the warm-up call's seconds, every full pass's seconds, the fastest, requests per second
    from it, and the last pass's results. The backends take turns, in reverse order every other repeat."""
    stats: dict[str, dict[str, Any]] = {}
    for name, lm in lms.items():
        t0 = time.perf_counter()
        call(lm, kind, warm)
        stats[name] = {"first_call_s": time.perf_counter() - t0, "pass_s": []}
        print(f"{kind}: {name} warm-up {stats[name]['first_call_s']:.2f} s", file=sys.stderr, flush=True)
    for r in range(repeats):
        for name in list(lms)[:: -1 if r % 2 else 1]:
            t0 = time.perf_counter()
            stats[name]["results"] = call(lms[name], kind, requests)
            stats[name]["pass_s"].append(time.perf_counter() - t0)
            print(
                f"{kind}: {name} pass {r + 1} {stats[name]['pass_s'][-1]:.2f} s", file=sys.stderr, flush=True
            )
    for s in stats.values():
        s["best_s"] = min(s["pass_s"])
        s["requests_per_s"] = len(requests) / s["best_s"]
    return stats


def agreement(ref: list, other: list) -> dict[str, Any]:
    """Largest |log-likelihood difference| and, for (log-likelihood, is_greedy) results, agreeing flags."""
    pairs = list(zip(ref, other, strict=True))
    if pairs and isinstance(pairs[0][0], tuple):
        diffs = [abs(a[0] - b[0]) for a, b in pairs]
        greedy = sum(a[1] == b[1] for a, b in pairs)
    else:
        diffs, greedy = [abs(a - b) for a, b in pairs], None
    return {"max_abs_diff": max(diffs, default=0.0), "greedy_agree": greedy, "n": len(pairs)}


def accuracy(items: list[dict[str, Any]], results: list[tuple[float, bool]]) -> float:
    """Share of items whose highest-scoring choice (summed log-likelihood) is the true continuation."""
    hits = 0
    for i, it in enumerate(items):
        scores = [ll for ll, _ in results[4 * i : 4 * i + 4]]
        hits += scores.index(max(scores)) == it["gold"]
    return hits / len(items)


def summarise(stats: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Rows without the raw results: ratio of minigpt's rate to each row's and agreement with minigpt."""
    ref_name = next(iter(stats))
    ref = stats[ref_name]
    rows = {}
    for name, s in stats.items():
        row = {k: v for k, v in s.items() if k != "results"}
        row["minigpt_x"] = ref["requests_per_s"] / s["requests_per_s"]
        if name != ref_name:
            row.update(agreement(ref["results"], s["results"]))
        rows[name] = row
    return rows


# ------------------------------------------------------------------------------------------------ report


def workload_stats(lm: Any, kind: str, requests: list[Instance]) -> dict[str, Any]:
    """Requests, their mean length in tokens (context + continuation, or the whole text) and, for rolling
    requests, the number of context-sized windows they are scored in."""
    from minigpt.inference.scoring import rolling_windows

    tokens = [lm.tok_encode("".join(r.args)) for r in requests]
    row: dict[str, Any] = {"requests": len(requests), "mean_tokens": sum(map(len, tokens)) / len(tokens)}
    if kind == "loglikelihood_rolling":
        row["windows"] = sum(len(rolling_windows(t, lm.prefix_token_id, lm.max_length)) for t in tokens)
    return row


def versions() -> dict[str, str]:
    import transformers

    return {
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "lm_eval": importlib.metadata.version("lm_eval"),
    }


def results_table(results: dict[str, dict[str, Any]], note: str) -> dict:
    rows = []
    for kind, w in results.items():
        for name, r in w["rows"].items():
            diff = f"{r['max_abs_diff']:.2e}" if "max_abs_diff" in r else "-"
            greedy = "-" if r.get("greedy_agree") is None else f"{r['greedy_agree']}/{r['n']}"
            acc = f"{r['acc']:.3f}" if "acc" in r else "-"
            rows.append([kind, name, w["requests"], f"{r['first_call_s']:.2f}", f"{r['best_s']:.2f}",
                         f"{r['requests_per_s']:,.1f}", f"{r['minigpt_x']:.2f}x", diff, greedy, acc])  # fmt: skip
    columns = ["workload", "backend", "requests", "first call s", "best pass s", "requests/s", "minigpt x",
               "max abs diff vs minigpt", "is_greedy agree", "acc"]  # fmt: skip
    return table(columns, rows, note=note)


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--run", default="", help="minigpt run directory or export (default: train WORK/model)")
    p.add_argument("--items", type=int, default=100, help="multiple-choice items (4 requests each)")
    p.add_argument("--rolling-items", type=int, default=40, help="whole stories to score (0: skip)")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per backend; the fastest counts")
    p.add_argument("--warmup", type=int, default=64, help="requests in each backend's untimed first call")
    p.add_argument("--minigpt-batch", type=int, default=32)
    p.add_argument("--hf-batches", nargs="+", type=int, default=[1, 32])
    p.add_argument("--seed", type=int, default=0, help="picks the stories, spans and choice order")
    p.add_argument("--shared", default=str(SHARED), help="the shared data folder (tinystories/valid.txt)")
    p.add_argument("--work", default="runs/bench_lm_eval", help="folder for model/ and hf/")
    p.add_argument("--train-steps", type=int, default=30, help="steps of the model trained when no --run")
    args = p.parse_args()
    if args.quick:  # its model goes with its JSON, not into the folder of real runs
        args.items, args.rolling_items, args.repeats, args.warmup, args.hf_batches = 4, 2, 1, 2, [1]
        args.train_steps, args.work = 2, str(Path(args.out) / "bench_lm_eval_work")
    if args.items < 1 or args.repeats < 1 or args.warmup < 1 or not args.hf_batches:
        p.error("--items, --repeats and --warmup must be >= 1, and --hf-batches needs a batch size")
    return args


def main() -> None:
    args = parse_args()
    need(Path(args.shared) / "tinystories" / "valid.txt")
    torch.set_num_threads(os.cpu_count() or 1)
    load_before = os.getloadavg()[0]
    run, hf = ensure_model(args)
    stories = read_stories(Path(args.shared) / "tinystories" / "valid.txt")
    items = build_items(stories, args.items, args.seed)
    workloads = {"loglikelihood": mc_requests(items)}
    if args.rolling_items > 0:
        workloads["loglikelihood_rolling"] = rolling_requests(stories, args.rolling_items, args.seed)
    lms = load_backends(run, hf, args.minigpt_batch, args.hf_batches)
    ref = next(iter(lms.values()))
    results: dict[str, dict[str, Any]] = {}
    for kind, requests in workloads.items():
        stats = measure(lms, kind, requests, warmup_subset(requests, args.warmup), args.repeats)
        rows = summarise(stats)
        if kind == "loglikelihood":
            for name, s in stats.items():
                rows[name]["acc"] = accuracy(items, s["results"])
        results[kind] = {**workload_stats(ref, kind, requests), "rows": rows}
    write(args, describe_model(lms), results, load_before)


def write(
    args: argparse.Namespace, model: str, results: dict[str, dict[str, Any]], load_before: float
) -> None:
    """The table (with the model, the workloads and the software measured), the headline and the JSON."""
    env = {**versions(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    env["jax_devices"] = f"{len(jax.devices())} x {jax.devices()[0].device_kind}"
    env["load_average_1min"] = f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    summary = "; ".join(
        f"{kind}: {w['requests']} requests, {w['mean_tokens']:.1f} tokens each on average"
        + (f", {w['windows']} windows" if "windows" in w else "")
        for kind, w in results.items()
    )
    note = (
        f"Model: {model}. {summary}. Best of {args.repeats} passes; warm-up: {args.warmup} "
        f"requests (first call s). {', '.join(f'{k} {v}' for k, v in env.items())}."
    )
    tables = [results_table(results, note)]
    print("\n" + "\n".join(f"{k}: {v}" for k, v in env.items()))
    print(note)
    headlines = [
        f"lm-eval through minigpt's backend scores {kind} requests at {rows[hf]['minigpt_x']:.2f}x the rate "
        f"of lm-eval's own hf backend at its fastest ({hf}) on the same model"
        for kind, rows in ((kind, w["rows"]) for kind, w in results.items())
        for hf in [max((n for n in rows if n.startswith("hf")), key=lambda n: rows[n]["requests_per_s"])]
    ]
    data = {"args": vars(args), "env": env, "model": model, "results": results}
    write_result(
        args, "bench_lm_eval", "lm-eval: minigpt's backend against hf", tables, headlines=headlines, data=data
    )


if __name__ == "__main__":
    main()
