"""Evaluation of a trained model: what `minigpt eval` reports and the training loop's validation.

Three measures, each of a run directory or an export file:
  - loss and bits per byte on the validation split of the run's own data (`evaluate`: every source of a
    mixture on its own and all of them together), the figure training reports;
  - bits per byte of any text files (`scoring.text_bits_per_byte`, over windows of the model's context);
  - lm-evaluation-harness tasks (`harness`), printed as lm-eval's table and saved as JSON. lm-eval is an
    optional dependency: `import_harness` imports it, or says in one line how to install it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import jax

from minigpt.config import ConfigError, EvalConfig
from minigpt.data.chat import Example, example_tokens, is_conversation, show_example
from minigpt.data.loader import eval_batches
from minigpt.data.mixture import Corpus, prepare_corpus
from minigpt.data.store import TokenStore
from minigpt.data.tokenizer import check_document, dummy_tables
from minigpt.inference.scoring import Scorer, assistant_loss, text_bits_per_byte, total_bits_per_byte
from minigpt.parallel import sharding
from minigpt.runtime import files
from minigpt.training.metrics import bits_per_byte
from minigpt.training.runs import (
    check_data,
    check_sources,
    load_model,
    recorded_extent,
    run_config,
    run_tokenizer,
)
from minigpt.training.trainer import Setup, make_eval_step

INSTALL_EVAL = "pip install -e '.[eval]' (in the minigpt folder)"


def evaluate(
    setup: Setup, eval_step_fn: Any, params: Any, corpus: Corpus, max_batches: int = 0
) -> dict[str, float]:
    """Validation loss (nats/token) and bits per byte over the validation split in a fixed order: of every
    source of a mixture ("loss/NAME", "bpb/NAME") and of all of them together (tokens and bytes summed)."""
    out: dict[str, float] = {}
    grand = dict.fromkeys(("nll", "tokens", "nll_bytes", "bytes"), 0.0)
    for part in corpus.parts:
        totals = _eval_totals(setup, eval_step_fn, params, part.store, max_batches)
        if corpus.is_mixture:
            out |= {f"loss/{part.name}": totals["nll"] / totals["tokens"]}
            out |= {f"bpb/{part.name}": bits_per_byte(totals["nll_bytes"], totals["bytes"])}
        grand = {k: grand[k] + totals[k] for k in grand}
    return {
        "loss": grand["nll"] / grand["tokens"],
        "bpb": bits_per_byte(grand["nll_bytes"], grand["bytes"]),
        "tokens": grand["tokens"],
        **out,
    }


def _eval_totals(
    setup: Setup, eval_step_fn: Any, params: Any, store: TokenStore, max_batches: int
) -> dict[str, float]:
    cfg = setup.cfg
    totals = dict.fromkeys(("nll", "tokens", "nll_bytes", "bytes"), 0.0)
    batches = eval_batches(store, cfg.data.seq_len, cfg.batch_size, jax.process_index(), jax.process_count())
    for i, (tokens, weight) in enumerate(batches):
        if max_batches and i >= max_batches:
            break
        out = eval_step_fn(
            params, sharding.global_batch(setup.mesh, tokens), sharding.global_batch(setup.mesh, weight)
        )
        for k, v in jax.device_get(out).items():
            totals[k] += float(v)
    return totals


def format_validation(result: dict[str, float]) -> str:
    """'val loss L | val bits/byte B', then each source's bits per byte when the data is a mixture."""
    per_source = "".join(f" | {k} {v:.4f}" for k, v in result.items() if k.startswith("bpb/"))
    return f"val loss {result['loss']:.4f} | val bits/byte {result['bpb']:.4f}{per_source}"


def validation(run: str, max_batches: int = 0) -> tuple[int, dict[str, float]]:
    """(step, `evaluate`'s figures) of a run directory or export file on its own data's validation split.
    A source file changed since training, or a tokenizer other than the data's, is refused: the loss would
    not be the run's."""
    setup, params, tokenizer, step = load_model(run)
    if Path(run).is_dir():
        check_sources(Path(run))  # before tokenizing: a changed file is refused, not re-tokenized
    corpus = prepare_corpus(setup.cfg.data, extent=recorded_extent(Path(run)) or None)  # what it read
    made_with = corpus.first.meta["tokenizer_identity"]
    if made_with != tokenizer.identity:
        raise ConfigError(
            f"{run}'s tokenizer ({tokenizer.identity}) differs from the one its data was tokenized with "
            f"({made_with}): the loss would be meaningless"
        )
    if Path(run).is_dir():
        check_data(Path(run), corpus)
    if corpus.examples != setup.cfg.data.examples:  # a run that never trained (an import) has not said
        data = dataclasses.replace(setup.cfg.data, examples=corpus.examples)
        setup = dataclasses.replace(setup, cfg=dataclasses.replace(setup.cfg, data=data))
    eval_step = make_eval_step(
        setup, tokenizer.token_bytes(), dummy_tables(tokenizer, setup.cfg.data.examples)
    )
    return step, evaluate(setup, eval_step, params, corpus, max_batches)


def read_texts(paths: tuple[str, ...]) -> list[str]:
    """The UTF-8 text of each --text file; an unreadable or empty one is refused in one line."""
    texts = []
    for path in paths:
        try:
            texts.append(Path(path).read_text("utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read --text {path} as UTF-8 text: {e}") from None
        if not texts[-1]:
            raise ConfigError(f"--text {path} is empty: there is nothing to measure")
    return texts


Records = list[tuple[int, dict]]
"""A file's conversation records, each with its line number."""


def read_conversations(path: Path) -> Records | None:
    """The records of a .jsonl file of conversations (`messages`, or prompt/completion pairs), with their line
    numbers; None for any other file, which is measured as text."""
    if path.suffix != ".jsonl":
        return None
    try:
        lines = [(n, line) for n, line in enumerate(path.read_text("utf-8").splitlines(), 1) if line.strip()]
        records = [(n, json.loads(line)) for n, line in lines]
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"cannot read --text {path} as JSON lines: {e}") from None
    if not records or not is_conversation(records[0][1]):
        return None
    for n, record in records:
        if not is_conversation(record):
            raise ConfigError(
                f"--text {path} line {n} is neither `messages` nor a `prompt`/`completion` pair"
            )
    return records


@dataclasses.dataclass(frozen=True)
class Examples:
    """A file of conversations as training reads it: each record's example, cut (as training cuts one longer
    than a row) to its first `seq_len` + 1 tokens; `cut` says which were."""

    path: str
    examples: list[Example]
    seq_len: int
    cut: list[bool]

    def note(self) -> str:
        """What was cut, for the lines that report on them."""
        row, n = self.seq_len + 1, sum(self.cut)
        return f"; {n:,} longer than {row} tokens cut to their first {row}, as training cuts them" * bool(n)


def conversation_examples(run: str, conversations: dict[str, Records | None]) -> list[Examples]:
    """The examples of each conversation file, through the run's chat template and cut at its windows'
    length, as its training and validation read them; a record that cannot be one is named by file and line.
    Only the run's config and tokenizer are read."""
    if not any(records for records in conversations.values()):
        return []
    tokenizer, row = run_tokenizer(run), run_config(run).data.seq_len + 1
    if not hasattr(tokenizer, "chat_template"):
        raise ConfigError(
            "conversations need a chat model's tokenizer (a checkpoint's, with its chat template)"
        )
    template, out = tokenizer.chat_template(), []
    for path, records in conversations.items():
        examples = []
        for line, record in records or []:
            try:
                examples.append(example_tokens(record, template, tokenizer))
            except ConfigError as e:
                raise ConfigError(f"--text {path} line {line}: {e}") from None
        if records:
            cut = [len(e.ids) > row for e in examples]
            examples = [Example(e.ids[:row], e.assistant[:row]) for e in examples]
            out.append(Examples(path, examples, row - 1, cut))
    return out


def show_examples(run: str, files: list[Examples], n: int) -> None:
    """`minigpt eval --show N`: the first n examples of each conversation file, as the model reads them."""
    if not files:
        raise ConfigError(
            "--show needs a --text .jsonl file of conversations (`messages`, `prompt`/`completion`)"
        )
    tokenizer = run_tokenizer(run)
    for f in files:
        for i, (example, was_cut) in enumerate(zip(f.examples[:n], f.cut, strict=False)):
            cut = f" (cut to its first {f.seq_len + 1}, as training cuts it)" * was_cut
            print(
                f"--- {f.path}, example {i + 1}: {len(example.ids)} tokens{cut}, {sum(example.assistant)} the "
                "assistant's"
            )
            print(show_example(example, tokenizer))


def _assistant_line(scorer: Scorer, tokenizer: Any, f: Examples) -> str:
    """The assistant-token loss of a file of conversations, as one line."""
    try:
        r = assistant_loss(scorer, tokenizer, f.examples)
    except ConfigError as e:
        raise ConfigError(f"--text {f.path}: {e}") from None
    return (
        f"assistant loss {r['loss']:.4f} | {r['bpb']:.4f} bits/byte ({r['tokens']:,} assistant tokens of "
        f"{len(f.examples):,} examples, {r['bytes']:,} bytes{f.note()})"
    )


def _check_texts(run: str, paths: tuple[str, ...], texts: list[str]) -> None:
    """Before the model loads: a tokenizer whose tokens lose text has no bits per byte to report."""
    if texts:
        tokenizer = run_tokenizer(run)
        table = tokenizer.token_bytes()
        for path, text in zip(paths, texts, strict=True):
            check_document(tokenizer, table, text, tokenizer.encode(text), f"--text {path}")


def tasks_path(run: str, step: int, out: str | None = None) -> Path:
    """Where task results are saved: `out`, else RUN/evals/tasks-stepN.json (beside an export file)."""
    if out is not None:
        return Path(out)
    path = Path(run)
    if path.is_dir():
        return path / "evals" / f"tasks-step{step}.json"
    return path.with_name(f"{path.stem}-tasks-step{step}.json")


def import_harness(flag: str) -> ModuleType:
    """The lm-eval backend, or a one-line error saying how to install lm-eval for `flag`."""
    try:
        from minigpt.inference import harness
    except ImportError as e:
        raise ConfigError(f"{flag} needs lm-evaluation-harness ({e}): {INSTALL_EVAL}") from None
    return harness


def run_eval(cfg: EvalConfig) -> None:
    """`minigpt eval`: the validation figures, or the bits per byte of --text files and --tasks' results."""
    if cfg.show and not cfg.text:
        raise ConfigError("--show needs --text FILE.jsonl: a file of conversations whose examples to show")
    if not (cfg.tasks or cfg.text):
        step, result = validation(cfg.run, cfg.batches)
        print(f"step {step} | {format_validation(result)}")
        return
    conversations = {path: read_conversations(Path(path)) for path in cfg.text}
    examples = conversation_examples(cfg.run, conversations)  # bad records are refused before any model loads
    if cfg.show:
        show_examples(cfg.run, examples, cfg.show)
        return
    plain = tuple(path for path, records in conversations.items() if records is None)
    texts = read_texts(plain)
    _check_texts(cfg.run, plain, texts)
    harness = import_harness("--tasks") if cfg.tasks else None
    if harness is not None:
        harness.check_include_path(cfg.include_path)
    setup, params, tokenizer, step = load_model(cfg.run, tensor=cfg.tensor)  # seconds; lm-eval's index: more
    manager = harness.task_manager(cfg.tasks, cfg.include_path) if harness else None
    if texts:
        rows = text_bits_per_byte(Scorer(setup, params, cfg.batch_size), tokenizer, texts)
        for path, row in zip(plain, rows, strict=True):
            print(f"{path}: {row['bpb']:.4f} bits/byte ({row['tokens']:,} tokens, {row['bytes']:,} bytes)")
        if len(rows) > 1:
            print(f"all {len(rows)} files: {total_bits_per_byte(rows):.4f} bits/byte")
    for f in examples:
        print(f"{f.path}: {_assistant_line(Scorer(setup, params, cfg.batch_size), tokenizer, f)}")
    if harness is not None:
        lm = harness.MiniGPTLM(loaded=(setup, params, tokenizer), batch_size=cfg.batch_size)
        results = harness.run_tasks(lm, cfg.tasks, manager, limit=cfg.limit, num_fewshot=cfg.num_fewshot,
                                    bootstrap_iters=cfg.bootstrap_iters)  # fmt: skip
        _save_tasks(results, tasks_path(cfg.run, step, cfg.out), step)


def _save_tasks(results: dict[str, Any], out: Path, step: int) -> None:
    """Print lm-eval's table of `results` and save them, with the step, as JSON."""
    from lm_eval.utils import handle_non_serializable, make_table

    print(make_table(results))
    out.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(out, json.dumps({"step": step, **results}, indent=2, default=handle_non_serializable))
    print(f"step {step}: task results saved to {out}")
