"""`minigpt` command line: train, eval, generate, prepare. Configs are dataclasses turned into flags by tyro.

`--preset NAME` picks the defaults every other flag then overrides. Mistakes in flags or inputs end with
one line on stderr (`minigpt: error: ...`) and exit status 2, never a traceback.
"""

from __future__ import annotations

import gc
import os
import sys

from minigpt import allocator, interrupts, watchdog

# Before the imports that follow, which take seconds; in the program only, not in code that imports it, nor in
# its worker processes (multiprocessing's spawn runs the `minigpt` script again in each, with its argv).
if (
    __name__ == "__main__" or os.path.basename(sys.argv[0]) == "minigpt"
) and "--multiprocessing-fork" not in sys.orig_argv:
    if watchdog.wanted(sys.argv[1:]):  # a process of a multi-process run: watched by this one
        sys.exit(watchdog.run_watched(sys.argv[1:]))
    interrupts.install()
    allocator.keep_freed_memory()  # before JAX starts its threads
    # The imports make millions of objects that live as long as the process: collecting during them would
    # scan those again and again. `main` hands them to the collector frozen instead (`_freeze_heap`).
    gc.disable()

import contextlib
import dataclasses
import inspect
import io
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import tyro

from minigpt import compile_cache
from minigpt.config import PRESETS, ConfigError, DataConfig, TrainConfig, get_preset, subcommand_name
from minigpt.console import first_message, os_error, quiet_stderr
from minigpt.inference.generate import SamplingConfig
from minigpt.training.checkpoint import CheckpointSaveError

USAGE = """usage: minigpt {train,eval,generate,chat,prepare,export,import,check,bench,profile,plan,lm-eval} [--help] [flags]

  train     train a model (or resume the one in --run-dir)     minigpt train --preset cpu
  eval      validation loss and bits per byte of a run          minigpt eval --run runs/cpu
            lm-evaluation-harness tasks; any text's bits/byte   minigpt eval --run runs/cpu --tasks hellaswag
  lm-eval   lm-eval's own command line, with --model minigpt    minigpt lm-eval --model minigpt --model_args run=runs/cpu --tasks hellaswag
  generate  sample text from a run                              minigpt generate --run runs/cpu --prompt "Once"
  chat      talk with a chat model, turn by turn                minigpt chat --run runs/imported
  prepare   tokenize a corpus into the token cache             minigpt prepare --preset cpu --data my.txt
  export    parameters + config + tokenizer in one file         minigpt export --run runs/cpu --out cpu.npz
            or a Hugging Face transformers checkpoint folder    minigpt export --run runs/cpu --format hf --out cpu-hf
  import    a run directory from a transformers checkpoint      minigpt import --hf cpu-hf --out runs/imported
  check     verify a run: checkpoints, token store, records    minigpt check runs/cpu
  bench     step time, tokens/s, MFU over batch sizes x meshes  minigpt bench --preset cpu --batch-sizes 8 16 32
  profile   a jax.profiler trace of a few training steps        minigpt profile --preset cpu --logdir runs/prof
  plan      will it fit? per-device memory of a training step   minigpt plan --preset gpt2-124m --device h100 --devices 8

Every command also takes --compile-cache DIR|off: where compiled programs are kept for the next command
(default $MINIGPT_CACHE_DIR/xla, else ~/.cache/minigpt/xla; JAX_COMPILATION_CACHE_DIR, when set, wins).
"""


@dataclasses.dataclass(frozen=True)
class PrepareArgs:
    """Tokenize a corpus into the token cache (`train` does this itself when needed)."""

    data: DataConfig


@dataclasses.dataclass(frozen=True)
class ExportArgs:
    run: Annotated[str, tyro.conf.arg(help="run directory written by `minigpt train`")]
    out: Annotated[str, tyro.conf.arg(help="the file to write (.npz): parameters, config and tokenizer")]
    overwrite: bool = False
    format: Literal["minigpt", "hf"] = "minigpt"
    """minigpt: one .npz file; hf: a Hugging Face transformers checkpoint folder (config.json,
    model.safetensors, tokenizer) for AutoModelForCausalLM / AutoTokenizer.from_pretrained (LoRA adapters
    merged into the weights)."""
    adapters: bool = False
    """A LoRA run's adapters alone, as a PEFT adapter folder that peft loads onto the run's base checkpoint."""


@dataclasses.dataclass(frozen=True)
class GenerateArgs:
    """Sample text from a trained run. Prompts must be shorter than the model's context (longer ones are
    refused); an empty prompt ("") starts a new document. A single prompt with one sample is streamed to the
    terminal as it is generated; several prompts (or samples) are decoded together in one batch."""

    run: Annotated[str, tyro.conf.arg(help="run directory written by `minigpt train`, or an export file")]
    prompt: Annotated[tuple[str, ...], tyro.conf.UseAppendAction] = ()
    """Text to continue; repeat the flag for several prompts. Default (no --prompt or --prompt-file):
    "Once upon a time"."""
    prompt_file: str | None = None
    """A file whose whole text is one more prompt (one trailing newline dropped; "-" reads stdin)."""
    sampling: Annotated[SamplingConfig, tyro.conf.arg(name="")] = SamplingConfig()
    stream: bool = True
    """Print a single prompt's single sample token by token as it is generated."""


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


def _split_compile_cache(args: list[str]) -> tuple[str | None, list[str]]:
    """`--compile-cache DIR|off`, which every command takes, and the command's own flags."""
    rest, setting = [], None
    it = iter(args)
    for a in it:
        if a == "--compile-cache" or a.startswith("--compile-cache="):
            setting = a.split("=", 1)[1] if "=" in a else next(it, "")
            if not setting or setting.startswith("--"):
                raise ConfigError("--compile-cache needs a folder, or off")
        else:
            rest.append(a)
    return setting, rest


def _name_default_subcommands(args: list[str], default: TrainConfig) -> list[str]:
    """tyro takes `--optimizer.*` / `--schedule.*` flags only after their subcommand (`optimizer:adam-w`), and
    top-level flags only before any subcommand. Accept them in any order: group each flag (and its value)
    with its owner, name the preset's own optimizer/schedule when its fields are set without choosing one."""
    groups: dict[str, list[str]] = {"base": [], "optimizer": [], "schedule": []}
    owner = "base"
    for a in args:
        if a.startswith("--"):
            owner = next((f for f in ("optimizer", "schedule") if a.startswith(f"--{f}.")), "base")
        elif a.startswith(("optimizer:", "schedule:")):
            owner = a.split(":", 1)[0]
            groups[owner].insert(0, a)
            continue
        groups[owner].append(a)
    for field in ("optimizer", "schedule"):
        group = groups[field]
        if group and not group[0].startswith(f"{field}:"):
            group.insert(0, f"{field}:{subcommand_name(getattr(default, field))}")
    return groups["base"] + groups["optimizer"] + groups["schedule"]


def _parse_train(args: list[str], prog: str) -> TrainConfig:
    preset, rest = _split_preset(args)
    starts_from = any(a == "--init-from" or a.startswith("--init-from=") for a in rest)
    default = get_preset(preset or ("finetune" if starts_from else "cpu"))
    rest = _name_default_subcommands(rest, default)
    description = (
        f"Train a GPT. Presets (--preset NAME, default cpu; finetune with --init-from): {', '.join(PRESETS)}."
    )
    return tyro.cli(TrainConfig, default=default, args=rest, prog=prog, description=description)


def cmd_train(args: list[str]) -> None:
    from minigpt.training.train import train

    cfg = _parse(lambda: _parse_train(args, "minigpt train"))
    train(cfg)


def cmd_prepare(args: list[str]) -> None:
    from minigpt.data.mixture import prepare_corpus

    preset, rest = _parse(lambda: _split_preset(args))
    default = PrepareArgs(data=get_preset(preset or "cpu").data)
    parsed = _parse(lambda: tyro.cli(PrepareArgs, default=default, args=rest, prog="minigpt prepare"))
    for part in prepare_corpus(parsed.data).parts:
        store = part.store
        if part.name:
            print(f"source {part.name} (weight {part.weight:.3g}):")
        for split, info in store.meta["splits"].items():
            print(
                f"{split}: {info['documents']:,} documents, {info['tokens']:,} tokens, {info['text_bytes']:,} bytes"
            )
        sources = store.meta["sources"]
        size = sum(f["size"] for files in sources.values() for f in files)
        print(
            f"sources: {len(sources['train'])} training and {len(sources['val'])} validation files, "
            f"{size / 1e6:,.1f} MB"
        )
        print(f"token store: {store.path} ({store.meta['tokenizer_identity']})")


def cmd_eval(args: list[str]) -> None:
    from minigpt.inference.evaluate import EvalConfig, run_eval

    run_eval(_parse(lambda: tyro.cli(EvalConfig, args=args, prog="minigpt eval")))


def cmd_lm_eval(args: list[str]) -> None:
    """lm-eval's own command line with the "minigpt" model registered (lm-eval 0.4 finds models only in its
    own package): `minigpt lm-eval --model minigpt --model_args run=runs/cpu --tasks hellaswag`."""
    from minigpt.inference.evaluate import import_harness

    import_harness("minigpt lm-eval")
    from lm_eval.__main__ import cli_evaluate

    from minigpt.inference.harness import lm_eval_error
    from minigpt.inference.task_index import cached_task_index

    sys.argv = ["lm-eval", *args]
    try:
        with cached_task_index():
            cli_evaluate()
    except Exception as e:  # a task file's mistakes, as `minigpt eval --tasks` reports them
        if (error := lm_eval_error(e, args)) is None:
            raise
        raise error from None


def cmd_export(args: list[str]) -> None:
    from minigpt.training.runs import export

    a = _parse(lambda: tyro.cli(ExportArgs, args=args, prog="minigpt export"))
    if a.adapters:
        from minigpt.hf.adapters import export_adapters

        print(f"exported the adapters of {a.run} to {export_adapters(a.run, a.out, a.overwrite)} for PEFT")
        return
    if a.format == "hf":
        from minigpt.hf import export_hf

        folder, arch = export_hf(a.run, a.out, overwrite=a.overwrite)
        print(f"exported {a.run} to {folder} as a transformers {arch}")
        return
    out = export(a.run, a.out, overwrite=a.overwrite)
    print(f"exported {a.run} to {out} ({out.stat().st_size / 2**20:.1f} MiB)")


def cmd_check(args: list[str]) -> None:
    """`minigpt check RUN` (or --run-dir RUN): one line per problem and what to do, then a summary; exit 1
    unless everything verifies."""
    from minigpt.training import check

    if args in (["-h"], ["--help"]):
        print(f"usage: minigpt check RUN\n\n{check.__doc__}")
        return
    if len(args) == 2 and args[0] in ("--run", "--run-dir"):
        args = args[1:]
    if len(args) != 1 or args[0].startswith("-"):
        raise ConfigError("usage: minigpt check RUN (a run directory written by `minigpt train`)")
    found = check.check_run(args[0])
    for line in found.notes:
        print(f"note: {line}")
    for line in found.problems:
        print(f"problem: {line}")
    print(found.summary(Path(args[0])))
    if found.problems:
        sys.exit(1)


def cmd_generate(args: list[str]) -> None:
    from minigpt.inference.generate import TextStreamer, generate_batch
    from minigpt.training.runs import load_model

    a = _parse(lambda: tyro.cli(GenerateArgs, args=args, prog="minigpt generate"))
    prompts = list(a.prompt)
    if a.prompt_file is not None:
        try:
            text = sys.stdin.read() if a.prompt_file == "-" else Path(a.prompt_file).read_text("utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read --prompt-file {a.prompt_file}: {e}") from None
        prompts.append(text.removesuffix("\n"))
    prompts = prompts or ["Once upon a time"]
    setup, params, tokenizer, _ = load_model(a.run)
    one = len(prompts) * a.sampling.num_samples == 1
    streamer = TextStreamer(tokenizer, prompts[0]) if a.stream and one else None
    texts = generate_batch(
        setup.graphdef,
        params,
        tokenizer,
        prompts,
        a.sampling,
        max_seq_len=setup.cfg.model.max_seq_len,
        on_token=streamer,
    )
    if streamer is not None:
        streamer.finish(texts[0][0])
        return
    for i, samples in enumerate(texts):
        for j, text in enumerate(samples):
            if len(texts) > 1:
                print(f"--- prompt {i + 1}" + (f", sample {j + 1}" if len(samples) > 1 else ""))
            elif len(samples) > 1:
                print(f"--- sample {j + 1}")
            print(text)


@dataclasses.dataclass(frozen=True)
class ChatArgs:
    """Talk with a chat model (a transformers chat checkpoint, imported or trained further): each line you
    type is a user turn, rendered with the model's chat template; the reply is streamed and ends at the
    model's end-of-turn token. The conversation stays in the model's key/value cache between turns. An empty
    line, "/exit", end of input (Ctrl-D) or Ctrl-C ends it."""

    run: Annotated[str, tyro.conf.arg(help="run directory, or an export file, of a chat model")]
    system: str = ""
    """A system message to start the conversation with."""
    sampling: Annotated[SamplingConfig, tyro.conf.arg(name="")] = SamplingConfig()


def cmd_chat(args: list[str]) -> None:
    from minigpt.inference.conversation import Conversation
    from minigpt.training.runs import load_model

    a = _parse(lambda: tyro.cli(ChatArgs, args=args, prog="minigpt chat"))
    setup, params, tokenizer, _ = load_model(a.run)
    chat = Conversation(setup, params, tokenizer, a.sampling, a.system)
    tty = sys.stdin.isatty()
    while True:
        try:
            line = input("you> " if tty else "")
        except EOFError:
            break
        if line.strip() in ("", "/exit"):
            break
        print("model> " if tty else "", end="", flush=True)
        chat.say(line, on_text=lambda piece: print(piece, end="", flush=True))
        print(flush=True)


TRAIN_FLAGS = (
    "The model comes from --preset NAME ({presets}; default cpu) and `minigpt train`'s flags, which all apply: "
    "--model.* (shape, --model.dtype, --model.remat, --model.attention), --data.seq-len, --optimizer.*, "
    "--schedule.*, --peak-tflops, ... (see `minigpt train --help`)."
)


@dataclasses.dataclass(frozen=True)
class BenchArgs:
    """Time the training step on random tokens for every batch size x mesh layout: compile time, median step
    time, tokens/s, MFU, memory. Writes bench.md/csv/json and tokens_per_s.png, mfu.png into --out.
    --batch-sizes and --layouts say what to run (`minigpt train`'s --batch-size and --mesh sizes do not)."""

    batch_sizes: tuple[int, ...] = (8, 16, 32)
    """Global batch sizes (sequences) to sweep."""
    layouts: Annotated[
        tuple[str, ...],
        tyro.conf.arg(help_behavior_hint="(default: every factorization of the device count)"),
    ] = ()
    """Mesh layouts DATAxFSDPxTENSOR, e.g. 8x1x1 4x1x2."""
    warmup_steps: int = 2
    """Untimed steps after compiling."""
    timed_steps: int = 5
    """Steps timed one by one; the table reports their median."""
    vocab_size: Annotated[
        int | None,
        tyro.conf.arg(
            help_behavior_hint="(default: --model.vocab-size, else 4096 or --data.bpe-vocab-size for bpe "
            "presets, 50257 for gpt2 ones)"
        ),
    ] = None
    """Vocabulary of the random tokens."""
    collectives: bool = True
    """Profile two more steps per point to measure the share of step time spent in collectives."""
    out: str = "runs/bench"
    """Where the table, CSV, JSON and plots go."""


@dataclasses.dataclass(frozen=True)
class ProfileArgs:
    """Write a jax.profiler trace of --trace-steps training steps (random tokens, after --warmup-steps) of the
    model on its --mesh layout and --batch-size, for TensorBoard's profile plugin or XProf."""

    logdir: str = "runs/profile"
    """Log directory: the trace goes to LOGDIR/plugins/profile/RUN/HOST.xplane.pb."""
    warmup_steps: int = 3
    trace_steps: int = 5
    vocab_size: Annotated[int | None, tyro.conf.arg(help_behavior_hint="(default: as for bench)")] = None
    """Vocabulary of the random tokens."""


def _parse_with_train(cls: type, args: list[str], prog: str) -> tuple[Any, TrainConfig]:
    """`cls`'s own flags, and a TrainConfig from --preset and the rest (every `minigpt train` flag), so
    --help lists only what the command itself adds."""
    description = f"{inspect.cleandoc(cls.__doc__ or '')}\n\n{TRAIN_FLAGS.format(presets=', '.join(PRESETS))}"
    preset, rest = _parse(lambda: _split_preset(args))
    own, train_args = _parse(
        lambda: tyro.cli(cls, args=rest, prog=prog, description=description, return_unknown_args=True)
    )
    train_args = [*train_args, *(["--preset", preset] if preset else [])]
    return own, _parse(lambda: _parse_train(train_args, prog))


def cmd_bench(args: list[str]) -> None:
    from minigpt.tools.bench import bench

    a, cfg = _parse_with_train(BenchArgs, args, "minigpt bench")
    bench(cfg, a.batch_sizes, a.layouts, out_dir=a.out, warmup_steps=a.warmup_steps, timed_steps=a.timed_steps,
          vocab_size=a.vocab_size, peak_tflops=cfg.peak_tflops or None, collectives=a.collectives)  # fmt: skip


def cmd_profile(args: list[str]) -> None:
    from minigpt.tools.bench import profile

    a, cfg = _parse_with_train(ProfileArgs, args, "minigpt profile")
    profile(cfg, a.logdir, warmup_steps=a.warmup_steps, trace_steps=a.trace_steps, vocab_size=a.vocab_size)


@dataclasses.dataclass(frozen=True)
class PlanArgs:
    """Will it fit? The per-device memory of one training step of the config `minigpt train` would run with
    the same flags (parameters, optimizer state, gradients, activations, the logits and other working sets),
    planned from shapes alone for --devices devices of a --device kind, against that kind's memory. On this
    process's own devices, also XLA's figure for the compiled step (--measure). Exit status 1 if it does not
    fit, with one line saying what would."""

    train: Annotated[TrainConfig, tyro.conf.arg(name="")]
    device: str | None = None
    """Device kind: cpu, h100, h200, a100-40gb, a100-80gb, tpu-v4, tpu-v5e, tpu-v5p, tpu-v6e (default: this
    process's)."""
    devices: int | None = None
    """How many devices (default: this process's); the mesh sizes must multiply to it."""
    measure: bool = True
    """Also compile the real train step and report XLA's per-device figure, where the planned devices are
    this process's (same kind, enough of them)."""


def cmd_plan(args: list[str]) -> None:
    import jax

    from minigpt.tools.devices import device_kind, local_kind
    from minigpt.tools.plan import does_not_fit, format_plan, make_plan, measure
    from minigpt.tools.plan import resolve_grad_accum as resolve
    from minigpt.training.trainer import cpu_layout, split_cpu

    preset, rest = _parse(lambda: _split_preset(args))
    default = PlanArgs(train=get_preset(preset or "cpu"))
    rest = _name_default_subcommands(rest, default.train)
    a = _parse(lambda: tyro.cli(PlanArgs, default=default, args=rest, prog="minigpt plan"))
    if a.devices is None:  # the devices `minigpt train` would split this CPU into, and their layout
        a = dataclasses.replace(a, train=cpu_layout(a.train, split_cpu(a.train, multi_process=False)))
    kind = device_kind(a.device).name if a.device else local_kind()
    n = jax.device_count() if a.devices is None else a.devices
    if n <= 0:
        raise ConfigError(f"--devices must be positive, got {n}")
    try:
        cfg = resolve(a.train, log=print, kind=kind, count=n)
    except ConfigError as e:  # --grad-accum auto: not even one sequence per device fits
        if a.train.grad_accum != "auto" or "does not fit" not in str(e):
            raise
        print(f"minigpt: error: {e}", file=sys.stderr)
        sys.exit(1)
    plan = make_plan(cfg, kind, n)
    here = kind == local_kind() and n <= jax.device_count()
    measured = measure(cfg, jax.devices()[:n]) if a.measure and here else None
    note = (
        "" if here or not a.measure else f"not this process's devices ({jax.device_count()} x {local_kind()})"
    )
    print(format_plan(plan, measured, note))
    if not plan.fits:
        print(f"minigpt: error: {does_not_fit(plan)}", file=sys.stderr)
        sys.exit(1)


@dataclasses.dataclass(frozen=True)
class ImportArgs:
    """Make a run directory from a local Hugging Face transformers checkpoint (GPT2LMHeadModel,
    LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM or ApertusForCausalLM; safetensors weights; GPT-2's
    tokenizer or the checkpoint's byte-level BPE tokenizer.json) that generate, eval and train --run-dir
    accept: a checkpoint at step 0 with a fresh optimizer state. A folder written by `minigpt export --format
    hf` gets its original run's config back; otherwise the finetune preset's, with the checkpoint's model and
    tokenizer and these --data flags (what eval reads and training continues on)."""

    hf: Annotated[str, tyro.conf.arg(help="transformers checkpoint folder (config.json, model.safetensors)")]
    out: Annotated[str, tyro.conf.arg(help="the run directory to write")]
    overwrite: bool = False
    data: DataConfig = PRESETS["finetune"].data


def cmd_import(args: list[str]) -> None:
    from minigpt.data.pretrained_tokenizer import TEMPLATE_FILE
    from minigpt.hf import import_hf

    a = _parse(lambda: tyro.cli(ImportArgs, args=args, prog="minigpt import"))
    data = None if a.data == PRESETS["finetune"].data else a.data
    out, arch, command = import_hf(a.hf, a.out, overwrite=a.overwrite, data=data)
    print(f"imported a transformers {arch} from {a.hf} into {out} (step 0, fresh optimizer state)")
    print(f"continue training with: {command}")
    if (out / "tokenizer" / TEMPLATE_FILE).is_file():
        print(f"talk with it: minigpt chat --run {out}")


def _parse(fn: Callable[[], Any]) -> Any:
    """Parse flags with `fn`, turning every mistake into one line. Config construction validates each value
    and raises ConfigError (not a ValueError, so tyro lets it through to `main`). A value tyro itself cannot
    read (`--steps abc`, an unknown flag or choice) it reports in a box on stderr and exits 2: the box's
    first line becomes the error."""
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parsed = fn()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except SystemExit as e:
        if e.code:
            raise ConfigError(first_message(stderr.getvalue())) from None
        sys.stderr.write(stderr.getvalue())
        raise
    sys.stderr.write(stderr.getvalue())  # warnings, if any
    return parsed


COMMANDS = {
    "train": cmd_train,
    "eval": cmd_eval,
    "generate": cmd_generate,
    "chat": cmd_chat,
    "prepare": cmd_prepare,
    "export": cmd_export,
    "import": cmd_import,
    "check": cmd_check,
    "bench": cmd_bench,
    "profile": cmd_profile,
    "plan": cmd_plan,
    "lm-eval": cmd_lm_eval,
}


def _freeze_heap() -> None:
    """Move every object alive now out of the garbage collector's view, and turn it on. Its collections then
    scan only what is allocated since (the one at exit, nothing): imported modules and what they hold are
    never garbage, yet scanning them over and over costs a short command a tenth of its time."""
    gc.freeze()
    gc.enable()


def _leave() -> None:
    """End the process now, skipping the interpreter's teardown (freeing every module's objects and JAX's
    backends): a twentieth of a warm `generate`, which has written all it writes once its text is printed."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        sys.exit(0 if argv else 2)
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"minigpt: error: unknown command '{argv[0]}'\n{USAGE}", file=sys.stderr)
        sys.exit(2)
    quiet_stderr()
    program = not gc.isenabled()  # the program's imports ran with the collector off
    try:
        interrupts.arm()
        setting, args = _split_compile_cache(argv[1:])
        compile_cache.use(setting)
        if program:
            _freeze_heap()
        command(args)
        interrupts.check()
        if program and command is cmd_generate:
            _leave()
        if program:
            _freeze_heap()
    except ConfigError as e:
        print(f"minigpt: error: {e}", file=sys.stderr)
        sys.exit(2)
    except FloatingPointError as e:  # the run stopped; its last good checkpoint is kept
        print(f"minigpt: error: {e}", file=sys.stderr)
        sys.exit(1)
    except CheckpointSaveError as e:
        print(f"minigpt: error: {e}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Orbax's writer threads would bury this line in shutdown tracebacks; nothing is left to save.
        os._exit(1)
    except OSError as e:  # disk full, permission denied, a path that is a file or a folder, ...
        print(f"minigpt: error: {os_error(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("minigpt: interrupted", file=sys.stderr)
        interrupts.exit_interrupted()
    except Exception as e:
        from minigpt.training.distributed import lost_process

        if (lost := lost_process(e)) is None:
            raise
        print(f"minigpt: error: {lost}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # leaving through JAX's shutdown would wait on the lost process, then abort
    finally:
        interrupts.disarm()


if __name__ == "__main__":
    main()
