"""Fine-tuning on conversations against TRL's SFTTrainer (and PEFT for LoRA), side by side on one machine.

One Llama-architecture chat checkpoint built here with transformers (4 layers, d_model 256, GPT-2's
vocabulary size, a byte-level BPE and a ChatML template with {% generation %} blocks), and conversations of
varied length. Each configuration trains in its own fresh process, so its peak resident memory is its own:

  minigpt             `minigpt train --init-from` (dtype auto), whole examples packed into rows
  minigpt float32     the same in float32
  minigpt LoRA        rank 8 on every projection, alpha 16
  TRL                 SFTTrainer, assistant-only loss, no packing (padded batches), float32
  TRL bf16            the same with bf16 autocast
  PEFT LoRA (TRL)     PEFT's LoRA of the same rank, alpha and targets, trained by SFTTrainer

Both sides see about the same real tokens per step (TRL's 8 examples; minigpt's rows, as many as hold that
many tokens, rounded). Throughput is each side's own real (non-padding) tokens per second over the steady
steps (after the first few: compilation, warm-up). LoRA's checkpoint is compared with a full fine-tune's.

    python benchmarks/bench_sft.py            # 30 steps per configuration
    python benchmarks/bench_sft.py --quick    # 4 steps, a small model with a small vocabulary
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, parser, print_tables, report, run_child, skip, table, write_result

sys.path.insert(0, str(REPO))  # the checkpoint builder in fixtures/, which the tests use too

EXAMPLES, TRL_BATCH, SEQ = 256, 8, 512
CONFIGS = {
    "minigpt": [],
    "minigpt float32": ["--model.dtype", "float32"],
    "minigpt LoRA": ["--lora.rank", "8", "--lora.alpha", "16"],
    "TRL": [],
    "TRL bf16": [],
    "PEFT LoRA (TRL)": [],
}


def build(folder: Path, quick: bool) -> None:
    """The checkpoint and conversations (train.jsonl) in `folder`."""
    import random

    import torch
    import transformers

    from fixtures.checkpoints import GENERATION_CHATML, chat_checkpoint

    d, layers, vocab = (64, 2, 512) if quick else (256, 4, 50304)
    chat_checkpoint(folder / "checkpoint", (torch, transformers), template=GENERATION_CHATML, vocab_size=vocab,
                    hidden_size=d, intermediate_size=688 if not quick else 96, num_hidden_layers=layers,
                    num_attention_heads=8 if not quick else 4, num_key_value_heads=4 if not quick else 2,
                    max_position_embeddings=SEQ + 1)  # fmt: skip
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "saw", "big", "red", "ball", "dog", "park", "sun"]
    say = lambda n: " ".join(rng.choice(words) for _ in range(n)).capitalize() + "."
    lines = []
    for _ in range(EXAMPLES):
        turns = [{"role": "user", "content": say(rng.randint(4, 30))}]
        turns.append({"role": "assistant", "content": say(rng.randint(8, 150))})
        lines.append(json.dumps({"messages": turns}))
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")


def real_tokens(folder: Path) -> list[int]:
    """Each conversation's token count, as both sides tokenize it."""
    from minigpt.data.chat import example_tokens
    from minigpt.data.saved_tokenizer import open_pretrained

    tok = open_pretrained(folder / "checkpoint")
    records = [json.loads(line) for line in (folder / "train.jsonl").read_text().splitlines()]
    return [len(example_tokens(r, tok.chat_template(), tok).ids) for r in records]


def child_minigpt(folder: Path, name: str, steps: int, rows: int) -> None:
    from minigpt.app.initial import with_initial
    from minigpt.app.train import train
    from minigpt.commands.flags import parse_train
    from minigpt.data.build import prepare
    from minigpt.data.loader import train_rows

    run = folder / name.replace(" ", "-")
    args = ["--init-from", str(folder / "checkpoint"), "--data", str(folder / "train.jsonl"), "--data.seq-len",
            str(SEQ), "--data.cache-dir", str(folder / "cache"), "--batch-size", str(rows), "--steps",
            str(steps), "--log-every", "1", "--eval-every", "100000", "--max-epochs", "0", "--mesh.cpu-devices",
            "1", "--data.val-fraction", "0.02", "--run-dir", str(run), *CONFIGS[name]]  # fmt: skip
    cfg = with_initial(parse_train(args, "minigpt train"))
    train(cfg)
    store = prepare(cfg.data)  # the run's, built already: every stored token is an example's
    per_row = store.size("train") / train_rows(store, SEQ)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    ends = [m["elapsed_s"] for m in lines if m["kind"] == "train"]
    checkpoints = run / "checkpoints"
    size = sum(f.stat().st_size for f in checkpoints.rglob("*") if f.is_file()) / len(
        list(checkpoints.iterdir())
    )
    times = [b - a for a, b in itertools.pairwise(ends)]
    report({"step_times": times, "checkpoint_bytes": size, "tokens_per_step": rows * per_row})


def child_trl(folder: Path, name: str, steps: int) -> None:
    import datasets
    import torch
    import transformers
    import trl

    torch.set_num_threads(2)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder / "checkpoint", dtype=torch.float32)
    peft_config = None
    if name.startswith("PEFT"):
        import peft

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        peft_config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=targets, task_type="CAUSAL_LM")
    times: list[float] = []

    class Clock(transformers.TrainerCallback):
        def on_step_end(self, *args, **kwargs) -> None:
            times.append(time.perf_counter())

    args = trl.SFTConfig(
        output_dir=str(folder / "trl"), per_device_train_batch_size=TRL_BATCH, max_steps=steps, learning_rate=5e-5,
        logging_steps=1000, report_to="none", save_strategy="no", use_cpu=True, assistant_only_loss=True,
        packing=False, max_length=SEQ, bf16=name.endswith("bf16"), seed=0,
    )  # fmt: skip
    examples = [json.loads(x) for x in (folder / "train.jsonl").read_text().splitlines()]
    trainer = trl.SFTTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(examples), peft_config=peft_config,
        processing_class=transformers.AutoTokenizer.from_pretrained(folder / "checkpoint"), callbacks=[Clock()],
    )  # fmt: skip
    trainer.train()
    report({"step_times": [b - a for a, b in itertools.pairwise(times)]})


def measure(folder: Path, steps: int, rows: int) -> dict[str, dict]:
    out = {}
    for name in CONFIGS:
        argv = [
            __file__,
            "--child",
            name,
            "--folder",
            str(folder),
            "--steps",
            str(steps),
            "--rows",
            str(rows),
        ]
        result, why = run_child(argv)
        if result is None:
            raise SystemExit(f"{name} failed: {why}")
        out[name] = result
    return out


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--child", default="")
    p.add_argument("--folder", default="")
    p.add_argument("--rows", type=int, default=0)
    args = p.parse_args()
    if args.child:
        run = child_minigpt if args.child.startswith("minigpt") else child_trl
        extra = (args.rows,) if args.child.startswith("minigpt") else ()
        return run(Path(args.folder), args.child, args.steps, *extra)
    for module in ("torch", "transformers", "trl", "peft", "datasets"):
        try:
            __import__(module)
        except ImportError:
            skip(f"{module} is not installed (the test extras: pip install -e '.[test]')")
    steps = 4 if args.quick else args.steps
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        build(folder, args.quick)
        lengths = real_tokens(folder)
        mean = statistics.mean(lengths)
        rows = max(1, round(TRL_BATCH * mean / (SEQ + 1)))  # as many real tokens per step as TRL's batch
        results = measure(folder, steps, rows)
    summarize(args, results, mean, rows, steps)


def summarize(args, results: dict[str, dict], mean: float, rows: int, steps: int) -> None:
    skip_first = min(3, steps - 2)
    for r in results.values():
        r["step_s"] = statistics.median(r["step_times"][skip_first:])
        r.setdefault("tokens_per_step", TRL_BATCH * mean)  # TRL's: its examples' real tokens
        r["tokens_per_s"] = r["tokens_per_step"] / r["step_s"]
    base = results["TRL"]
    rows_out = [
        [name, f"{r['step_s'] * 1e3:.0f} ms", f"{r['tokens_per_step']:,.0f}", f"{r['tokens_per_s']:,.0f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x",
         f"{r['peak_rss_bytes'] / 2**30:.2f} GiB",
         f"{r['checkpoint_bytes'] / 2**20:.1f} MiB" if "checkpoint_bytes" in r else "-"]
        for name, r in results.items()
    ]  # fmt: skip
    columns = ["configuration", "step", "real tokens/step", "real tokens/s", "/ TRL float32", "peak RSS",
               "checkpoint"]  # fmt: skip
    note = (f"{EXAMPLES} conversations of {mean:.0f} tokens on average; TRL: {TRL_BATCH} examples per step, padded "
            f"to the longest; minigpt: {rows} packed rows of {SEQ + 1} tokens per step. Median step time after "
            f"the first {skip_first}, of {steps}.")  # fmt: skip
    tables = [table(columns, rows_out, note=note)]
    print_tables(tables)
    lora, full = results["minigpt LoRA"], results["minigpt"]
    headlines = [
        f"Fine-tuning on conversations: {results['minigpt']['tokens_per_s'] / base['tokens_per_s']:.1f}x TRL's "
        f"SFTTrainer's tokens/s on the same checkpoint, data, batch and machine; a LoRA checkpoint is "
        f"{lora['checkpoint_bytes'] / full['checkpoint_bytes']:.1%} of a full fine-tune's"
    ]
    write_result(args, "bench_sft", "Fine-tuning on conversations", tables, headlines=headlines, data=results)


if __name__ == "__main__":
    main()
