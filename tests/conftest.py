"""Shared fixtures: real text from the shared data folder ($MINIGPT_SHARED_DATA, else ../shared/data; skipped
with a reason when absent) and small corpora; helpers the corpus, token store and loader tests share."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from minigpt.config import ConfigError, DataConfig

if TYPE_CHECKING:
    from minigpt.data.store import TokenStore

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA_VARIABLE = "MINIGPT_SHARED_DATA"


def shared_data() -> Path:
    """The folder of real text the tests read: $MINIGPT_SHARED_DATA, else `shared/data` beside the clone."""
    return Path(os.environ.get(SHARED_DATA_VARIABLE) or REPO.parent / "shared" / "data")


def need_shared(relative: str, what: str) -> Path:
    """The shared data folder's `relative` path, or skip the test with a reason that says how to provide it."""
    path = shared_data() / relative
    if not path.exists():
        pytest.skip(
            f"{what} not found at {path}: set ${SHARED_DATA_VARIABLE} to the shared data folder "
            "(docs/data.md#the-shared-data-folder-tests-and-benchmarks)"
        )
    return path


LEGACY_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _known_to_xla(flag: str) -> bool:
    """Whether this jaxlib's XLA takes `flag` (it aborts on a flag it does not know)."""
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    env = {**os.environ, "XLA_FLAGS": flag, "JAX_PLATFORMS": "cpu"}
    return subprocess.run(probe, env=env, capture_output=True, timeout=120).returncode == 0


if "MINIGPT_TEST_XLA_FLAGS" not in os.environ:  # probed once, by pytest's first process; the rest inherit it
    emitters = LEGACY_EMITTERS if _known_to_xla(LEGACY_EMITTERS) else ""
    os.environ["MINIGPT_TEST_XLA_FLAGS"] = f"--xla_backend_optimization_level=0 {emitters}".strip()
FAST_BACKEND_FLAGS = os.environ["MINIGPT_TEST_XLA_FLAGS"]
"""Every test process (pytest's, and every command or worker a test starts, which inherit them) compiles
without LLVM's optimisations of the CPU machine code, and with XLA:CPU's older elemental emitters rather
than its MLIR fusion emitters: together a quarter to a third of the compile time, which is most of what the
suite's small programs cost. Partitioning (the shardings, collectives and per-device programs tests check)
and numerics are decided in XLA's HLO passes before either; the pinned losses hold to float32's rtol 1e-5.
What they leave out only makes the machine code slower. A process that sets its own XLA_FLAGS adds them."""
if FAST_BACKEND_FLAGS not in os.environ.get("XLA_FLAGS", ""):  # read when JAX starts, after this
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_BACKEND_FLAGS}".strip()
OPTIMISED = {"XLA_FLAGS": ""}
"""`run_cli`'s env for a command whose run, not its compile, is most of its time (a real vocabulary's output
layer, the cpu preset's steps): there unoptimised machine code would cost more than it saves."""


WORKDIR = Path(tempfile.mkdtemp(prefix="minigpt-tests-cwd-"))
WORKDIR.chmod(0o755)  # commands started as another user (test_faults) must be able to enter it
"""The working folder of every command a test starts: a command's default paths (runs/cpu, cpu.npz) never
land in the clone, where a user's own quick start keeps its run."""


@pytest.fixture(autouse=True)
def _own_working_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process tests run in their own temporary folder, for the same reason as WORKDIR."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(autouse=True)
def _full_precision_on_accelerators(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tests of the model's numerics (marked `device`, the ones `pytest -m device` runs on an accelerator)
    compare at float32's full precision there: a TPU's default rounds float32 products' operands to bfloat16.
    On a CPU, where that is already so, JAX is left unstarted until a test starts it."""
    if request.node.get_closest_marker("device") is None or "jax" not in sys.modules:
        yield
        return
    import jax

    if jax.default_backend() == "cpu":
        yield
        return
    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="session")
def bf16_fast_path() -> bool:
    """Whether XLA:CPU here sends a bfloat16 product to its fast library (YNNPACK, on AMX or AVX-512 BF16);
    elsewhere it emulates bfloat16, in another summation order."""
    import jax
    import jax.numpy as jnp

    from minigpt.nn.matmul import dot
    from minigpt.tools.dots import dots

    a = jnp.ones((256, 256), jnp.bfloat16)
    hlo = jax.jit(lambda a: dot(a, a, (1, 0))).lower(a).compile().as_text()
    return jax.default_backend() == "cpu" and any(d.fast for d in dots(hlo))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One token cache per test session: tests never read a user's cache, and real-data tests share work."""
    return str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def hf() -> tuple:
    """(torch, transformers) on the CPU, for the tests that compare with them (test-only dependencies)."""
    torch = pytest.importorskip("torch", reason="torch (a test-only dependency: pip install -e '.[test]')")
    transformers = pytest.importorskip("transformers", reason="transformers (a test-only dependency)")
    torch.set_num_threads(2)
    return torch, transformers


@pytest.fixture(scope="session")
def sft(tmp_path_factory: pytest.TempPathFactory, hf) -> Path:
    """A folder with a Llama chat checkpoint (checkpoint/) whose template marks the assistant's text, and
    conversations to fine-tune it on (train.jsonl, 16) and to validate with (val.jsonl, 4 others)."""
    from fixtures.checkpoints import GENERATION_CHATML, chat_checkpoint, conversations

    folder = tmp_path_factory.mktemp("sft")
    chat_checkpoint(folder / "checkpoint", hf, template=GENERATION_CHATML)
    for name, examples in (("train", conversations(16)), ("val", conversations(4, 1, ("Sam", "Zoe")))):
        (folder / f"{name}.jsonl").write_text("".join(json.dumps(e) + "\n" for e in examples))
    return folder


@pytest.fixture(scope="session")
def tinystories() -> Path:
    return need_shared("tinystories/train.txt", "real TinyStories text").parent


@pytest.fixture(scope="session")
def gpt2_dir() -> Path:
    return need_shared("gpt2/vocab.bpe", "GPT-2's BPE files").parent


def write_corpus(path: Path, docs: list[str]) -> Path:
    path.write_text("".join(f"{d}\n<|endoftext|>\n" for d in docs))
    return path


DOCS = [  # 120 made-up documents with multi-byte characters
    f"Doc {i}: {['Tom', 'Mia', 'Sam', 'Lily'][i % 4]} saw {['a cat', 'the sea', 'a big tree'][i % 3]}.\n"
    f"They played {'all day ' * (i % 5)}and it was caf\u00e9 time {i * 7}. \u2014 \U0001f431"
    for i in range(120)
]


def data_cfg(corpus: Path | str, cache_dir: Path | str, **kw) -> DataConfig:
    """A DataConfig reading one corpus into `cache_dir`, by default with a small (300-token) trained BPE."""
    kw.setdefault("tokenizer", "bpe")
    kw.setdefault("bpe_vocab_size", 300)
    return DataConfig(paths=(str(corpus),), cache_dir=str(cache_dir), **kw)


def raises_config_error(message: str):
    """Expect a ConfigError whose message contains `message` verbatim."""
    return pytest.raises(ConfigError, match=re.escape(message))


def stored_docs(store: TokenStore, split: str) -> list[str]:
    """Decode a split back into documents, checking that one end-of-text token closes each."""
    tok = store.tokenizer()
    tokens, starts = np.asarray(store.tokens(split)), np.asarray(store.doc_starts(split))
    docs = []
    for s, e in zip(starts, [*starts[1:], len(tokens)], strict=True):
        assert tokens[e - 1] == tok.eot_id and tok.eot_id not in tokens[s : e - 1]
        docs.append(tok.decode(tokens[s : e - 1]))
    assert len(tokens) == store.meta["splits"][split]["tokens"]
    assert len(docs) == store.meta["splits"][split]["documents"]
    return docs


@pytest.fixture
def small_corpus(tmp_path: Path) -> Path:
    """~200 short made-up documents: enough for a byte-level BPE and a few batches, built in milliseconds."""
    names = ["Tom", "Mia", "Sam", "Lily", "Ben"]
    things = ["a red ball", "a big tree", "the blue sea", "a small cat", "a kind dog"]
    docs = [
        f"{names[i % 5]} saw {things[(i * 3) % 5]}. {names[(i + 1) % 5]} said hello to {things[(i + 2) % 5]}. "
        f"They played all day and were happy. The end {i}."
        for i in range(200)
    ]
    return write_corpus(tmp_path / "corpus.txt", docs)


def _session_cache(config: pytest.Config) -> Path:
    """The folder for minigpt's per-machine cache (the measured CPU peak, compiled programs) that every process
    of this test run shares, pytest-xdist's workers included: named for the run's id, which the controller
    hands each worker."""
    if hasattr(config, "workerinput"):
        uid = config.workerinput["testrunuid"]
    else:  # the controller (or the only process): fix the id xdist will hand its workers
        uid = getattr(config.option, "testrunuid", None) or uuid.uuid4().hex
        if hasattr(config.option, "testrunuid"):
            config.option.testrunuid = uid
    return Path(tempfile.gettempdir()) / f"minigpt-test-cache-{uid}"


def pytest_configure(config: pytest.Config) -> None:
    """Point minigpt's per-machine cache at the test run's own folder, not the user's: `minigpt` commands the
    tests start compile each program once per test run (not once per test file) and read it back after."""
    folder = _session_cache(config)
    folder.mkdir(exist_ok=True)
    os.environ["MINIGPT_CACHE_DIR"] = str(folder)
    if hasattr(config.option, "loadscopereorder"):  # xdist hands out files in our order (SLOWEST_FILES)
        config.option.loadscopereorder = False


SLOWEST_FILES = ("test_train.py", "test_harness.py", "test_checkpoint.py", "test_hf.py", "test_faults.py",
                 "test_lora.py", "test_trainer.py", "test_sharding.py", "test_model.py", "test_compile_cache.py",
                 "test_plan.py", "test_generate.py", "test_cli.py", "test_watchdog.py", "test_loss.py",
                 "test_metrics.py", "test_bench.py", "test_engine.py", "test_server.py", "test_api.py")  # fmt: skip
"""The test files that take longest, slowest first. `--dist loadfile` hands each file whole to a worker in
collection order: these go first and the short files fill in at the end, so both workers finish together.
(xdist's own order, by number of tests, handed out files of a few long tests, test_checkpoint's among them,
half way through the run.)"""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Collect SLOWEST_FILES first, in that order; the rest keep theirs (a stable sort)."""
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def pytest_unconfigure(config: pytest.Config) -> None:
    """The controller removes the shared folder once every worker is done."""
    if not hasattr(config, "workerinput"):
        shutil.rmtree(_session_cache(config), ignore_errors=True)


_JAX_CACHE: list[Path] = []  # this worker's folder for JAX's own compilation cache, made by the fixture below


@pytest.fixture(scope="session", autouse=True)
def _jax_compilation_cache(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A compilation cache for this worker's `python -c` children, which start JAX without the `minigpt`
    command and so keep JAX's own cache, whose writes are not atomic: one folder per worker, which runs its
    tests one at a time. Each program is still compiled for real the first time a worker meets it."""
    _JAX_CACHE.append(tmp_path_factory.mktemp("jax-cache"))


@pytest.fixture(scope="session", autouse=True)
def _jax_started() -> None:
    """Start the pytest process's JAX before any test: `minigpt train` (and `plan`) split a CPU that JAX has
    not started on into one device per core, so whichever test first trained in this process would otherwise
    change the devices of every test after it. The split is tested in subprocesses, as users meet it.

    The pytest process keeps no compilation cache (a `minigpt` command run in-process asks for one), so
    in-process tests that read a compiled step's memory or cost see a fresh compilation."""
    import jax

    jax.config.update("jax_enable_compilation_cache", False)
    jax.devices()


def subprocess_env(**extra: str) -> dict[str, str]:
    """os.environ for a `python -c` child: unbuffered, with this worker's JAX compilation cache, plus `extra`."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if _JAX_CACHE:
        env["JAX_COMPILATION_CACHE_DIR"] = str(_JAX_CACHE[-1])
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    return {**env, **extra}


WITHOUT_TORCH = Path(__file__).parent / "without_torch"


def run_cli(*args: str, env: dict | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run `python -m minigpt.cli ...` as a user would (without PyTorch: see tests/without_torch/sitecustomize.py),
    capturing output."""
    return subprocess.run(
        [sys.executable, "-m", "minigpt.cli", *args],
        capture_output=True,
        text=True,
        env=cli_env(**(env or {})),
        timeout=timeout,
        cwd=WORKDIR,
    )


def cli_env(**extra: str) -> dict[str, str]:
    """`subprocess_env(**extra)` with tests/without_torch first on PYTHONPATH and minigpt's own compilation
    cache (shared by the whole test run) instead of the worker's JAX one: the environment `run_cli` gives its
    child, for tests that start `python -m minigpt.cli` themselves (another cwd, signals, side by side)."""
    path = os.pathsep.join(p for p in (str(WITHOUT_TORCH), os.environ.get("PYTHONPATH", "")) if p)
    env = subprocess_env(**{"PYTHONPATH": path, **extra})
    for name in ("JAX_COMPILATION_CACHE_DIR", "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"):
        if name not in extra:  # the command's own cache, in the test run's MINIGPT_CACHE_DIR
            env.pop(name, None)
    return env


def start_cli(*args: str, env: dict | None = None) -> subprocess.Popen:
    """`minigpt ARGS` as `run_cli` runs it, but started in the background with its output piped (text): for
    commands that must run side by side, or be watched and signalled; collect it with `.communicate()`."""
    return subprocess.Popen(
        [sys.executable, "-m", "minigpt.cli", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=cli_env(**(env or {})),
        cwd=WORKDIR,
    )


def run_on_devices(code: str, devices: int = 8, timeout: float = 900) -> dict:
    """Run `code` in a fresh Python with `devices` emulated CPU devices; it must print one JSON line last.

    XLA fixes the device count when JAX starts, so multi-device tests each get their own process."""
    return run_on_devices_logged(code, devices, timeout)[0]


def run_on_devices_logged(code: str, devices: int = 8, timeout: float = 900) -> tuple[dict, str]:
    """`run_on_devices`, and what the process wrote to stderr (XLA's own warnings among it)."""
    flags = f"--xla_force_host_platform_device_count={devices} {FAST_BACKEND_FLAGS}"
    env = subprocess_env(
        XLA_FLAGS=flags, JAX_PLATFORMS="cpu"
    )  # emulated CPU devices, on an accelerator's host too
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout, cwd=WORKDIR
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1]), out.stderr


TINY_FLAGS = [
    "--model.d-model", "32", "--model.n-heads", "4", "--model.n-layers", "1", "--model.d-ff", "64",
    "--model.max-seq-len", "32", "--data.seq-len", "16", "--data.bpe-vocab-size", "300", "--batch-size", "4",
]  # fmt: skip


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """(corpus, cache, run): a TINY_FLAGS model trained 4 steps by `minigpt train`, checkpoints at steps 2 and
    4, made once per session for the checkpoint and fault tests; a test that changes the run copies it first."""
    root = tmp_path_factory.mktemp("tiny-run")
    corpus = root / "corpus.txt"
    corpus.write_text(
        "".join(f"Tom saw a red ball {i}. They played all day. The end.\n<|endoftext|>\n" for i in range(300))
    )
    out = run_cli("train", "--data", str(corpus), "--data.cache-dir", str(root / "cache"), "--run-dir",
                  str(root / "run"), *TINY_FLAGS, "--log-every", "1", "--eval-every", "1000", "--sample-tokens",
                  "4", "--steps", "4", "--ckpt-every", "2")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return corpus, root / "cache", root / "run"


def cli_error(capsys: pytest.CaptureFixture, argv: list[str]) -> str:
    """Run `minigpt ARGV` in-process and return its error: exactly one line, exit status 2, no traceback."""
    from minigpt.cli import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("minigpt: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


@pytest.fixture(scope="session")
def chat_run(tmp_path_factory: pytest.TempPathFactory, hf: tuple) -> Path:
    """A small chat model as transformers saves one (ChatML, <|im_end|> ends a turn, context 128), imported
    as a run directory: what the serving tests serve."""
    from fixtures.checkpoints import chat_checkpoint
    from minigpt.hf import import_hf

    root = tmp_path_factory.mktemp("chat-run")
    chat_checkpoint(root / "hf", hf)
    return import_hf(root / "hf", root / "run")[0]
