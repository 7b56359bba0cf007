"""The seed tutorial's train step against minigpt's `tutorial` preset: tokens/s, useful tokens/s and peak memory.

    python benchmarks/bench_seed.py          # batch 48 x 256; 2 rounds of 1 warmup + 3 timed steps per side
    python benchmarks/bench_seed.py --batch 16 --sides seed minigpt --rounds 1 --steps 5

Each side trains in its own fresh Python process, one after the other, so its peak resident memory
(`ru_maxrss`, everything the process ever held: Python, JAX, compilation, parameters, activations) is its own:

- `seed`: a faithful copy (below, flaws included) of the Flax NNX miniGPT tutorial that this project was
  seeded from (../shared/seeds/002_*.txt): its MiniGPT (nnx.Embed token + position embeddings, four post-norm
  blocks of nnx.MultiHeadAttention with a causal mask, LayerNorm(epsilon=1e-6), dropout 0.1 and a ReLU MLP of
  width 256, an nnx.Linear output layer over all 50257 GPT-2 tokens), its data (each TinyStories story
  tokenized with tiktoken's gpt2, cut to 256 tokens and right-padded with 0; targets are the tokens shifted
  left with a 0 appended, so it trains on the padding), its loss (cross-entropy averaged over every
  position), `nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)`, `nnx.MultiMetric(loss=Average)` and its
  `@nnx.jit(donate_argnums=(0, 1, 3))` train step. Left out: the sharding metadata and the mesh (this is
  one CPU device, where they would do nothing), pandas (its DataFrame round trip returns the same list) and
  text generation. The GPT-2 encoding is tiktoken's, built from the local vocab.bpe/encoder.json (no network).
- `minigpt`: the `tutorial` preset (the same model shape and optimizer) at the same batch and sequence length,
  grad_accum 1, the chunked output layer (`--loss-chunk`, default the preset's), trained on packed TinyStories
  windows: every target is real text.
- `minigpt-unchunked`: the same with `loss_chunk=0` (the full batch x seq x vocab float32 logits), for reference.

Tokens/s counts every position a step trains on; useful tokens/s only the targets that are real text (for the
seed: each row's real tokens minus one; the appended 0 and the padding are not text). Step times include the
loop's host work (fetching and preparing the batch) and wait for the step to finish. The sides run --rounds
times, alternating (seed, minigpt, minigpt-unchunked, seed, ...), each time in a fresh process whose first
--warmup steps (the first compiles) are not timed; rates use the median of all timed steps, and, since other
processes share this machine's cores, also the fastest one (the least disturbed). Absolute times are noise:
compare the sides, measured in the same run. Peak memory is the largest of a side's rounds. Results go to
--out as JSON, written atomically.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from child_process import code_version, describe, read_result, report

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
SIDES = ("seed", "minigpt", "minigpt-unchunked")


# ------------------------------------------------------------------------------------------------------------
# The seed tutorial, as written there (docs_nnx/examples/minigpt.md, Flax NNX), minus sharding metadata.

import grain.python as pygrain  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

tokenizer = None  # tiktoken.get_encoding("gpt2") in the tutorial; set by `run_seed` from the local files
maxlen = 256
embed_dim = 256
num_heads = 8
feed_forward_dim = 256
num_epochs = 1


class TransformerBlock(nnx.Module):
    """A single Transformer block: self-attention and a feed-forward network, each followed by dropout, a
    residual add and LayerNorm (post-norm)."""

    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1):
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=rate, rngs=rngs)
        self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)
        self.mlp = nnx.Sequential(
            nnx.Linear(in_features=embed_dim, out_features=ff_dim, rngs=rngs),
            nnx.relu,
            nnx.Linear(in_features=ff_dim, out_features=embed_dim, rngs=rngs),
            nnx.Dropout(rate=rate, rngs=rngs),
        )
        self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)

    def __call__(self, inputs):
        attention_output = self.mha(inputs_q=inputs, is_causal=True, decode=False)
        attention_output = self.dropout1(attention_output)
        out1 = self.layer_norm1(inputs + attention_output)
        ffn_output = self.mlp(out1)
        return self.layer_norm2(out1 + ffn_output)


class TokenAndPositionEmbedding(nnx.Module):
    """Token embeddings plus learned position embeddings."""

    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    def __call__(self, x):
        positions = jnp.arange(0, x.shape[1])[None, :]
        position_embedding = self.pos_emb(positions)
        token_embedding = self.token_emb(x)  # the tutorial adds out_sharding=jax.typeof(x).sharding
        return token_embedding + position_embedding


class MiniGPT(nnx.Module):
    """The tutorial's miniGPT (its sample_from / generate_step / generate_text are left out)."""

    def __init__(
        self,
        maxlen: int,
        vocab_size: int,
        embed_dim: int,
        num_heads: int,
        feed_forward_dim: int,
        num_transformer_blocks: int,
        rngs: nnx.Rngs,
    ):
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.Sequential(
            *[
                TransformerBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs)
                for _ in range(num_transformer_blocks)
            ]
        )
        self.output_layer = nnx.Linear(in_features=embed_dim, out_features=vocab_size, rngs=rngs)

    def __call__(self, inputs):
        x = self.embedding_layer(inputs)
        x = self.transformer_blocks(x)
        return self.output_layer(x)  # the tutorial reshards this to the inputs' sharding


def create_model(rngs):
    return MiniGPT(
        maxlen, tokenizer.n_vocab, embed_dim, num_heads, feed_forward_dim, num_transformer_blocks=4, rngs=rngs
    )


@dataclass
class TextDataset:
    data: list
    maxlen: int

    def __len__(self):
        return len(self.data)

    def __getitem__(self, idx: int):
        # Use Tiktoken for tokenization
        encoding = tokenizer.encode(self.data[idx], allowed_special={"<|endoftext|>"})[: self.maxlen]
        return encoding + [0] * (self.maxlen - len(encoding))  # Pad to maxlen


def load_and_preprocess_data(file_path, batch_size, maxlen):
    with open(file_path) as f:
        text = f.read()
    stories = text.split("<|endoftext|>")
    stories = [story + "<|endoftext|>" for story in stories if story.strip()]
    data = stories  # the tutorial: pd.DataFrame({"text": stories})["text"].dropna().tolist(), the same list
    dataset = TextDataset(data, maxlen)
    sampler = pygrain.IndexSampler(
        len(dataset), shuffle=False, seed=42, shard_options=pygrain.NoSharding(), num_epochs=num_epochs
    )
    dl = pygrain.DataLoader(
        data_source=dataset,
        sampler=sampler,
        operations=[pygrain.Batch(batch_size=batch_size, drop_remainder=True)],
    )
    return dl


def loss_fn(model, batch):
    logits = model(batch[0])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits=logits, labels=batch[1]).mean()
    return loss, logits


@nnx.jit(donate_argnums=(0, 1, 3))
def train_step(model: MiniGPT, optimizer: nnx.Optimizer, metrics: nnx.MultiMetric, batch):
    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (loss, logits), grads = grad_fn(model, batch)
    metrics.update(loss=loss, logits=logits, lables=batch[1])  # sic
    optimizer.update(model, grads)


# ------------------------------------------------------------------------------------------------------------


def run_seed(args: argparse.Namespace) -> dict:
    """The seed's training loop for --warmup + --steps batches, timing each step."""
    global tokenizer
    from minigpt.data.tokenizer import GPT2Tokenizer

    tokenizer = GPT2Tokenizer(args.gpt2_dir).enc  # tiktoken's gpt2 Encoding, with <|endoftext|> special
    batch_size = args.batch
    model = create_model(rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"))
    text_dl = iter(load_and_preprocess_data(args.data, batch_size, maxlen))
    prep_target_batch = jax.vmap(lambda tokens: jnp.concatenate((tokens[1:], jnp.array([0]))))

    # Useful targets per batch, outside the timed loop: the sampler walks the stories in order, and a row of
    # n real tokens has n - 1 real-text targets (the rest are padding, or the appended 0).
    with open(args.data) as f:
        stories = [s + "<|endoftext|>" for s in f.read().split("<|endoftext|>") if s.strip()]
    n_steps = args.warmup + args.steps
    if n_steps * batch_size > len(stories):
        sys.exit(f"{args.data} has {len(stories)} stories, fewer than {n_steps} batches of {batch_size}")
    useful = [
        sum(
            min(len(tokenizer.encode(stories[i], allowed_special={"<|endoftext|>"})), maxlen) - 1
            for i in range(s * batch_size, (s + 1) * batch_size)
        )
        for s in range(n_steps)
    ]

    times = []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        batch = next(text_dl)
        if len(batch) % len(jax.devices()) != 0:
            continue  # skip the remaining elements
        input_batch = jnp.stack(batch).T
        target_batch = prep_target_batch(input_batch)
        train_step(model, optimizer, metrics, (input_batch, target_batch))
        jax.block_until_ready((nnx.state(model), nnx.state(metrics)))
        times.append(time.perf_counter() - t0)
    return {
        "positions_per_step": batch_size * maxlen,
        "useful_per_step": useful[args.warmup :],
        "step_s": times,
        "loss": float(metrics.compute()["loss"]),
    }


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
    """minigpt's train step on packed windows for --warmup + --steps batches, timing each step."""
    from minigpt import sharding
    from minigpt.data.loader import train_iterator
    from minigpt.data.store import prepare
    from minigpt.training.trainer import build, init_state, make_train_step, resolve_model

    cfg = minigpt_config(args, loss_chunk)
    store = prepare(cfg.data)
    cfg = resolve_model(cfg, store.vocab_size, store.tokenizer().eot_id)
    setup = build(cfg)
    times = []
    with sharding.set_mesh(setup.mesh):
        state = init_state(setup)
        step = make_train_step(setup)
        it = train_iterator(store, cfg.data.seq_len, cfg.batch_size, seed=cfg.seed)
        for _ in range(args.warmup + args.steps):
            t0 = time.perf_counter()
            batch = sharding.global_batch(setup.mesh, next(it)[None], micro_batches=True)
            state, metrics = step(state, batch)
            jax.block_until_ready(metrics["loss"])
            times.append(time.perf_counter() - t0)
    tokens = cfg.batch_size * cfg.data.seq_len
    return {
        "positions_per_step": tokens,
        "useful_per_step": [tokens] * args.steps,  # packed windows: every target is text
        "step_s": times,
        "loss": float(metrics["loss"]),
        "loss_chunk": cfg.model.loss_chunk,
    }


def child(args: argparse.Namespace) -> None:
    if args.child == "seed":
        r = run_seed(args)
    else:
        r = run_minigpt(args, 0 if args.child == "minigpt-unchunked" else args.loss_chunk)
    report(r)


def summarise(side: str, runs: list[dict], warmup: int) -> dict:
    """Rates from the median timed step of all rounds (and from the fastest, the least disturbed by other
    processes); peak memory is the largest of the rounds."""
    timed = [t for r in runs for t in r["step_s"][warmup:]]
    median, fastest = statistics.median(timed), min(timed)
    positions = runs[0]["positions_per_step"]
    useful = statistics.mean(u for r in runs for u in r["useful_per_step"])
    return {
        "side": side,
        "first_step_s": [r["step_s"][0] for r in runs],
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sides", nargs="+", default=list(SIDES), choices=SIDES)
    p.add_argument("--batch", type=int, default=48, help="sequences per step (the tutorial's own is 144)")
    p.add_argument("--seq-len", type=int, default=256, help="minigpt's window; the seed's maxlen stays 256")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps first (the first one compiles)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument(
        "--rounds", type=int, default=2, help="times each side runs, alternating, in a fresh process"
    )
    p.add_argument(
        "--loss-chunk", type=int, default=None, help="minigpt's loss_chunk (default: the preset's)"
    )
    p.add_argument("--data", default=str(SHARED / "tinystories" / "train.txt"))
    p.add_argument("--val-data", default=str(SHARED / "tinystories" / "valid.txt"))
    p.add_argument("--gpt2-dir", default=str(SHARED / "gpt2"))
    p.add_argument("--cache-dir", default="~/.cache/minigpt", help="minigpt's token cache")
    p.add_argument("--out", default="runs/bench_seed/results.json")
    p.add_argument("--child", choices=SIDES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
        p.error("--warmup, --steps and --rounds must be >= 1")
    code = code_version()  # what the children will import
    if any(s.startswith("minigpt") for s in args.sides):  # tokenize once, here, so no child pays for it
        from minigpt.data.store import prepare

        prepare(minigpt_config(args, None).data)

    forwarded = sys.argv[1:]
    raw: dict[str, list[dict]] = {side: [] for side in args.sides}
    for round_ in range(args.rounds):  # rounds alternate the sides, so each sees the machine's load
        for side in args.sides:
            print(f"round {round_ + 1}/{args.rounds}: running {side} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(
                [sys.executable, __file__, *forwarded, "--child", side], stdout=subprocess.PIPE, text=True
            )
            result = read_result(proc.stdout)
            if proc.returncode or result is None:
                sys.exit(f"{side} failed (exit status {proc.returncode}):\n{proc.stdout[-2000:]}")
            raw[side].append(result)
    results = {side: summarise(side, runs, args.warmup) for side, runs in raw.items()}

    print(
        f"\nbatch {args.batch} x seq 256 (seed) / {args.seq_len} (minigpt), {args.rounds} rounds of "
        f"{args.warmup} warmup + {args.steps} timed steps, jax {jax.__version__} on {jax.default_backend()}, "
        f"{describe(code)}\n"
    )
    print(
        "| side | loss chunk | median step s | fastest step s | tokens/s | useful tokens/s | useful share | "
        "peak RSS GB |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results.values():
        chunk = "-" if r["loss_chunk"] is None else ("off" if r["loss_chunk"] == 0 else str(r["loss_chunk"]))
        print(
            f"| {r['side']} | {chunk} | {r['step_s']:.2f} | {r['fastest_step_s']:.2f} | {r['tokens_per_s']:,.0f} | "
            f"{r['useful_tokens_per_s']:,.0f} | {r['useful_share']:.0%} | {r['peak_rss_gb']:.2f} |"
        )
    print("(tokens/s and useful tokens/s from the median step)")
    ratios = {}
    if "seed" in results:
        seed = results["seed"]
        print("\n| side / seed | useful tokens/s (median step) | (fastest step) | peak RSS |")
        print("|---|---:|---:|---:|")
        for side in ("minigpt", "minigpt-unchunked"):
            if side in results:
                r = results[side]
                ratios[side] = {
                    "useful_tokens_per_s": r["useful_tokens_per_s"] / seed["useful_tokens_per_s"],
                    "useful_tokens_per_s_fastest": r["useful_tokens_per_s_fastest"]
                    / seed["useful_tokens_per_s_fastest"],
                    "peak_rss": r["peak_rss_gb"] / seed["peak_rss_gb"],
                }
                x = ratios[side]
                print(
                    f"| {side} | {x['useful_tokens_per_s']:.2f}x | {x['useful_tokens_per_s_fastest']:.2f}x | "
                    f"{x['peak_rss']:.2f}x |"
                )
        print(
            "\ntargets (minigpt, chunked): useful tokens/s >= 2x the seed's; peak memory <= 0.5x the seed's"
        )

    from minigpt import files

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in vars(args).items() if k != "child"}
    files.write_json(out, {"args": config, "code": code, "results": results, "ratios": ratios})
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
