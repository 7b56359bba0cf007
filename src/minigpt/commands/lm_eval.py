"""`minigpt lm-eval`: lm-eval's own command line with the "minigpt" model registered (lm-eval 0.4 finds models
only in its own package): `minigpt lm-eval --model minigpt --model_args run=runs/cpu --tasks hellaswag`."""

from __future__ import annotations

import sys
from collections.abc import Callable


def parse(args: list[str]) -> list[str]:
    """lm-eval's own flags, which its command line reads."""
    return args


def load() -> Callable[[list[str]], None]:
    from minigpt.inference.evaluate import import_harness

    def run(args: list[str]) -> None:
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

    return run
