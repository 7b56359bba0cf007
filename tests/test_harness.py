"""The lm-evaluation-harness backend (harness.py, scoring.py): it agrees with lm-eval's own `hf` backend on
the same model exported to transformers, scores any text's bits per byte, runs on a split mesh, scores tasks
during training, and refuses bad requests in one line. Tasks are local YAML files over jsonl data written by
the tests (this machine cannot reach the Hugging Face hub)."""

from __future__ import annotations

import contextlib
import io
import json
import math
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import cli_error, run_cli, run_on_devices

lm_eval = pytest.importorskip("lm_eval", reason="lm-evaluation-harness (pip install -e '.[test]')")

from minigpt.cli import main  # noqa: E402
from minigpt.data.tokenizer import EOT  # noqa: E402
from minigpt.inference import harness  # noqa: E402
from minigpt.inference.scoring import Scorer, rolling_windows, text_bits_per_byte, total_bits_per_byte  # noqa: E402
from minigpt.training.runs import load_model  # noqa: E402
from minigpt.training.trainer import token_nll  # noqa: E402

TASKS = ("tiny_mc", "tiny_ppl", "tiny_gen")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("harness")


@pytest.fixture(scope="module")
def stories(tinystories: Path) -> list[str]:
    docs = (tinystories / "valid.txt").read_text().split(EOT)
    return [" ".join(d.split()) for d in docs if len(d.split()) > 40]


@pytest.fixture(scope="module")
def run(tinystories: Path, root: Path) -> Path:
    """The cpu preset's block, smaller, trained 150 steps on ~400 KB of TinyStories: enough that some
    continuations are its greedy choice. In float32: the tests compare scores computed in different ways,
    and with transformers, to float32's precision."""
    text = (tinystories / "train.txt").read_text()
    (root / "train.txt").write_text(text[: text.index(EOT, 400_000) + len(EOT)] + "\n")
    with contextlib.redirect_stdout(io.StringIO()):  # in this process: the run is not what is under test
        main(["train", "--preset", "cpu", "--data", str(root / "train.txt"), "--val-data",
              str(tinystories / "valid.txt"), "--data.cache-dir", str(root / "cache"), "--run-dir",
              str(root / "run"), "--max-time", "0", "--steps", "150", "--model.d-model", "64",
              "--model.n-layers", "2", "--model.d-ff", "256", "--model.max-seq-len", "128",
              "--data.seq-len", "64", "--batch-size", "8", "--data.bpe-vocab-size", "512",
              "--eval-every", "0", "--eval-batches", "2", "--sample-tokens", "4", "--model.dtype", "float32"])  # fmt: skip
    return root / "run"


def _yaml(name: str, data: Path, body: str) -> str:
    return (
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\n{body}"
    )


@pytest.fixture(scope="module")
def tasks(root: Path, stories: list[str]) -> Path:
    """A folder of three local tasks: multiple choice (a story's next words against other stories'), rolling
    perplexity over whole stories (some longer than the model's 128-token context), and greedy generation
    stopped at a full stop."""
    rng = random.Random(0)
    folder = root / "tasks"
    folder.mkdir()
    mc = [  # two whose answer a model of TinyStories predicts greedily
        {"context": "Once upon a", "choices": ["time", "dog", "red"], "label": 0},  # lm-eval adds the space
        {"context": "Once upon a time, there was a little", "choices": ["girl", "of", "ran"], "label": 0},
    ]
    for i, s in enumerate(stories[:22]):
        words = s.split()
        wrong = [" ".join(stories[(i + k) % len(stories)].split()[20:24]) for k in (7, 13, 29)]
        choices = [" ".join(words[8:12]), *wrong]
        rng.shuffle(choices)
        mc.append(
            {
                "context": " ".join(words[:8]),
                "choices": choices,
                "label": choices.index(" ".join(words[8:12])),
            }
        )
    rows = {
        "mc": mc,
        "ppl": [{"text": s} for s in stories[30:36]],
        "gen": [{"prompt": " ".join(s.split()[:10]), "answer": ""} for s in stories[40:44]],
    }
    for name, items in rows.items():
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in items))
    mean = "    aggregation: mean\n    higher_is_better: true\n"
    (folder / "mc.yaml").write_text(_yaml("tiny_mc", folder / "mc.jsonl",
        'output_type: multiple_choice\ndoc_to_text: "{{context}}"\ndoc_to_target: "{{label}}"\n'
        f'doc_to_choice: "{{{{choices}}}}"\nmetric_list:\n  - metric: acc\n{mean}  - metric: acc_norm\n{mean}'))  # fmt: skip
    (folder / "ppl.yaml").write_text(_yaml("tiny_ppl", folder / "ppl.jsonl",
        'output_type: loglikelihood_rolling\ndoc_to_text: ""\ndoc_to_target: "{{text}}"\nmetric_list:\n'
        "  - metric: word_perplexity\n    aggregation: weighted_perplexity\n    higher_is_better: false\n"
        "  - metric: bits_per_byte\n    aggregation: bits_per_byte\n    higher_is_better: false\n"))  # fmt: skip
    (folder / "gen.yaml").write_text(_yaml("tiny_gen", folder / "gen.jsonl",
        'output_type: generate_until\ndoc_to_text: "{{prompt}}"\ndoc_to_target: "{{answer}}"\n'
        'generation_kwargs:\n  until: ["."]\n  max_gen_toks: 24\n  do_sample: false\n'
        f"metric_list:\n  - metric: exact_match\n{mean}"))  # fmt: skip
    return folder


def _responses(results: dict) -> dict[tuple, object]:
    """(task, document, request) -> the model's raw answer: (log-likelihood, is greedy), a float, or text."""
    return {
        (task, s["doc_id"], k): r[0] for task, samples in results["samples"].items() for s in samples
        for k, r in enumerate(s["resps"])
    }  # fmt: skip


@pytest.mark.slow
def test_minigpt_and_hf_backends_agree_on_the_exported_model(run: Path, tasks: Path, root: Path) -> None:
    """Every request of a multiple-choice, a rolling-perplexity and a generation task, scored by minigpt's
    backend and by lm-eval's `hf` backend on the `--format hf` export: log-likelihoods within 1e-4, the same
    greedy flags, accuracy and generated text."""
    pytest.importorskip("torch", reason="torch (a test-only dependency)")
    with contextlib.redirect_stdout(io.StringIO()):
        main(["export", "--run", str(run), "--format", "hf", "--out", str(root / "hf")])
    manager = harness.task_manager(TASKS, tasks)
    common = {"tasks": list(TASKS), "task_manager": manager, "bootstrap_iters": 0, "verbosity": "ERROR"}
    ours = lm_eval.simple_evaluate(model=harness.MiniGPTLM(run=str(run), batch_size=8), **common)
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={root / 'hf'},dtype=float32", device="cpu", batch_size=8, **common
    )
    a, b = _responses(ours), _responses(theirs)
    assert a.keys() == b.keys() and len(a) == 2 * 3 + 22 * 4 + 6 + 4
    for key in a:
        if key[0] == "tiny_mc":
            assert a[key][0] == pytest.approx(b[key][0], abs=1e-4) and a[key][1] == b[key][1], key
        elif key[0] == "tiny_ppl":
            assert a[key] == pytest.approx(b[key], abs=1e-4), key
        else:
            assert a[key] == b[key] and "." not in a[key], key
    assert any(a[k][1] for k in a if k[0] == "tiny_mc"), (
        "no continuation was the greedy choice: test too weak"
    )
    for metric in ("acc,none", "acc_norm,none"):
        assert ours["results"]["tiny_mc"][metric] == theirs["results"]["tiny_mc"][metric]


def test_rolling_windows_are_lm_evals() -> None:
    """Every token predicted once, each window as lm-eval's get_rolling_token_windows + make_disjoint_window
    makes it, for texts shorter than, equal to and several times the context."""
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    for n in (0, 1, 5, 16, 17, 33, 100):
        tokens = list(range(1000, 1000 + n))
        theirs = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, 7, 16, 1)]
        assert rolling_windows(tokens, 7, 16) == theirs
        assert [t for _, cont in rolling_windows(tokens, 7, 16) for t in cont] == tokens


def test_text_bits_per_byte_is_the_models_own_likelihood(run: Path) -> None:
    """`--text`'s bits per byte of a text that fits the context equals its negative log-likelihood from one
    plain forward pass (after end-of-text) over its UTF-8 bytes; several texts are weighted by bytes, and a
    text longer than the context is scored in windows that predict every token once."""
    setup, params, tokenizer, _ = load_model(run)
    short, long = "Lily saw a big red ball in the park. She was happy.", "Tom ran to the sea. " * 60
    ids = [tokenizer.eot_id, *tokenizer.encode(short)]
    nll = np.asarray(token_nll(setup.graphdef, params, np.array([ids], np.int32)))[0]
    rows = text_bits_per_byte(Scorer(setup, params, batch_size=4), tokenizer, [short, long])
    assert rows[0]["bpb"] == pytest.approx(nll.sum() / math.log(2) / len(short.encode()), rel=1e-5)
    assert rows[1]["tokens"] > setup.cfg.model.max_seq_len and rows[1]["bytes"] == len(long.encode())
    both = (rows[0]["nats"] + rows[1]["nats"]) / math.log(2) / (len(short.encode()) + len(long.encode()))
    assert total_bits_per_byte(rows) == pytest.approx(both)


@pytest.mark.slow
def test_cli_eval_tasks_prints_lm_evals_table_saves_json_and_measures_text(
    run: Path, tasks: Path, root: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`minigpt eval --tasks` and `minigpt lm-eval`, both run in this process (lm-eval's command line reads
    sys.argv, put back afterwards)."""
    (root / "a.txt").write_text("Once upon a time there was a little dog.\n")
    main(["eval", "--run", str(run), "--tasks", "tiny_mc,tiny_ppl", "--include-path", str(tasks),
          "--limit", "8", "--bootstrap-iters", "0", "--text", str(root / "a.txt")])  # fmt: skip
    out = capsys.readouterr().out
    assert "|tiny_mc" in out and "acc" in out and "bits/byte" in out
    saved = json.loads((run / "evals" / "tasks-step150.json").read_text())
    assert saved["step"] == 150 and saved["results"]["tiny_mc"]["sample_len"] == 8
    assert 0 <= saved["results"]["tiny_mc"]["acc,none"] <= 1
    monkeypatch.setattr(sys, "argv", sys.argv)
    main(["lm-eval", "--model", "minigpt", "--model_args", f"run={run},batch_size=8", "--tasks", "tiny_mc",
          "--include_path", str(tasks), "--limit", "8"])  # fmt: skip
    theirs = capsys.readouterr().out
    acc = re.escape(f"{saved['results']['tiny_mc']['acc,none']:.4g}")
    assert "|tiny_mc" in theirs and re.search(rf"\|\s*{acc}\|", theirs)  # right-aligned in its column


@pytest.mark.slow
def test_the_same_loglikelihoods_on_eight_devices_with_the_model_split(run: Path) -> None:
    """Tensor parallel x data parallel over 8 emulated devices scores as one device does."""
    requests = [("Once upon a time", " there was a cat."), ("Tom saw", " a big dog and ran home.")] * 5
    code = f"""
import json
from minigpt.inference.harness import MiniGPTLM
lm = MiniGPTLM(run={str(run)!r}, tensor=2, batch_size=4, progress=False)
pairs = [lm._encode_pair(c, x) for c, x in {requests!r}]
print(json.dumps(lm.scorer.loglikelihoods(pairs)))
"""
    split = run_on_devices(code, devices=8)
    lm = harness.MiniGPTLM(run=str(run), batch_size=4, progress=False)
    one = lm.scorer.loglikelihoods([lm._encode_pair(c, x) for c, x in requests])
    assert [g for _, g in one] == [g for _, g in split]
    np.testing.assert_allclose([v for v, _ in split], [v for v, _ in one], atol=1e-4)


@pytest.mark.slow
def test_eval_tasks_during_training_write_metrics_at_the_chosen_steps(
    tinystories: Path, root: Path, tasks: Path, capsys: pytest.CaptureFixture
) -> None:
    run_dir = root / "tasks-run"
    main(["train", "--preset", "cpu", "--data", str(root / "train.txt"), "--val-data",
          str(tinystories / "valid.txt"), "--data.cache-dir", str(root / "cache"), "--run-dir",
          str(run_dir), "--max-time", "0", "--steps", "10", "--model.d-model", "64", "--model.n-layers",
          "1", "--model.d-ff", "128", "--model.max-seq-len", "128", "--data.seq-len", "64", "--batch-size",
          "8", "--data.bpe-vocab-size", "512", "--eval-batches", "2", "--sample-tokens", "4",
          "--eval-tasks", "tiny_mc", "--eval-tasks-every", "4", "--eval-tasks-limit", "6",
          "--eval-tasks-include-path", str(tasks)])  # fmt: skip
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    scored = [r for r in records if r["kind"] == "tasks"]
    assert [r["step"] for r in scored] == [4, 8, 10]
    assert all(0 <= r["tiny_mc/acc"] <= 1 and "tiny_mc/acc_norm" in r for r in scored)
    assert "tiny_mc/acc" in out and (run_dir / "loss.png").is_file()


def test_an_unknown_task_is_one_line_naming_close_ones(
    capsys: pytest.CaptureFixture, run: Path, tasks: Path, tmp_path: Path
) -> None:
    err = cli_error(capsys, ["eval", "--run", str(run), "--tasks", "tiny_mcc", "--include-path", str(tasks)])
    assert "unknown task 'tiny_mcc'" in err and "tiny_mc" in err and "--include-path" in err
    err = cli_error(
        capsys, ["eval", "--run", str(run), "--tasks", "x", "--include-path", str(tmp_path / "no")]
    )
    assert "is not a folder of task YAML files" in err
    err = cli_error(capsys, ["train", "--eval-tasks", "hellaswagg", "--eval-tasks-include-path", str(tasks),
                             "--run-dir", str(tmp_path / "r")])  # fmt: skip
    assert (
        "unknown task 'hellaswagg'" in err
        and "hellaswag" in err
        and not (tmp_path / "r" / "config.json").exists()
    )


def test_a_run_without_a_checkpoint_is_one_line(
    capsys: pytest.CaptureFixture, run: Path, tasks: Path, tmp_path: Path
) -> None:
    """A run directory whose training never saved (config and tokenizer, no checkpoints), and a folder that
    is not a run at all."""
    shutil.copytree(run, tmp_path / "unsaved", ignore=shutil.ignore_patterns("checkpoints"))
    for path in (tmp_path / "unsaved", tmp_path):
        err = cli_error(
            capsys, ["eval", "--run", str(path), "--tasks", "tiny_mc", "--include-path", str(tasks)]
        )
        assert str(path) in err, err


@pytest.mark.slow
@pytest.mark.parametrize("hub", ["offline", "unreachable"])
def test_a_hub_task_offline_is_one_line(run: Path, hub: str, tmp_path: Path) -> None:
    """Offline by the user's setting, or a hub that does not answer (a closed loopback port): one line, from
    one request, without the datasets library's minutes of retries."""
    env = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"} if hub == "offline" else {
        "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}  # fmt: skip
    out = run_cli("eval", "--run", str(run), "--tasks", "lambada_openai", env=env)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert "Retrying" not in out.stderr and "retry" not in out.stderr.lower(), out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("minigpt: error: ") and "Hugging Face hub" in last and "--include-path" in last


def test_generation_stops_at_the_first_stop_sequence() -> None:
    assert harness.cut_at_stop("a cat. a dog\n", [".", "\n"]) == "a cat"
    assert harness.cut_at_stop("a cat\n. a dog", [".", "\n"]) == "a cat"
    assert harness.cut_at_stop("no stop here", ["."]) == "no stop here"
    assert harness.cut_at_stop("kept", ["", "x"]) == "kept"


def test_example_limits_are_counts_fractions_or_all() -> None:
    """`minigpt eval --limit` and `train --eval-tasks-limit` (where 0 means all) as lm-eval takes them."""
    assert [harness.example_limit(x) for x in (None, 0.0, 0.25, 8.0, 1.0)] == [None, None, 0.25, 8, 1]
    assert isinstance(harness.example_limit(8.0), int)


def _last_error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """`minigpt ARGV` in this process: exit status 2, no traceback, and the error as its last line (the
    datasets library prints its progress on stderr before it)."""
    from minigpt.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("minigpt: error: "), err[-3000:]
    return err.strip().splitlines()[-1]


def test_a_task_file_that_cannot_be_read_or_rendered_is_one_line_naming_it(
    capsys: pytest.CaptureFixture, run: Path, tasks: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A template naming a field the documents lack (jinja2's UndefinedError), and a YAML file that does not
    parse (which lm-eval's index skips without a word, so its task was "unknown"): `eval --tasks` and
    `minigpt lm-eval` name the file and what is wrong."""
    missing, broken = tmp_path / "missing", tmp_path / "broken"
    for folder in (missing, broken):
        folder.mkdir()
        shutil.copy(tasks / "mc.jsonl", folder)
    text = (tasks / "mc.yaml").read_text().replace(str(tasks), str(missing))
    (missing / "mc.yaml").write_text(
        text.replace('doc_to_text: "{{context}}"', 'doc_to_text: "{{question}}"')
    )
    (broken / "mc.yaml").write_text(text.replace(str(missing), str(broken)) + "  - metric: x\n   bad: [\n")
    err = _last_error(
        capsys, ["eval", "--run", str(run), "--tasks", "tiny_mc", "--include-path", str(missing)]
    )
    assert f"task file {missing / 'mc.yaml'}: its template failed" in err and "'question' is undefined" in err
    err = _last_error(
        capsys, ["eval", "--run", str(run), "--tasks", "tiny_mc", "--include-path", str(broken)]
    )
    assert f"task file {broken / 'mc.yaml'} is not valid YAML (line " in err, err
    monkeypatch.setattr(sys, "argv", sys.argv)  # lm-eval's command line reads it; put back afterwards
    err = _last_error(capsys, ["lm-eval", "--model", "minigpt", "--model_args", f"run={run}", "--tasks", "tiny_mc",
                               "--include_path", str(broken)])  # fmt: skip
    assert err.startswith(f"minigpt: error: task file {broken / 'mc.yaml'}"), err


@pytest.mark.slow
def test_lm_evals_backends_agree_on_an_imported_chat_checkpoint(tasks: Path, root: Path, hf: tuple) -> None:
    """A checkpoint with its own tokenizer, a BOS and end-of-turn stop ids, imported: minigpt's backend on
    the run and lm-eval's `hf` backend on the original folder give the same log-likelihoods (rolling ones
    from the BOS, as hf's prefix token), the same greedy flags and the same generated text."""
    torch, transformers = hf
    from fixtures.checkpoints import chat_checkpoint
    from minigpt.hf import import_hf

    chat_checkpoint(root / "chat-hf", (torch, transformers))
    run, _, _ = import_hf(root / "chat-hf", root / "chat-run")
    manager = harness.task_manager(TASKS, tasks)
    common = {"tasks": list(TASKS), "task_manager": manager, "bootstrap_iters": 0, "verbosity": "ERROR"}
    ours = lm_eval.simple_evaluate(model=harness.MiniGPTLM(run=str(run), batch_size=8), **common)
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={root / 'chat-hf'},dtype=float32", device="cpu", batch_size=8,
        **common,
    )  # fmt: skip
    _same_responses(ours, theirs)


def _same_responses(ours: dict, theirs: dict) -> None:
    a, b = _responses(ours), _responses(theirs)
    assert a.keys() == b.keys()
    for key in a:
        if key[0] == "tiny_mc":
            assert a[key][0] == pytest.approx(b[key][0], abs=1e-4) and a[key][1] == b[key][1], key
        elif key[0] == "tiny_ppl":  # sums over hundreds of tokens: float32's relative precision
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-4), key
        else:
            assert a[key] == b[key], key


@pytest.mark.slow
def test_lm_evals_backends_agree_on_a_lora_run(tasks: Path, root: Path, sft: Path) -> None:
    """A run fine-tuned with LoRA on conversations: minigpt's backend on the run (base and adapters) and
    lm-eval's `hf` backend on its merged transformers export give the same responses."""
    from sft_runs import minigpt_config, minigpt_losses

    from minigpt.hf import export_hf

    cfg = minigpt_config(sft, 3, "--lora.rank", "4", run="run-lora-harness")
    minigpt_losses(cfg)
    export_hf(cfg.run_dir, root / "lora-merged")
    manager = harness.task_manager(TASKS, tasks)
    common = {"tasks": list(TASKS), "task_manager": manager, "bootstrap_iters": 0, "verbosity": "ERROR"}
    ours = lm_eval.simple_evaluate(model=harness.MiniGPTLM(run=cfg.run_dir, batch_size=8), **common)
    theirs = lm_eval.simple_evaluate(
        model="hf", model_args=f"pretrained={root / 'lora-merged'},dtype=float32", device="cpu", batch_size=8,
        **common,
    )  # fmt: skip
    _same_responses(ours, theirs)


def test_perplexity_tasks_of_a_tokenizer_that_loses_text_are_refused(tmp_path: Path, hf: tuple) -> None:
    """lm-eval's bits per byte divide by the text's bytes: with <unk> tokens standing for text the model never
    scores (SentencePiece without byte fallback) they would be meaningless, so a rolling request is refused."""
    from lm_eval.api.instance import Instance

    from fixtures.checkpoints import spm_checkpoint
    from minigpt.config import ConfigError
    from minigpt.hf import import_hf

    spm_checkpoint(tmp_path / "hf", hf)
    spec = json.loads((tmp_path / "hf" / "tokenizer.json").read_text())
    spec["model"]["byte_fallback"] = False
    (tmp_path / "hf" / "tokenizer.json").write_text(json.dumps(spec))
    run, _, _ = import_hf(tmp_path / "hf", tmp_path / "run")
    lm = harness.MiniGPTLM(loaded=load_model(run)[:3], batch_size=4, progress=False)
    request = lambda text: Instance("loglikelihood_rolling", {}, (text,), 0)
    assert len(lm.loglikelihood_rolling([request("Tom saw a big red ball.")])) == 1
    with pytest.raises(
        ConfigError, match="an lm-eval perplexity text: the tokenizer changes the text it encodes"
    ):
        lm.loglikelihood_rolling([request("Tom saw 東京.")])
