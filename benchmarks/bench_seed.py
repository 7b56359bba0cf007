"""The seed tutorial's train step against minigpt's `tutorial` preset: tokens/s, useful tokens/s and peak memory.

    python benchmarks/bench_seed.py          # batch 16 x 256; 1 warmup + 3 timed steps per side
    python benchmarks/bench_seed.py --batch 48 --sides seed minigpt --rounds 2 --steps 5
    python benchmarks/bench_seed.py --quick  # seed and minigpt, batch 2 x 64, one timed step

Each side trains in its own fresh Python process, one after the other, so its peak resident memory
(`ru_maxrss`, everything the process ever held: Python, JAX, compilation, parameters, activations) is its own:

- `seed`: the Flax NNX miniGPT tutorial that this project was seeded from, as written there
  (seed_tutorial.py, flaws included): its MiniGPT (nnx.Embed token + position embeddings, four post-norm
  blocks of nnx.MultiHeadAttention with a causal mask, LayerNorm(epsilon=1e-6), dropout 0.1 and a ReLU MLP of
  width 256, an nnx.Linear output layer over all 50257 GPT-2 tokens), its data (each TinyStories story
  tokenized with tiktoken's gpt2, cut to 256 tokens and right-padded with 0; targets are the tokens shifted
  left with a 0 appended, so it trains on the padding), its loss (cross-entropy averaged over every
  position), `nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)`, `nnx.MultiMetric(loss=Average)` and its
  `@nnx.jit(donate_argnums=(0, 1, 3))` train step. The GPT-2 encoding is tiktoken's, built from the local
  vocab.bpe/encoder.json (no network).
- `minigpt`: the `tutorial` preset (the same model shape and optimizer) at the same batch and sequence length,
  grad_accum 1, the chunked output layer (`--loss-chunk`, default the preset's), its compute dtype (auto: the
  one this machine trains fastest in) and malloc set as the `minigpt` program sets it, trained on packed
  TinyStories windows: every target is real text.
- `minigpt-unchunked`: the same with `loss_chunk=0` (the full batch x seq x vocab float32 logits), for reference.

Tokens/s counts every position a step trains on; useful tokens/s only the targets that are real text (for the
seed: each row's real tokens minus one; the appended 0 and the padding are not text). Step times include the
loop's host work (fetching and preparing the batch) and wait for the step to finish. The sides run --rounds
times, alternating (seed, minigpt, minigpt-unchunked, seed, ...), each time in a fresh process whose first
--warmup steps are not timed (the seed compiles in its first step, minigpt ahead of them); rates use the
median of all timed steps, and, since other processes share this machine's cores, also the fastest one (the
least disturbed). Absolute times are noise: compare the sides, measured in the same run. Peak memory is the
largest of a side's rounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import seed_tutorial as seed
from common import SHARED, code_version, need, parser, print_tables, report, run_child, table, write_result
from flax import nnx

SIDES = ("seed", "minigpt", "minigpt-unchunked")


def run_seed(args: argparse.Namespace) -> dict:
    """The seed's training loop for --warmup + --steps batches, timing each step."""
    from minigpt.data.tokenizer import GPT2Tokenizer

    seed.tokenizer = GPT2Tokenizer(args.gpt2_dir).enc  # tiktoken's gpt2 Encoding, with <|endoftext|> special
    seed.maxlen = args.seed_len
    batch_size = args.batch
    model = seed.create_model(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    text_dl = iter(seed.load_and_preprocess_data(args.data, batch_size, seed.maxlen))
    prep_target_batch = jax.vmap(lambda tokens: jnp.concatenate((tokens[1:], jnp.array([0]))))

    n_steps = args.warmup + args.steps
    useful = useful_targets(args.data, batch_size, n_steps)
    times = []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        batch = next(text_dl)
        if len(batch) % len(jax.devices()) != 0:
            continue  # skip the remaining elements
        input_batch = jnp.stack(batch).T
        target_batch = prep_target_batch(input_batch)
        seed.train_step(model, optimizer, metrics, (input_batch, target_batch))
        jax.block_until_ready((nnx.state(model), nnx.state(metrics)))
        times.append(time.perf_counter() - t0)
    return {
        "positions_per_step": batch_size * seed.maxlen,
        "useful_per_step": useful[args.warmup :],
        "first_step_s": times[0],
        "step_s": times[args.warmup :],
        "loss": float(metrics.compute()["loss"]),
    }


def useful_targets(path: str, batch_size: int, n_steps: int) -> list[int]:
    """Real-text targets per seed batch: the sampler walks the stories in order, and a row of n real tokens
    has n - 1 real-text targets (the rest are padding, or the appended 0)."""
    with open(path) as f:
        stories = [s + "<|endoftext|>" for s in f.read().split("<|endoftext|>") if s.strip()]
    if n_steps * batch_size > len(stories):
        sys.exit(f"{path} has {len(stories)} stories, fewer than {n_steps} batches of {batch_size}")
    encode = lambda s: seed.tokenizer.encode(s, allowed_special={"<|endoftext|>"})
    return [
        sum(
            min(len(encode(stories[i])), seed.maxlen) - 1 for i in range(s * batch_size, (s + 1) * batch_size)
        )
        for s in range(n_steps)
    ]


def minigpt_config(args: argparse.Namespace, loss_chunk: int | None):
    from minigpt.config import PRESETS

    cfg = PRESETS["tutorial"]
    model = cfg.model if loss_chunk is None else dataclasses.replace(cfg.model, loss_chunk=loss_chunk)
    data = dataclasses.replace(
        cfg.data,
        paths=(args.data,),
        val_paths=(args.val_data,) if args.val_data else (),
        seq_len=args.seq_len,
        gpt2_dir=args.gpt2_dir,
        cache_dir=args.cache_dir,
    )
    return dataclasses.replace(cfg, batch_size=args.batch, grad_accum=1, model=model, data=data)


def run_minigpt(args: argparse.Namespace, loss_chunk: int | None) -> dict:
    """minigpt's train step on packed windows for --warmup + --steps batches, timing each step with the
    loader's work in it, as the seed's loop is timed."""
    from minigpt.data.build import prepare
    from minigpt.data.loader import train_iterator
    from minigpt.parallel import sharding
    from minigpt.tools.bench import compile_step, time_steps
    from minigpt.training.trainer import resolve_model

    cfg = minigpt_config(args, loss_chunk)
    store = prepare(cfg.data)
    cfg = resolve_model(cfg, store.vocab_size, store.tokenizer().eot_id)
    step = compile_step(cfg)
    it = train_iterator(store, cfg.data.seq_len, cfg.batch_size, seed=cfg.seed)
    next_batch = lambda: sharding.global_batch(step.setup.mesh, next(it)[None], micro_batches=True)
    times, metrics = time_steps(step, args.warmup, args.steps, next_batch)
    tokens = cfg.batch_size * cfg.data.seq_len
    return {
        "positions_per_step": tokens,
        "useful_per_step": [tokens] * args.steps,  # packed windows: every target is text
        "step_s": times,
        "loss": float(metrics["loss"]),
        "loss_chunk": cfg.model.loss_chunk,
        "first_step_s": step.compile_s,
    }


def child(args: argparse.Namespace) -> None:
    if args.child == "seed":
        r = run_seed(args)
    else:
        from minigpt.runtime import allocator

        allocator.keep_freed_memory()  # as the minigpt program does, before JAX starts
        r = run_minigpt(args, 0 if args.child == "minigpt-unchunked" else args.loss_chunk)
    report(r)


def summarise(side: str, runs: list[dict]) -> dict:
    """Rates from the median timed step of all rounds (and from the fastest, the least disturbed by other
    processes); peak memory is the largest of the rounds."""
    timed = [t for r in runs for t in r["step_s"]]
    median, fastest = statistics.median(timed), min(timed)
    positions = runs[0]["positions_per_step"]
    useful = statistics.mean(u for r in runs for u in r["useful_per_step"])
    return {
        "side": side,
        "first_step_s": [r["first_step_s"] for r in runs],
        "step_s": median,
        "fastest_step_s": fastest,
        "tokens_per_s": positions / median,
        "useful_tokens_per_s": useful / median,
        "useful_tokens_per_s_fastest": useful / fastest,
        "useful_share": useful / positions,
        "peak_rss_gb": max(r["peak_rss_bytes"] for r in runs) / 1e9,
        "loss": runs[-1]["loss"],
        "loss_chunk": runs[0].get("loss_chunk"),
        "raw": runs,
    }


def parse_args() -> argparse.Namespace:
    p = parser(__doc__)
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--batch", type=int, default=16, help="sequences per step (the tutorial's own is 144)")
    p.add_argument("--seq-len", type=int, default=256, help="minigpt's window")
    p.add_argument("--seed-len", type=int, default=256, help="the seed's maxlen (the tutorial's is 256)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (the seed's first compiles)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument(
        "--rounds", type=int, default=1, help="times each side runs, alternating, in a fresh process"
    )
    p.add_argument(
        "--loss-chunk", type=int, default=None, help="minigpt's loss_chunk (default: the preset's)"
    )
    p.add_argument("--data", default=str(SHARED / "tinystories" / "train.txt"))
    p.add_argument("--val-data", default=str(SHARED / "tinystories" / "valid.txt"))
    p.add_argument("--gpt2-dir", default=str(SHARED / "gpt2"))
    p.add_argument("--cache-dir", default="~/.cache/minigpt", help="minigpt's token cache")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.batch, args.seq_len, args.seed_len, args.steps, args.rounds = 2, 64, 64, 1, 1
        args.sides = [s for s in args.sides if s != "minigpt-unchunked"]
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--warmup, --steps and --rounds must be >= 1")
    return args


def ratios(results: dict[str, dict]) -> dict[str, dict]:
    """minigpt's sides against the seed's: useful tokens/s (median and fastest step) and peak memory."""
    if "seed" not in results:
        return {}
    s = results["seed"]
    return {
        side: {
            "useful_tokens_per_s": r["useful_tokens_per_s"] / s["useful_tokens_per_s"],
            "useful_tokens_per_s_fastest": r["useful_tokens_per_s_fastest"]
            / s["useful_tokens_per_s_fastest"],
            "peak_rss": r["peak_rss_gb"] / s["peak_rss_gb"],
        }
        for side, r in results.items()
        if side != "seed"
    }


def tables(args: argparse.Namespace, results: dict[str, dict], x: dict[str, dict]) -> list[dict]:
    chunk = lambda r: "-" if r["loss_chunk"] is None else (r["loss_chunk"] or "off")
    rows = [
        [r["side"], chunk(r), f"{max(r['first_step_s']):.1f}", f"{r['step_s']:.2f}", f"{r['fastest_step_s']:.2f}",
         f"{r['tokens_per_s']:,.0f}", f"{r['useful_tokens_per_s']:,.0f}", f"{r['useful_share']:.0%}",
         f"{r['peak_rss_gb']:.2f}"]
        for r in results.values()
    ]  # fmt: skip
    columns = ["side", "loss chunk", "first step / compile s", "median step s", "fastest step s", "tokens/s",
               "useful tokens/s", "useful share", "peak RSS GB"]  # fmt: skip
    title = (
        f"Batch {args.batch} x {args.seed_len} (seed) / {args.seq_len} (minigpt), {args.rounds} round(s) of "
        f"{args.warmup} warmup + {args.steps} timed steps"
    )
    out = [table(columns, rows, title, "tokens/s and useful tokens/s from the median step.")]
    if x:
        rows = [
            [side, f"{v['useful_tokens_per_s']:.2f}x", f"{v['useful_tokens_per_s_fastest']:.2f}x", f"{v['peak_rss']:.2f}x"]
            for side, v in x.items()
        ]  # fmt: skip
        columns = ["side / seed", "useful tokens/s (median step)", "(fastest step)", "peak RSS"]
        note = "Targets (minigpt, chunked): useful tokens/s >= 2x the seed's; peak memory <= 0.5x the seed's."
        out.append(table(columns, rows, "Against the seed tutorial", note))
    return out


def main() -> None:
    args = parse_args()
    if args.child:
        child(args)
        return
    need(Path(args.data), Path(args.gpt2_dir))
    code = code_version()  # what the children will import
    if any(s.startswith("minigpt") for s in args.sides):  # tokenize once, here, so no child pays for it
        from minigpt.data.build import prepare

        prepare(minigpt_config(args, None).data)
    forwarded = sys.argv[1:]
    raw: dict[str, list[dict]] = {side: [] for side in args.sides}
    for round_ in range(args.rounds):  # rounds alternate the sides, so each sees the machine's load
        for side in args.sides:
            print(f"round {round_ + 1}/{args.rounds}: running {side} ...", file=sys.stderr, flush=True)
            result, why = run_child([__file__, *forwarded, "--child", side])
            if result is None:
                sys.exit(f"{side} failed: {why}")
            raw[side].append(result)
    results = {side: summarise(side, runs) for side, runs in raw.items()}
    x = ratios(results)
    out = tables(args, results, x)
    print_tables(out)
    headlines = [
        f"minigpt's `tutorial` preset trains {x['minigpt']['useful_tokens_per_s']:.1f}x the seed tutorial's "
        f"useful tokens/s in {x['minigpt']['peak_rss']:.2f}x its memory"
    ] if "minigpt" in x else []  # fmt: skip
    data = {"args": {k: v for k, v in vars(args).items() if k != "child"}, "results": results, "ratios": x}
    write_result(
        args,
        "bench_seed",
        "Training step against the seed tutorial",
        out,
        headlines=headlines,
        data=data,
        code=code,
    )


if __name__ == "__main__":
    main()
