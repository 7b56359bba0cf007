"""minigpt as a model of EleutherAI's lm-evaluation-harness (`pip install -e '.[eval]'`): downstream tasks
(HellaSwag, LAMBADA, ARC, your own YAML tasks) scored on a run directory, an export file or a model that is
training.

The backend implements lm-eval's three request types on `scoring.Scorer` and the KV-cache generator:
- `loglikelihood`: (context, continuation) pairs, tokenized as lm-eval's own `hf` backend does (trailing
  spaces of the context move to the continuation, the pair is encoded whole and split at the context's
  length, an empty context becomes end-of-text), batched longest first through one compiled forward pass
  per length bucket;
- `loglikelihood_rolling`: a whole text's log-likelihood over disjoint windows of the model's context;
- `generate_until`: greedy (or sampled) continuations from `generate.generate_ids_batch`, cut at the first
  stop sequence, at most `max_gen_toks` new tokens.
Importing this module registers the model as "minigpt" with lm-eval: `minigpt lm-eval ...` is lm-eval's own
command line with it registered, and `minigpt eval --tasks` calls lm-eval's `simple_evaluate`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax

# lm-eval fills its model registry with its own models only while the registry is empty: fill it first, so
# that registering "minigpt" keeps `hf` and the others available.
import lm_eval.models  # noqa: F401
from lm_eval.api.instance import Instance
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model

from minigpt.config import ConfigError
from minigpt.data import hub
from minigpt.data.tokenizer import check_document, document_start
from minigpt.inference import task_index
from minigpt.inference.generate import SamplingConfig, generate_ids_batch
from minigpt.inference.scoring import Scorer, rolling_loglikelihoods
from minigpt.runtime import compile_cache
from minigpt.training.runs import load_model
from minigpt.training.trainer import Setup


def _int_arg(name: str, value: Any, default: int) -> int:
    """lm-eval passes model arguments as strings, and batch_size as "auto" when unset: that is our default."""
    if value is None or (isinstance(value, str) and value.startswith("auto")):
        return default
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"model argument {name}={value!r} must be an integer") from None


@register_model("minigpt")
class MiniGPTLM(TemplateLM):
    """lm-eval model over a minigpt run: `--model minigpt --model_args run=RUN[,batch_size=32,tensor=1,
    max_gen_toks=256,seed=0]`. RUN is a run directory (its newest checkpoint) or an export file; the model is
    laid out over every device, `tensor`-way tensor parallel and data parallel over the rest. `device` and
    `max_batch_size`, which lm-eval passes to every model, do not apply: JAX places the model on its mesh."""

    def __init__(
        self,
        run: str | None = None,
        batch_size: int | str | None = 32,
        tensor: int | str = 1,
        max_gen_toks: int | str = 256,
        seed: int | str = 0,
        loaded: tuple[Setup, Any, Any] | None = None,
        progress: bool = True,
        **unused: Any,
    ) -> None:
        super().__init__()
        if loaded is None:
            if not run:
                raise ConfigError("the minigpt model needs a run: --model_args run=RUN_DIR_OR_EXPORT")
            compile_cache.use()  # lm-eval's own command line and simple_evaluate start here, not in `minigpt`
            setup, params, tokenizer, _ = load_model(run, tensor=_int_arg("tensor", tensor, 1))
            loaded = setup, params, tokenizer
        self.setup, self.params, self.tokenizer = loaded
        self.scorer = Scorer(self.setup, self.params, _int_arg("batch_size", batch_size, 32), progress)
        self._max_gen_toks = _int_arg("max_gen_toks", max_gen_toks, 256)
        self._key = jax.random.PRNGKey(_int_arg("seed", seed, 0))

    @classmethod
    def create_from_arg_obj(
        cls, arg_dict: dict[str, Any], additional_config: dict | None = None
    ) -> MiniGPTLM:
        """What --model_args says wins over lm-eval's own flags (its --batch_size is 1 unless given)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None and k not in arg_dict}
        return cls(**arg_dict, **extra)

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> MiniGPTLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    def set_params(self, params: Any) -> None:
        """Score with other parameters of the same model (a training run's current ones)."""
        self.params = self.scorer.params = params

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eot_id

    @property
    def prefix_token_id(self) -> int:
        """What a context is scored from: the model's BOS where it has one (as lm-eval's hf backend does)."""
        return document_start(self.tokenizer)

    @property
    def max_length(self) -> int:
        return self.scorer.max_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.identity

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        """As lm-eval's hf backend encodes with the model's tokenizer: a checkpoint's BOS first where its
        tokenizer puts one (unless asked not to), nothing added for minigpt's own and GPT-2's."""
        ids = self.tokenizer.encode(string)
        bos = self.tokenizer.bos_id
        if bos is None or add_special_tokens is False or (ids and ids[0] == bos):
            return ids
        return [bos, *ids]

    def tok_decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens)

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list:
        results = self.scorer.loglikelihoods([(ctx, cont) for _, ctx, cont in requests])
        for (args, _, _), result in zip(requests, results, strict=True):
            if args is not None:
                self.cache_hook.add_partial("loglikelihood", args, result)
        return results

    def loglikelihood_rolling(self, requests: list[Instance], disable_tqdm: bool = False) -> list[float]:
        """Perplexity tasks' whole texts, every token predicted once; their bits per byte (lm-eval's, over
        the text's bytes) are refused in one line for a tokenizer whose tokens lose text."""
        table = self.tokenizer.token_bytes()
        texts = [self.tok_encode(req.args[0]) for req in requests]
        for req, ids in zip(requests, texts, strict=True):  # a BOS stands for no bytes
            check_document(self.tokenizer, table, req.args[0], ids, "an lm-eval perplexity text")
        totals = rolling_loglikelihoods(self.scorer, texts, self.prefix_token_id)
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests: list[Instance], disable_tqdm: bool = False) -> list[str]:
        """Requests grouped by their generation settings, each group decoded in batches, longest first."""
        groups: dict[str, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[json.dumps(req.args[1], sort_keys=True, default=str)].append(i)
        out = [""] * len(requests)
        for n, idx in enumerate(groups.values()):
            until, sampling = self._generation_settings(requests[idx[0]].args[1])
            # Room for the new tokens, as lm-eval's hf backend leaves.
            keep = max(1, self.max_length - sampling.max_new_tokens)
            prompts = {i: self.tok_encode(requests[i].args[0])[-keep:] for i in idx}
            idx.sort(key=lambda i: -len(prompts[i]))
            for start in range(0, len(idx), self.scorer.batch_size):
                batch = idx[start : start + self.scorer.batch_size]
                new = generate_ids_batch(
                    self.setup.graphdef,
                    self.params,
                    [prompts[i] for i in batch],
                    sampling,
                    eot_id=self.eot_token_id,
                    stop_ids=self.tokenizer.stop_ids,
                    max_seq_len=self.max_length,
                    key=jax.random.fold_in(self._key, n * len(requests) + start),
                )
                for i, samples in zip(batch, new, strict=True):
                    out[i] = cut_at_stop(self.tok_decode(samples[0]), until)
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    def _generation_settings(self, kwargs: dict[str, Any]) -> tuple[list[str], SamplingConfig]:
        """(stop sequences, how to sample) from a request's generation kwargs: the new-token budget, and
        greedy unless do_sample (as in transformers), over the whole vocabulary."""
        kwargs = dict(kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.pop("max_gen_toks", self._max_gen_toks))
        sample = bool(kwargs.pop("do_sample", False))
        temperature = float(kwargs.pop("temperature", 1.0)) if sample else 0.0
        return until, SamplingConfig(max_new_tokens=max_new, temperature=temperature, top_k=0)


def cut_at_stop(text: str, until: Sequence[str]) -> str:
    """The text before the earliest stop sequence (all of it when none occurs)."""
    cut = min((text.find(s) for s in until if s and s in text), default=len(text))
    return text[:cut]


def task_manager(tasks: Sequence[str], include_path: str | Path | None = None) -> Any:
    """lm-eval's task registry for `tasks`, with the YAML tasks under `include_path` (a folder); a task name
    it does not know is one line. Indexing lm-eval's ~15,000 task files takes seconds, so when every task is
    one of your own the registry holds only yours, and a process builds each registry once."""
    check_include_path(include_path)
    path = None if include_path is None else str(Path(include_path).resolve())
    if path is not None:
        own = _task_manager(path, False)
        if set(tasks) <= set(own.all_tasks):
            return own
    manager = _task_manager(path, True)
    if path is not None and not set(tasks) <= set(manager.all_tasks):
        check_task_files(path)
    check_task_names(manager, tasks)
    return manager


def check_include_path(include_path: str | Path | None) -> None:
    if include_path is not None and not Path(include_path).is_dir():
        raise ConfigError(f"--include-path {include_path} is not a folder of task YAML files")


def check_task_files(include_path: str | Path) -> None:
    """Refuse, in one line naming it, a task file lm-eval cannot read: its index skips such a file without a
    word, and its task would be reported as unknown."""
    import yaml
    from lm_eval.tasks._yaml_loader import load_yaml

    for path in sorted(Path(include_path).glob("**/*.yaml")):
        try:
            load_yaml(path, resolve_func=False)
        except Exception as e:
            mark = getattr(e, "problem_mark", None)
            if isinstance(e, yaml.MarkedYAMLError) and mark is not None:
                problem = f"line {mark.line + 1}, column {mark.column + 1}: {e.problem}"
            else:
                problem = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"task file {path} is not valid YAML ({problem}): fix it") from None


def template_error(e: Exception) -> ConfigError | None:
    """One line for a task whose Jinja template names what its documents lack (jinja2's UndefinedError),
    naming the task's file where lm-eval's task factory was building it, else the task; None for any other
    exception."""
    import jinja2

    if not isinstance(e, jinja2.TemplateError):
        return None
    file = task = None
    tb = e.__traceback__
    while tb is not None:  # the innermost task being built or applied
        local = tb.tb_frame.f_locals
        file = getattr(local.get("entry"), "yaml_path", None) or file
        name = getattr(getattr(local.get("self"), "config", None), "task", None)
        task = name if isinstance(name, str) else task
        tb = tb.tb_next
    where = f"task file {file}" if file else f"task {task}" if task else "a task"
    return ConfigError(
        f"{where}: its template failed on a document ({e}): name only fields the documents have"
    )


def lm_eval_error(e: Exception, argv: Sequence[str]) -> ConfigError | None:
    """One line for what lm-eval's own command line (`minigpt lm-eval ARGV`) raises on task files: a template
    error, or tasks it does not know (an unreadable file under --include_path, when there is one, is why);
    None for any other exception."""
    if (error := template_error(e)) is not None:
        return error
    if not str(e).startswith("Tasks not found"):
        return None
    for flag, value in zip(argv, [*argv[1:], None], strict=True):
        folder = value if flag == "--include_path" else flag.partition("=")[2]
        if flag.startswith("--include_path") and folder and Path(folder).is_dir():
            check_task_files(folder)
    return ConfigError(
        f"{e}: list tasks with `lm-eval ls tasks`, or add your own YAML tasks with --include_path DIR"
    )


@functools.cache
def _task_manager(include_path: str | None, include_defaults: bool) -> Any:
    from lm_eval.tasks import TaskManager

    with task_index.cached_task_index():
        return TaskManager(include_path=include_path, include_defaults=include_defaults)


def check_task_names(manager: Any, tasks: Sequence[str]) -> None:
    """Refuse a task name lm-eval does not know, in one line, with the closest names it does."""
    import difflib

    known = set(manager.all_tasks)
    for name in tasks:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise ConfigError(
                f"unknown task '{name}'{hint}: list tasks with `lm-eval ls tasks`, or add your own YAML tasks "
                "with --include-path DIR"
            )


def _is_offline_error(e: BaseException) -> bool:
    """Whether an exception (or its cause) comes from the Hugging Face hub being unreachable."""
    names = {"OfflineModeIsEnabled", "ConnectionError", "ConnectTimeout", "LocalEntryNotFoundError"}
    while e is not None:
        if type(e).__name__ in names or "offline" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def example_limit(limit: float | None) -> int | float | None:
    """Examples per task as lm-eval takes them: a count, a fraction below 1, or None for all (None or 0)."""
    if not limit:
        return None
    return limit if limit < 1 else int(limit)


@contextlib.contextmanager
def offline_while_unreachable() -> Iterator[str | None]:
    """Within the block, the hub libraries work offline (from their caches, failing at once) if the hub does
    not answer one request: without it, `datasets` retries each download for minutes, logging every try.
    Yields why the hub is unreachable (None: it answers, and nothing changes)."""
    why = hub.unreachable()
    if why is None or hub.offline():
        yield why
        return
    from huggingface_hub import constants

    names = ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")
    saved_env = {name: os.environ.get(name) for name in names}
    modules = [constants] + [m for m in (sys.modules.get("datasets.config"),) if m is not None]
    saved = [(m, name, getattr(m, name)) for m in modules for name in names if hasattr(m, name)]
    os.environ.update(dict.fromkeys(names, "1"))
    for m, name, _ in saved:
        setattr(m, name, True)  # read at import: the environment alone is too late for an imported library
    try:
        yield why
    finally:
        for name, value in saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        for m, name, value in saved:
            setattr(m, name, value)


def run_tasks(
    lm: MiniGPTLM, tasks: Sequence[str], manager: Any, limit: float | None = None, **kwargs: Any
) -> dict[str, Any]:
    """lm-eval's `simple_evaluate` on `tasks`, `limit` examples of each (see `example_limit`); keyword
    arguments pass through (num_fewshot, bootstrap_iters, ...). A task whose dataset must come from the hub
    while it is unreachable is one line."""
    from lm_eval import simple_evaluate

    check_task_names(manager, tasks)
    kwargs = {"log_samples": False, "verbosity": "WARNING", "limit": example_limit(limit), **kwargs}
    with offline_while_unreachable() as why:
        try:
            return simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, **kwargs)
        except Exception as e:
            if (error := template_error(e)) is not None:
                raise error from None
            if not _is_offline_error(e):
                raise
            raise ConfigError(
                f"task(s) {', '.join(tasks)} download their data from the Hugging Face hub, which is unreachable"
                f"{f' ({why})' if why else ''} and has not cached it: run where the hub is reachable, or define a "
                "local task over json/jsonl files and pass its folder with --include-path"
            ) from None


def flat_metrics(results: dict[str, Any]) -> dict[str, float]:
    """{"task/metric": value} of lm-eval's results, numbers only ("acc,none" becomes "acc"; stderr left out)."""
    flat = {}
    for task, metrics in results.get("results", {}).items():
        for key, value in metrics.items():
            metric, comma, filt = key.partition(",")  # lm-eval names a metric "name,filter"
            if (
                comma
                and isinstance(value, int | float)
                and not isinstance(value, bool)
                and "stderr" not in metric
            ):
                flat[f"{task}/{metric}" + ("" if filt in ("", "none") else f"/{filt}")] = float(value)
    return flat
