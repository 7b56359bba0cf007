"""`minigpt` command line: train, eval, generate, prepare. Configs are dataclasses turned into flags by tyro.

`--preset NAME` picks the defaults every other flag then overrides. Mistakes in flags or inputs end with
one line on stderr (`minigpt: error: ...`) and exit status 2, never a traceback.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Annotated, Any

import tyro

from minigpt.config import PRESETS, ConfigError, DataConfig, TrainConfig, get_preset

USAGE = """usage: minigpt {train,eval,generate,prepare} [--help] [flags]

  train     train a model (or resume the one in --run-dir)     minigpt train --preset cpu
  eval      validation loss and bits per byte of a run          minigpt eval --run runs/cpu
  generate  sample text from a run                              minigpt generate --run runs/cpu --prompt "Once"
  prepare   tokenize a corpus into the token cache             minigpt prepare --preset cpu --data my.txt
"""


@dataclasses.dataclass(frozen=True)
class EvalArgs:
    run: Annotated[str, tyro.conf.arg(help="run directory written by `minigpt train`")]
    batches: int = 0
    """Cap on validation batches (0: the whole validation split)."""


@dataclasses.dataclass(frozen=True)
class GenerateArgs:
    run: Annotated[str, tyro.conf.arg(help="run directory written by `minigpt train`")]
    prompt: str = "Once upon a time"
    num_samples: int = 1
    max_new_tokens: int = 200
    temperature: float = 0.8
    """0 is greedy decoding."""
    top_k: int = 40
    """Sample among the k most likely tokens (0: all)."""
    seed: int = 0


def _split_preset(args: list[str]) -> tuple[str | None, list[str]]:
    rest, preset = [], None
    it = iter(args)
    for a in it:
        if a == "--preset":
            preset = next(it, None)
            if preset is None:
                raise ConfigError(f"--preset needs a name: {', '.join(PRESETS)}")
        elif a.startswith("--preset="):
            preset = a.split("=", 1)[1]
        else:
            rest.append(a)
    return preset, rest


def _parse_train(args: list[str], prog: str) -> TrainConfig:
    preset, rest = _split_preset(args)
    default = get_preset(preset) if preset else get_preset("cpu")
    description = f"Train a GPT. Presets (--preset NAME, default cpu): {', '.join(PRESETS)}."
    return tyro.cli(TrainConfig, default=default, args=rest, prog=prog, description=description)


def cmd_train(args: list[str]) -> None:
    from minigpt.train import train

    cfg = _parse(lambda: _parse_train(args, "minigpt train"))
    train(cfg)


def cmd_prepare(args: list[str]) -> None:
    from minigpt.data import prepare

    preset, rest = _parse(lambda: _split_preset(args))
    default = get_preset(preset).data if preset else get_preset("cpu").data
    data_cfg = _parse(lambda: tyro.cli(DataConfig, default=default, args=rest, prog="minigpt prepare"))
    store = prepare(data_cfg)
    for split, info in store.meta["splits"].items():
        print(
            f"{split}: {info['documents']:,} documents, {info['tokens']:,} tokens, {info['text_bytes']:,} bytes"
        )
    print(f"token store: {store.path} ({store.meta['tokenizer_identity']})")


def cmd_eval(args: list[str]) -> None:
    from minigpt.data import prepare
    from minigpt.train import evaluate, load_run, make_eval_step

    a = _parse(lambda: tyro.cli(EvalArgs, args=args, prog="minigpt eval"))
    setup, state, tokenizer = load_run(a.run)
    store = prepare(setup.cfg.data)
    result = evaluate(
        setup, make_eval_step(setup, tokenizer.token_bytes()), state["params"], store, a.batches
    )
    print(f"step {int(state['step'])} | val loss {result['loss']:.4f} | val bits/byte {result['bpb']:.4f}")


def cmd_generate(args: list[str]) -> None:
    import jax

    from minigpt.generate import generate
    from minigpt.train import load_run

    a = _parse(lambda: tyro.cli(GenerateArgs, args=args, prog="minigpt generate"))
    setup, state, tokenizer = load_run(a.run)
    texts = generate(
        setup.graphdef,
        state["params"],
        tokenizer,
        a.prompt,
        max_new_tokens=a.max_new_tokens,
        max_seq_len=setup.cfg.model.max_seq_len,
        key=jax.random.PRNGKey(a.seed),
        temperature=a.temperature,
        top_k=a.top_k,
        num_samples=a.num_samples,
    )
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i + 1}")
        print(text)


def _parse(fn: Callable[[], Any]) -> Any:
    """Config construction validates every value; a ValueError there is the user's mistake, shown as one line
    (tyro would otherwise draw its own multi-line box around it)."""

    def on_error(event: Any) -> None:
        if isinstance(event, tyro._errors.InstantiationFailure):
            raise ConfigError(event.message)

    try:
        with tyro._errors.on_parse_error(on_error):
            return fn()
    except ValueError as e:
        raise ConfigError(str(e)) from None


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "generate": cmd_generate, "prepare": cmd_prepare}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"minigpt: error: unknown command '{argv[0]}'\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    try:
        command(argv[1:])
    except ConfigError as e:
        print(f"minigpt: error: {e}", file=sys.stderr)
        sys.exit(2)
    except FloatingPointError as e:
        print(f"minigpt: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("minigpt: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
