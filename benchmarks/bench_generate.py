"""New tokens per second: the key/value-cache decoder against full recomputation (the previous decoder).

    python benchmarks/bench_generate.py                      # cpu + tutorial presets, batch 1 and 8
    python benchmarks/bench_generate.py --presets cpu --batches 1 --baseline-tokens 50

Parameters are random (speed does not depend on them); the prompt is "Once upon a time" as GPT-2 ids
(folded into the preset's vocabulary). End-of-text is disabled so every row makes all its tokens.
Compilation is timed separately (first call minus the fastest later call) and left out of the rates, which
use the median of --repeats calls.
The baseline recomputes the whole max_seq_len buffer for every token, so its cost per token does not depend
on the position and `--baseline-tokens` (fewer than --new-tokens) gives the same rate in less time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from pathlib import Path

import jax
from flax import nnx

from minigpt.config import PRESETS
from minigpt.inference.generate import generate_ids
from minigpt.model import GPT

# The reference decoder (no cache) lives with the tests, which check the cached one against it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from reference_decoder import generate_ids_full_recompute

PROMPT_GPT2_IDS = [7454, 2402, 257, 640]  # "Once upon a time"
VOCAB = {"cpu": 4096, "tutorial": 50257, "gpt2-124m": 50257}


def timed(fn, repeats: int) -> tuple[float, float, float]:
    """(first call seconds, fastest and median of `repeats` later calls)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return first, min(runs), statistics.median(runs)


def _run(fn, graphdef, params, prompt, kw, out) -> None:
    out[:] = fn(graphdef, params, prompt, **kw)  # returns host lists, so the work is finished


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presets", nargs="+", default=["cpu", "tutorial"], choices=sorted(PRESETS))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8])
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--baseline-tokens", type=int, default=200, help="tokens per baseline run (0: skip it)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()

    print(f"backend: {jax.default_backend()} ({jax.devices()[0].device_kind}), jax {jax.__version__}")
    header = f"{'preset':9} {'vocab':>6} {'batch':>5} {'decoder':>15} {'tokens':>6} {'compile s':>9} {'run s':>8} {'new tok/s':>10} {'cache x':>8}"
    print(header)
    print("-" * len(header))
    for preset in args.presets:
        cfg = dataclasses.replace(PRESETS[preset].model, vocab_size=VOCAB[preset], dropout=0.0)
        graphdef, params = nnx.split(GPT(cfg, nnx.Rngs(0)))
        prompt = [t % cfg.vocab_size for t in PROMPT_GPT2_IDS]
        for batch in args.batches:
            rates = {}
            for name, fn, n in (
                ("kv-cache", generate_ids, args.new_tokens),
                ("full-recompute", generate_ids_full_recompute, args.baseline_tokens),
            ):
                if n <= 0:
                    continue
                kw = {
                    "eot_id": -1,
                    "max_new_tokens": n,
                    "max_seq_len": cfg.max_seq_len,
                    "key": jax.random.PRNGKey(0),
                    "temperature": args.temperature,
                    "top_k": args.top_k,
                    "num_samples": batch,
                }
                out: list = []
                call = functools.partial(_run, fn, graphdef, params, prompt, kw, out)
                first, fastest, run = timed(call, args.repeats)
                made = sum(len(s) for s in out)
                rates[name] = made / run
                speedup = f"{rates['kv-cache'] / rates[name]:.1f}x" if name != "kv-cache" else ""
                print(
                    f"{preset:9} {cfg.vocab_size:>6} {batch:>5} {name:>15} {n:>6} {max(first - fastest, 0):>9.2f} "
                    f"{run:>8.3f} {rates[name]:>10.1f} {speedup:>8}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
