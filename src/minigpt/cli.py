"""The `minigpt` program: one command per module in `minigpt.commands`, dispatched from here. Configs are
dataclasses turned into flags by tyro.

`--preset NAME` picks the defaults every other flag then overrides. Mistakes in flags or inputs end with
one line on stderr (`minigpt: error: ...`) and exit status 2, never a traceback. The flags are read and
checked before JAX is imported (what this module imports at its top needs none), so a mistyped one is
reported at once, however busy the machine.
"""

from __future__ import annotations

import gc
import os
import sys
from typing import Any

from minigpt.runtime import allocator, interrupts, watchdog

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

from minigpt.commands import (
    bench,
    chat,
    check,
    eval_,
    export,
    generate,
    import_,
    lm_eval,
    plan,
    prepare,
    profile,
    serve,
    train,
)
from minigpt.commands.flags import split_compile_cache
from minigpt.config import ConfigError
from minigpt.runtime import compile_cache
from minigpt.runtime.console import device_busy, os_error, quiet_stderr
from minigpt.runtime.errors import CheckpointSaveError

USAGE = """usage: minigpt {train,eval,generate,chat,serve,prepare,export,import,check,bench,profile,plan,lm-eval} [--help] [flags]

  train     train a model (or resume the one in --run-dir)     minigpt train --preset cpu
  eval      validation loss and bits per byte of a run          minigpt eval --run runs/cpu
            lm-evaluation-harness tasks; any text's bits/byte   minigpt eval --run runs/cpu --tasks hellaswag
  lm-eval   lm-eval's own command line, with --model minigpt    minigpt lm-eval --model minigpt --model_args run=runs/cpu --tasks hellaswag
  generate  sample text from a run                              minigpt generate --run runs/cpu --prompt "Once"
  chat      talk with a chat model, turn by turn                minigpt chat --run runs/imported
  serve     an OpenAI-compatible HTTP server and a chat page    minigpt serve --run runs/imported
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

COMMANDS: dict[str, Any] = {
    "train": train,
    "eval": eval_,
    "generate": generate,
    "chat": chat,
    "serve": serve,
    "prepare": prepare,
    "export": export,
    "import": import_,
    "check": check,
    "bench": bench,
    "profile": profile,
    "plan": plan,
    "lm-eval": lm_eval,
}
"""Each command's module: `parse(args)` reads its flags (tyro and the configs, no JAX), `load()` imports and
returns the command's body."""


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
        setting, args = split_compile_cache(argv[1:])
        parsed = command.parse(args)
        compile_cache.use(setting)
        run = command.load()  # JAX and the rest of what the command imports
        if program:
            _freeze_heap()
        run(parsed)
        interrupts.check()
        if program and command is generate:
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
        from minigpt.parallel.distributed import lost_process

        if (busy := device_busy(e)) is not None:
            print(f"minigpt: error: {busy}", file=sys.stderr)
            sys.exit(1)
        if (lost := lost_process(e)) is None:
            raise
        print(f"minigpt: error: {lost}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # leaving through JAX's shutdown would wait on the lost process, then abort
    finally:
        interrupts.disarm()


if __name__ == "__main__":
    main()
