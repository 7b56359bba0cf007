"""Continued pretraining of an imported checkpoint with its own tokenizer: bits per byte on held-out text of a
new domain, before and after training on that domain.

The checkpoint: the cpu preset trained on TinyStories for --base-seconds, exported with `minigpt export
--format hf` (a transformers ApertusForCausalLM with its byte-level BPE as tokenizer.json), as one would
download an open model. Then `minigpt train --init-from` that folder on a Gutenberg book (the finetune preset,
--steps steps), its last tenth held out. Bits per byte of the held-out tenth and of TinyStories' validation
text, before (the checkpoint, imported) and after.

    python benchmarks/bench_continue.py              # a 120 s base, 100 steps on the book
    python benchmarks/bench_continue.py --quick      # a 15 s base, 10 steps
"""

from __future__ import annotations

import contextlib
import io
import tempfile
from pathlib import Path

from common import SHARED, need, parser, print_tables, table, write_result

BOOK = SHARED / "gutenberg" / "11-alices-adventures-in-wonderland.txt"
STORIES = SHARED / "tinystories"


def cli(*argv: str) -> str:
    """Run `minigpt ARGV` in this process; what it printed."""
    from minigpt.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(list(argv))
    return out.getvalue()


def bits_per_byte(run: Path, *texts: Path) -> list[float]:
    lines = [
        x
        for x in cli("eval", "--run", str(run), "--text", *map(str, texts)).splitlines()
        if "bits/byte (" in x
    ]
    return [float(x.split(": ")[1].split()[0]) for x in lines]


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--base-seconds", type=float, default=120)
    p.add_argument("--steps", type=int, default=100)
    args = p.parse_args()
    need(BOOK, STORIES / "train.txt", STORIES / "valid.txt")
    seconds, steps = (15, 10) if args.quick else (args.base_seconds, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        text = BOOK.read_text()
        cut = text.rfind("\n\n", 0, len(text) * 9 // 10)
        (tmp / "book.txt").write_text(text[:cut])
        (tmp / "held-out.txt").write_text(text[cut:])
        cache = ["--data.cache-dir", str(tmp / "cache")]
        cli("train", "--preset", "cpu", "--data", str(STORIES / "train.txt"), "--val-data", str(STORIES / "valid.txt"),
            "--max-time", str(seconds), "--run-dir", str(tmp / "base"), *cache)  # fmt: skip
        cli("export", "--run", str(tmp / "base"), "--format", "hf", "--out", str(tmp / "checkpoint"))
        cli("import", "--hf", str(tmp / "checkpoint"), "--out", str(tmp / "imported"))
        held = (tmp / "held-out.txt", STORIES / "valid.txt")
        before = bits_per_byte(tmp / "imported", *held)
        cli("train", "--init-from", str(tmp / "checkpoint"), "--data", str(tmp / "book.txt"), "--val-data",
            str(tmp / "held-out.txt"), "--steps", str(steps), "--run-dir", str(tmp / "continued"), *cache)  # fmt: skip
        after = bits_per_byte(tmp / "continued", *held)
    rows = [
        [f"{BOOK.name}, last tenth (held out)", f"{before[0]:.3f}", f"{after[0]:.3f}"],
        ["TinyStories validation text", f"{before[1]:.3f}", f"{after[1]:.3f}"],
    ]
    note = (f"The checkpoint: the cpu preset trained {seconds:g} s on TinyStories, exported as a transformers "
            f"folder; then `minigpt train --init-from` it on the book's first nine tenths for {steps} steps "
            "(the finetune preset).")  # fmt: skip
    tables = [
        table(
            ["bits per byte of", "imported checkpoint", f"after {steps} steps on the book"], rows, note=note
        )
    ]
    print_tables(tables)
    headlines = [
        f"Continued pretraining of an imported checkpoint with its own tokenizer: {before[0]:.3f} -> {after[0]:.3f} "
        f"bits per byte on held-out text of the new domain after {steps} steps"
    ]
    write_result(args, "bench_continue", "Continued pretraining", tables, headlines=headlines,
                 data={"before": before, "after": after, "base_seconds": seconds, "steps": steps})  # fmt: skip


if __name__ == "__main__":
    main()
