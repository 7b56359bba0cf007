"""New tokens per second: minigpt's key/value-cache decoder against the seed tutorial's generation loop.

    python benchmarks/bench_generate.py                      # cpu + tutorial presets, batch 1 and 8
    python benchmarks/bench_generate.py --presets cpu --batches 1 --baseline-tokens 50
    python benchmarks/bench_generate.py --quick              # cpu preset, batch 1, a few tokens

Both sides decode with the same model and random parameters (speed does not depend on them); the prompt is
"Once upon a time" as GPT-2 ids (folded into the preset's vocabulary). End-of-text is disabled so every row
makes all its tokens. The seed tutorial's loop (seed_tutorial.generate_text) runs the whole model over a
max_seq_len buffer for every new token, from Python, one sequence at a time (it has no batch), so a batch of
B is B sequences in turn. Its cost per token does not depend on the position, so `--baseline-tokens`
(fewer than --new-tokens) gives the same rate in less time. Compilation is timed separately (first call
minus the fastest later call) and left out of the rates, which use the median of --repeats calls.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import seed_tutorial as seed
from common import parser, print_tables, table, write_result
from flax import nnx

from minigpt.config import PRESETS
from minigpt.inference.generate import SamplingConfig, generate_ids
from minigpt.nn.model import GPT, compute_dtype, decoding_params
from minigpt.training import hardware

PROMPT_GPT2_IDS = [7454, 2402, 257, 640]  # "Once upon a time"
VOCAB = {"cpu": 4096, "tutorial": 50257, "gpt2-124m": 50257}


def timed(fn: Callable[[], list[list[int]]], repeats: int) -> tuple[float, float, float, int]:
    """(first call seconds, fastest and median of `repeats` later calls, new tokens per call)."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()  # host lists: the work is finished
        runs.append(time.perf_counter() - t0)
    return first, min(runs), statistics.median(runs), sum(map(len, out))


def step_bytes(model: GPT, batch: int, position: float) -> float:
    """Bytes a decode step must read at `position` (tokens cached per row): every weight it uses as decoding
    keeps them (`decoding_params`: the projections' kernels in the compute dtype, norms and biases float32;
    the output layer's table in the compute dtype; of the input embeddings only the rows looked up, left
    out) and each row's keys and values so far."""
    cfg, (_, params) = model.cfg, nnx.split(model)
    leaves = jax.tree_util.tree_leaves_with_path(decoding_params(params, cfg))
    tables = ("wte", "wpe", "wve")
    weights = sum(x.nbytes for path, x in leaves if not any(getattr(k, "key", None) in tables for k in path))
    itemsize = jnp.dtype(compute_dtype(cfg)).itemsize
    if cfg.tie_embeddings:
        weights += cfg.padded_vocab * cfg.d_model * itemsize
    kv_per_token = 2 * cfg.n_layers * cfg.kv_heads * cfg.head_size * itemsize
    return weights + batch * position * kv_per_token


def bound_share(model: GPT, batch: int, prompt: int, new: int, rate: float) -> float | None:
    """New tokens/s as a share of what the device's memory bandwidth allows (None without a known figure)."""
    bandwidth = hardware.memory_bandwidth(jax.devices()[0].device_kind)
    if bandwidth is None:  # a CPU's device kind is "cpu": none in the table
        return None
    return rate / (batch * bandwidth / step_bytes(model, batch, prompt + new / 2))


def decoders(cfg, model: GPT, prompt: list[int], batch: int, args) -> dict[str, tuple[int, Callable]]:
    """{name: (new tokens per row, a call returning each row's new ids)} for both sides."""
    graphdef, params = nnx.split(model)
    sampling = SamplingConfig(
        num_samples=batch, max_new_tokens=args.new_tokens, temperature=args.temperature, top_k=args.top_k
    )
    cache = lambda: generate_ids(graphdef, params, prompt, sampling, eot_id=-1, max_seq_len=cfg.max_seq_len)
    seed.maxlen, seed.top_k = cfg.max_seq_len, args.top_k
    loop = lambda: [
        seed.generate_text(model, args.baseline_tokens, prompt, eot_id=-1)[len(prompt) :]
        for _ in range(batch)
    ]
    sides = {"minigpt kv-cache": (args.new_tokens, cache)}
    if args.baseline_tokens > 0:
        sides["seed tutorial loop"] = (args.baseline_tokens, loop)
    return sides


def main() -> None:
    p = parser(__doc__)
    accelerator = jax.default_backend() != "cpu"
    presets = ["cpu", "tutorial", *(["gpt2-124m"] if accelerator else [])]
    p.add_argument("--presets", nargs="+", default=presets, choices=sorted(VOCAB))
    p.add_argument("--batches", nargs="+", type=int, default=[1, 8, *([64] if accelerator else [])])
    p.add_argument("--new-tokens", type=int, default=200)
    p.add_argument("--baseline-tokens", type=int, default=30, help="tokens per seed-loop row (0: skip it)")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    if args.quick:
        args.presets, args.batches, args.new_tokens, args.baseline_tokens, args.repeats = (
            ["cpu"],
            [1],
            8,
            4,
            1,
        )
    rows, data = [], []
    for preset in args.presets:
        dtype, _ = hardware.compute_dtype(PRESETS[preset].model.dtype, jax.default_backend())  # as train does
        cfg = dataclasses.replace(PRESETS[preset].model, vocab_size=VOCAB[preset], dropout=0.0, dtype=dtype)
        model = GPT(cfg, nnx.Rngs(0))
        prompt = [t % cfg.vocab_size for t in PROMPT_GPT2_IDS]
        for batch in args.batches:
            rates = {}
            for name, (n, call) in decoders(cfg, model, prompt, batch, args).items():
                first, fastest, run, made = timed(call, args.repeats)
                rates[name] = made / run
                x = rates["minigpt kv-cache"] / rates[name]
                share = (
                    bound_share(model, batch, len(prompt), n, rates[name])
                    if name == "minigpt kv-cache"
                    else None
                )
                data.append({"preset": preset, "batch": batch, "decoder": name, "tokens": n, "dtype": dtype,
                             "compile_s": max(first - fastest, 0), "run_s": run, "tokens_per_s": rates[name],
                             "memory_bound_share": share})  # fmt: skip
                rows.append([preset, cfg.vocab_size, dtype, batch, name, n, f"{max(first - fastest, 0):.2f}",
                             f"{run:.3f}", f"{rates[name]:,.1f}", f"{x:.1f}x", "" if share is None else f"{share:.0%}"])  # fmt: skip
                print(" | ".join(map(str, rows[-1])), flush=True)
    columns = ["preset", "vocab", "dtype", "batch", "decoder", "new tokens per row", "compile s", "run s",
               "new tokens/s", "kv-cache x", "of memory bound"]  # fmt: skip
    note = (f"Median of {args.repeats} calls after a first one that compiles. Of memory bound: new tokens/s over "
            "what the device's vendor memory bandwidth allows when a step reads each weight once and each row's "
            "keys and values so far (accelerators only).")  # fmt: skip
    out = [table(columns, rows, note=note)]
    print_tables(out)
    by = {(d["preset"], d["batch"], d["decoder"]): d["tokens_per_s"] for d in data}
    headlines = [
        f"Generation with the key/value cache makes {by[pr, b, 'minigpt kv-cache']:,.0f} new tokens/s for the "
        f"{pr} preset at batch {b}, {by[pr, b, 'minigpt kv-cache'] / by[pr, b, 'seed tutorial loop']:.0f}x the "
        "seed tutorial's loop"
        for pr, b, name in by
        if name == "seed tutorial loop" and b == max(args.batches)
    ] + [
        f"On one {jax.devices()[0].device_kind}, the {d['preset']} preset decodes {d['tokens_per_s']:,.0f} new "
        f"tokens/s at batch {d['batch']}, {d['memory_bound_share']:.0%} of its memory bandwidth's bound"
        for d in data
        if d.get("memory_bound_share") is not None and d["batch"] == 1
    ]
    write_result(args, "bench_generate", "Generation speed", out, headlines=headlines, data=data)


if __name__ == "__main__":
    main()
