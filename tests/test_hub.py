"""Hub datasets by name (`--data hf:OWNER/NAME...`), against local folders laid out like the Hugging Face hub
cache, never the network: the same tokens as the files given as local paths, split, config and file-pattern
selection, offline behaviour in one line, and downloads that arrive shard by shard (the next file while this
one is read) and are not repeated after an interruption. Only huggingface_hub's network calls
(HfApi.dataset_info, HfApi.list_repo_tree, hf_hub_download) are replaced, by doubles serving a local folder."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import pickle
import shutil
import threading
from pathlib import Path

import huggingface_hub
import huggingface_hub.constants
import huggingface_hub.errors
import huggingface_hub.hf_api
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import DOCS, data_cfg, raises_config_error

import minigpt.data.build as build_mod
import minigpt.data.corpus as corpus_mod
from minigpt.config import ConfigError, DataConfig
from minigpt.data import hub, ranged
from minigpt.data.build import prepare
from minigpt.data.corpus import download_tinystories, resolve_files

SHA = hashlib.sha1(b"commit one").hexdigest()
PARQUET = {  # owner/pq: sharded parquet, as the hub's own conversions lay it out
    "data/train-00000-of-00003.parquet": DOCS[0:30],
    "data/train-00001-of-00003.parquet": DOCS[30:60],
    "data/train-00002-of-00003.parquet": DOCS[60:90],
    "data/validation-00000-of-00001.parquet": DOCS[90:110],
}
FOLDERS = {  # owner/jsonl: split folders of JSON Lines, and a text file that is no split's
    "train/part-1.jsonl": DOCS[10:40],
    "train/part-0.jsonl": DOCS[0:10],
    "valid/part-0.jsonl": DOCS[40:50],
    "notes/LICENSE.txt": ["not data"],
}
CARD = """---
license: mit
configs:
- config_name: small
  data_files:
  - split: train
    path: small/*.jsonl
  - split: test
    path: small/test.txt
- config_name: big
  default: true
  data_files: big/**/*.parquet
---
# A dataset with two configs
"""
CONFIGS = {
    "README.md": CARD,
    "small/a.jsonl": DOCS[0:5],
    "small/b.jsonl": DOCS[5:10],
    "small/test.txt": DOCS[10:12],
    "big/x/0.parquet": DOCS[12:20],
    "big/y/1.parquet": DOCS[20:30],
}


def _payload(name: str, docs) -> bytes:
    if isinstance(docs, str):
        return docs.encode()
    if name.endswith(".parquet"):
        sink = pa.BufferOutputStream()
        pq.write_table(pa.table({"text": docs, "id": list(range(len(docs)))}), sink)
        return sink.getvalue().to_pybytes()
    if name.endswith(".jsonl"):
        return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()
    return "".join(f"{d}\n<|endoftext|>\n" for d in docs).encode()


def write_remote(root: Path, layout: dict) -> Path:
    """The dataset's files as plain local files (what the hub serves, and the local-path reference)."""
    for name, docs in layout.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(_payload(name, docs))
    return root


def cache_file(cache: Path, repo: str, name: str, data: bytes, sha: str = SHA) -> None:
    """One file placed as huggingface_hub places it: a blob, and a relative symlink in the snapshot."""
    storage = cache / f"datasets--{repo.replace('/', '--')}"
    blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    link = storage / "snapshots" / sha / name
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))


def cache_dataset(cache: Path, repo: str, remote: Path, sha: str = SHA, ref: str = "main") -> None:
    """A dataset fully in the local hub cache, as `hf download REPO --repo-type dataset` leaves it."""
    for f in sorted(remote.rglob("*")):
        if f.is_file():
            cache_file(cache, repo, f.relative_to(remote).as_posix(), f.read_bytes(), sha)
    ref_path = cache / f"datasets--{repo.replace('/', '--')}" / "refs" / ref
    ref_path.parent.mkdir(parents=True, exist_ok=True)
    ref_path.write_text(sha)


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline hub cache holding owner/pq, owner/jsonl and owner/configs; their files also under remote/."""
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for repo, layout in (("owner/pq", PARQUET), ("owner/jsonl", FOLDERS), ("owner/configs", CONFIGS)):
        cache_dataset(cache, repo, write_remote(tmp_path / "remote" / repo, layout))
    return cache


def names(files: list[Path]) -> list[str]:
    return [f.remote.name for f in files]


# --------------------------------------------------------------------------------------------- selection


def test_a_hub_dataset_tokenizes_like_its_files_given_as_local_paths(hub_cache: Path, tmp_path: Path) -> None:
    remote = tmp_path / "remote" / "owner/pq" / "data"
    local = data_cfg(remote / "train-*.parquet", tmp_path / "c1", val_paths=(str(remote / "validation-*"),))
    by_name = data_cfg("hf:owner/pq", tmp_path / "c2", val_paths=("hf:owner/pq",))  # its validation split
    a, b = prepare(local), prepare(by_name)
    for split in ("train", "val"):
        assert np.array_equal(a.tokens(split), b.tokens(split))
        assert np.array_equal(a.doc_starts(split), b.doc_starts(split))
    assert a.meta["splits"]["train"]["documents"] == 90 and a.meta["splits"]["val"]["documents"] == 20
    assert [f["sha256"] for f in a.meta["sources"]["train"]] == [
        f["sha256"] for f in b.meta["sources"]["train"]
    ]
    assert b.meta["sources"]["train"][0]["mtime_ns"] == 0  # the identity is repo, commit, name and size
    assert prepare(by_name).path == b.path  # reused
    held_out = prepare(data_cfg("hf:owner/pq", tmp_path / "c3"))  # no --val-data: val_fraction of documents
    assert held_out.meta["options"]["val_fraction"] == 0.05
    assert sum(held_out.meta["splits"][s]["documents"] for s in ("train", "val")) == 90


def test_a_run_on_hub_files_stays_resumable_when_the_hub_cache_is_cleared(
    hub_cache: Path, tmp_path: Path
) -> None:
    """A run's data.json marks hub files by repository and commit: they cannot change, so resuming or
    evaluating does not need them in the cache (a local source file that is gone is still refused)."""
    from minigpt.data.mixture import Corpus
    from minigpt.training.runs import check_sources, record_data

    remote = tmp_path / "remote" / "owner/pq" / "data"
    for name, cfg in (
        ("hub", data_cfg("hf:owner/pq", tmp_path / "c1", val_paths=("hf:owner/pq",))),
        ("local", data_cfg(remote / "train-*.parquet", tmp_path / "c2", val_paths=(str(remote / "validation-*"),))),
    ):  # fmt: skip
        (tmp_path / name).mkdir()
        record_data(tmp_path / name, Corpus.single(prepare(cfg)))
    recorded = json.loads((tmp_path / "hub" / "data.json").read_text())["sources"]["train"]
    assert [f["hub"] for f in recorded] == [f"owner/pq@{SHA}"] * len(recorded)
    shutil.rmtree(hub_cache)
    shutil.rmtree(remote)
    check_sources(tmp_path / "hub")
    with pytest.raises(ConfigError, match=r"has changed since: .*train-00000.* is gone"):
        check_sources(tmp_path / "local")


def test_a_hub_dataset_of_conversations_trains_as_its_files_do(hub_cache: Path, tmp_path: Path, hf) -> None:
    """A chat dataset as the hub publishes one (Parquet shards with a "messages" column) is training examples,
    the same as its files given as local paths, though only each split's first file is looked at before the
    build reads it; a later shard of the other kind is refused in one line naming it."""
    from fixtures.checkpoints import chat_tokenizer, conversations

    chat_tokenizer(tmp_path / "tok", hf[1])
    kw = {"tokenizer": "hf", "hf_tokenizer": str(tmp_path / "tok")}
    shards = {"data/train-00000-of-00002.parquet": 0, "data/train-00001-of-00002.parquet": 1}
    for repo, text_shards in (("owner/chats", ()), ("owner/mixed", (1,)), ("owner/late", (0, 2))):
        remote = tmp_path / "remote" / repo
        for name, seed in [*shards.items(), ("data/validation-00000-of-00001.parquet", 2)]:
            (remote / name).parent.mkdir(parents=True, exist_ok=True)
            rows = {"messages": [c["messages"] for c in conversations(6, seed)]}
            pq.write_table(pa.table({"text": DOCS[:5]} if seed in text_shards else rows), remote / name)
        cache_dataset(hub_cache, repo, remote)
    data = tmp_path / "remote" / "owner/chats" / "data"
    local = data_cfg(data / "train-*.parquet", tmp_path / "c1", val_paths=(str(data / "validation-*"),), **kw)
    a, b = (
        prepare(local),
        prepare(data_cfg("hf:owner/chats", tmp_path / "c2", val_paths=("hf:owner/chats",), **kw)),
    )
    assert a.examples and b.examples and a.meta["splits"]["train"]["documents"] == 12
    for split in ("train", "val"):
        assert np.array_equal(a.tokens(split), b.tokens(split))
    with raises_config_error(
        "train-00001-of-00002.parquet holds text, where the source's first file holds conversations"
    ):
        prepare(data_cfg("hf:owner/mixed", tmp_path / "c3", val_paths=("hf:owner/mixed",), **kw))
    with raises_config_error("train-00001-of-00002.parquet holds conversations, where text was expected"):
        prepare(data_cfg("hf:owner/late", tmp_path / "c4", val_paths=("hf:owner/late",), **kw))


def test_splits_configs_and_file_patterns_select_files_in_sorted_order(hub_cache: Path) -> None:
    shards = [f"data/train-0000{i}-of-00003.parquet" for i in range(3)]
    assert names(resolve_files(["hf:owner/pq"])) == shards
    assert names(resolve_files(["hf:owner/pq@main?split=train"])) == shards
    assert names(resolve_files(["hf:owner/pq"], "--val-data")) == ["data/validation-00000-of-00001.parquet"]
    assert names(resolve_files([f"hf:owner/pq@{SHA}?files=data/*-00001-*"])) == [shards[1]]
    assert names(resolve_files(["hf:owner/pq?files=data/train-00002*&files=**/train-00000*"])) == [
        shards[0],
        shards[2],
    ]
    # folders named by split keywords (valid = validation); the .txt outside them is no split's
    assert names(resolve_files(["hf:owner/jsonl"])) == ["train/part-0.jsonl", "train/part-1.jsonl"]
    assert names(resolve_files(["hf:owner/jsonl?split=validation"])) == ["valid/part-0.jsonl"]
    # the card's configs: its default (big), or one by name (config=, or name= as datasets calls it)
    assert names(resolve_files(["hf:owner/configs"])) == ["big/x/0.parquet", "big/y/1.parquet"]
    assert names(resolve_files(["hf:owner/configs?config=small"])) == ["small/a.jsonl", "small/b.jsonl"]
    assert names(resolve_files(["hf:owner/configs?name=small&split=test"])) == ["small/test.txt"]
    # the same file list every time, and the same files: each a path in the hub cache
    again = resolve_files(["hf:owner/pq"])
    assert again == resolve_files(["hf:owner/pq"]) and all(f.is_file() for f in again)
    assert str(again[0]).startswith(str(hub_cache / "datasets--owner--pq" / "snapshots" / SHA))


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("hf:owner/pq?files=nothing/*", "no file matches files=nothing/*"),
        ("hf:owner/pq?split=test", "has no 'test' split (it has: train, validation)"),
        ("hf:owner/configs?config=huge", "has no config 'huge' (it has: small, big)"),
        ("hf:owner/configs?config=small&split=validation", "has no 'validation' split (it has: train, test)"),
        ("hf:owner/jsonl?files=notes/*&split=train", "files= picks files itself; leave out split="),
        ("hf:owner/jsonl?colour=red", "'colour=red' is not config=NAME, split=SPLIT or files=GLOB"),
        ("hf:owner/jsonl?split=train&split=test", "gives split= twice"),
        ("hf:owner/jsonl?config=nope", "no config 'nope'"),
        ("hf:", "is not a hub dataset name; write hf:OWNER/NAME[@REVISION]"),
        ("hf:owner/pq@v2", "dataset owner/pq (revision v2) is not in the local hub cache"),
    ],
)
def test_a_bad_selection_is_refused_in_one_line(hub_cache: Path, spec: str, message: str) -> None:
    with raises_config_error(message) as e:
        resolve_files([spec])
    assert "\n" not in str(e.value)


def test_files_minigpt_cannot_read_are_refused(hub_cache: Path, tmp_path: Path) -> None:
    remote = write_remote(tmp_path / "csv", {"data/train.csv": "text\nhello\n", "data/extra.txt": "x"})
    cache_dataset(hub_cache, "owner/csv", remote)
    with raises_config_error("holds .csv files, which minigpt cannot read (it reads .txt, .jsonl, .parquet)"):
        resolve_files(["hf:owner/csv"])
    with raises_config_error("hf:owner/csv@refs/convert/parquet"):  # the hub's own Parquet conversion
        resolve_files(["hf:owner/csv"])
    with raises_config_error("files= matches data/train.csv, which minigpt cannot read"):
        resolve_files(["hf:owner/csv?files=data/*"])


def test_offline_a_dataset_not_in_the_cache_ends_in_one_line(hub_cache: Path, tmp_path: Path) -> None:
    with raises_config_error("hf:someone/absent: HF_HUB_OFFLINE is set, and dataset someone/absent") as e:
        prepare(data_cfg("hf:someone/absent", tmp_path / "cache"))
    assert "\n" not in str(e.value) and "hf download someone/absent --repo-type dataset" in str(e.value)


def test_a_config_keeps_hub_names_as_they_are(hub_cache: Path) -> None:
    cfg = DataConfig(paths=("hf:owner/pq?split=train",), val_paths=("hf:owner/pq",)).absolute()
    assert cfg.paths == ("hf:owner/pq?split=train",) and cfg.val_paths == ("hf:owner/pq",)


# -------------------------------------------------------------------------------- shard by shard, resuming


class FakeHub:
    """huggingface_hub's network calls, served from a local folder: the listing and the downloads (each
    recorded, and made to fail on demand), placing files in the cache as huggingface_hub does."""

    def __init__(self, remote: Path, repo: str, monkeypatch: pytest.MonkeyPatch) -> None:
        self.remote, self.repo = remote, repo
        self.events: list[tuple[str, str]] = []
        self.started: dict[str, threading.Event] = {}
        self.fail: set[str] = set()
        self.listings = 0
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # in case of a slip
        monkeypatch.setattr(hub, "unreachable", lambda: None)  # this hub answers
        monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", self.dataset_info)
        monkeypatch.setattr(huggingface_hub.HfApi, "list_repo_tree", self.list_repo_tree)
        monkeypatch.setattr(huggingface_hub, "hf_hub_download", self.hf_hub_download)

    def dataset_info(self, repo_id: str, *, revision: str | None = None, **kw):
        assert repo_id == self.repo and revision == "main"
        self.listings += 1
        return huggingface_hub.hf_api.DatasetInfo(id=repo_id, sha=SHA, cardData={"license": "mit"})

    def list_repo_tree(self, repo_id: str, *, revision: str, recursive: bool, **kw):
        assert revision == SHA and recursive
        for f in sorted(self.remote.rglob("*")):
            if f.is_file():
                path = f.relative_to(self.remote).as_posix()
                yield huggingface_hub.hf_api.RepoFile(path=path, size=f.stat().st_size, oid="0" * 40)

    def hf_hub_download(self, repo_id: str, filename: str, *, revision: str, cache_dir: str, **kw) -> str:
        assert repo_id == self.repo and revision == SHA
        self.events.append(("download", filename))
        self.started.setdefault(filename, threading.Event()).set()
        if filename in self.fail:
            self.fail.discard(filename)
            raise ConnectionError("connection reset by peer")
        cache_file(Path(cache_dir), repo_id, filename, (self.remote / filename).read_bytes())
        return str(Path(cache_dir) / f"datasets--{repo_id.replace('/', '--')}" / "snapshots" / SHA / filename)

    def downloads(self) -> list[str]:
        return [name for kind, name in self.events if kind == "download"]


@pytest.fixture
def fake_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    """owner/pq on a fake hub, nothing of it in the (empty) local hub cache; reads of its files recorded."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    fake = FakeHub(write_remote(tmp_path / "remote", PARQUET), "owner/pq", monkeypatch)
    read = build_mod.read_records
    shards = sorted(n for n in PARQUET if "train" in n)

    def reading(path, *args, **kw):  # records the read, then waits (a while) for the next file's download
        if not isinstance(path, hub.HubFile):
            yield from read(path, *args, **kw)
            return
        name = path.remote.name
        fake.events.append(("read", name))
        records = read(path, *args, **kw)
        first = next(records, None)  # the file is open: downloaded, and the next one asked for
        if name in shards[:-1]:
            nxt = shards[shards.index(name) + 1]
            arrived = fake.started.setdefault(nxt, threading.Event()).wait(10)
            fake.events.append(("next started while reading" if arrived else "next not started", name))
        if first is not None:
            yield first
        yield from records

    monkeypatch.setattr(build_mod, "read_records", reading)
    return fake


def test_shards_download_one_by_one_as_they_are_read(fake_hub: FakeHub, tmp_path: Path) -> None:
    files = resolve_files(["hf:owner/pq"])
    assert [f.stat().st_size for f in files] == [(fake_hub.remote / n).stat().st_size for n in names(files)]
    assert fake_hub.events == []  # resolving (and stat) downloads nothing
    store = prepare(data_cfg("hf:owner/pq", tmp_path / "cache"))
    shards = names(files)
    assert fake_hub.downloads() == shards  # each once, in order
    at = [e for e in fake_hub.events if e[0] in ("download", "read")].index  # first time of each event
    assert at(("read", shards[0])) < at(("download", shards[0]))  # nothing is fetched before it is wanted
    for before, name in itertools.pairwise(shards):  # the next file, while this one is read
        assert at(("read", before)) < at(("download", name)) < at(("read", name))
    assert ("next not started", shards[0]) not in fake_hub.events  # file 1 arrived while file 0 was read
    assert ("next started while reading", shards[1]) in fake_hub.events
    assert store.meta["splits"]["train"]["documents"] + store.meta["splits"]["val"]["documents"] == 90


def test_an_interrupted_download_resumes_without_fetching_finished_shards(
    fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    shards = sorted(n for n in PARQUET if "train" in n)
    cfg = data_cfg("hf:owner/pq", tmp_path / "cache", bpe_train_bytes=2000)  # the BPE reads shard 0 only
    monkeypatch.setattr(build_mod, "JOURNAL_SECONDS", 0.0)  # journal at every resume point
    fake_hub.fail.add(shards[2])
    with raises_config_error(f"could not download hf:owner/pq file {shards[2]}") as e:
        prepare(cfg)  # shards 0 and 1 tokenized, then the connection drops
    assert "\n" not in str(e.value) and "rerun to resume" in str(e.value)
    assert isinstance(e.value, hub.DownloadError) and fake_hub.downloads() == shards
    assert [p.suffix for p in (tmp_path / "cache" / "tokens").iterdir() if p.is_dir()] == [".tmp"]  # kept
    # offline now: the commit's whole file list was kept, so the partial copy is not taken for the dataset
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with raises_config_error(
        f"hf:owner/pq file {shards[2]} (revision {SHA[:12]}) is not in the local hub cache"
    ):
        prepare(cfg)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    fake_hub.events.clear()
    capsys.readouterr()
    store = prepare(cfg)
    assert "continuing the interrupted build" in capsys.readouterr().out  # the tokenizing, too
    assert fake_hub.downloads() == [shards[2]]  # the finished shards came from the cache
    assert ("read", shards[0]) not in fake_hub.events  # and were not tokenized again
    local = prepare(data_cfg(fake_hub.remote / "data" / "train-*", tmp_path / "cache", bpe_train_bytes=2000))
    assert np.array_equal(store.tokens("train"), local.tokens("train"))
    assert np.array_equal(store.tokens("val"), local.tokens("val"))
    # built: reused offline (same commit, names and sizes) without reading anything, even files since deleted
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shutil.rmtree(tmp_path / "hf-cache" / "datasets--owner--pq" / "blobs")
    fake_hub.events.clear()
    assert prepare(cfg).path == store.path and fake_hub.events == []


def test_an_unreachable_hub_falls_back_to_the_cache(
    fake_hub: FakeHub, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert len(resolve_files(["hf:owner/pq"])) == 3  # listed online: the branch's commit is kept
    cache_dataset(tmp_path / "hf-cache", "owner/pq", fake_hub.remote)

    def unreachable(*args, **kw):
        raise ConnectionError("no route to host")

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", unreachable)
    assert len(resolve_files(["hf:owner/pq"])) == 3
    assert (
        f"the hub could not be reached (ConnectionError); using revision {SHA[:12]}"
        in capsys.readouterr().out
    )
    shutil.rmtree(tmp_path / "hf-cache")
    with raises_config_error(
        "hf:owner/pq: the hub could not be reached (ConnectionError), and dataset owner/pq"
    ):
        resolve_files(["hf:owner/pq"])


@pytest.mark.parametrize(
    ("error", "message"),
    [
        ("RepositoryNotFoundError", "hf:owner/pq: no dataset owner/pq on the hub (if it is private, log in"),
        ("GatedRepoError", "hf:owner/pq: dataset owner/pq is gated; accept its terms on the hub and log in"),
        ("RevisionNotFoundError", "hf:owner/pq: dataset owner/pq has no revision main"),
    ],
)
def test_what_the_hub_refuses_ends_in_one_line(
    fake_hub: FakeHub, monkeypatch: pytest.MonkeyPatch, error: str, message: str
) -> None:
    import httpx2

    response = httpx2.Response(404, request=httpx2.Request("GET", "http://127.0.0.1:9/api/datasets/owner/pq"))

    def refuse(*args, **kw):
        raise getattr(huggingface_hub.errors, error)("404 Client Error", response=response)

    monkeypatch.setattr(huggingface_hub.HfApi, "dataset_info", refuse)
    with raises_config_error(message) as e:
        resolve_files(["hf:owner/pq"])
    assert "\n" not in str(e.value)


def test_a_hub_file_in_another_process_downloads_by_itself(fake_hub: FakeHub) -> None:
    (first, *_) = resolve_files(["hf:owner/pq"])
    copy = pickle.loads(pickle.dumps(first))
    assert copy == first and copy.remote == first.remote and copy.stat().st_size == first.stat().st_size
    assert fake_hub.downloads() == []
    assert Path(os.fspath(copy)).read_bytes() == (fake_hub.remote / first.remote.name).read_bytes()
    assert fake_hub.downloads() == [first.remote.name]


def test_hub_file_errors_name_the_file(hub_cache: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"datasets--owner--pq/snapshots/.*train-00000.*no \"body\" column"):
        prepare(data_cfg("hf:owner/pq", tmp_path / "cache", text_field="body"))


def test_the_default_command_with_the_hub_unreachable_fails_at_once_in_one_line(tmp_path: Path) -> None:
    """`minigpt train` (TinyStories from the hub) on a machine that cannot reach the hub: one request tells,
    and the error is the one line, not half a minute of huggingface_hub's retries, each logged twice."""
    from conftest import run_cli

    env = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "0", "HF_HOME": str(tmp_path / "hf")}
    env["HF_HUB_CACHE"] = str(tmp_path / "hf" / "hub")
    out = run_cli("train", "--preset", "cpu", "--run-dir", str(tmp_path / "run"), env=env)
    assert out.returncode == 2
    assert out.stderr.splitlines() == [
        "minigpt: error: could not download TinyStories from the Hugging Face hub (http://127.0.0.1:9 did not "
        "answer: ConnectError); pass local text with --data PATH [--val-data PATH]"
    ], out.stderr
    assert "Retry" not in out.stdout and len(out.stdout.splitlines()) <= 1, out.stdout


# ------------------------------------------------------------------------------- the default corpus, by range

TS_REPO, TS_TRAIN, TS_VALID = "roneneldan/TinyStories", "TinyStories-train.txt", "TinyStories-valid.txt"


class RangeHub:
    """A hub on 127.0.0.1 serving TinyStories' two text files (made up here) at one commit, as the hub's resolve
    URL serves them: HEAD with the commit, LFS sha256 and size; GET with or without Range. It logs each GET's
    range and can cut a response short after `cut` bytes and refuse every later request."""

    def __init__(self, root: Path) -> None:
        import http.server

        stories = [f"{d} It was day {k}." for k in range(110) for d in DOCS]  # about 1.6 MB
        self.files = {TS_TRAIN: _payload(TS_TRAIN, stories), TS_VALID: _payload(TS_VALID, DOCS[:40])}
        root.mkdir()
        for name, data in self.files.items():
            (root / name).write_bytes(data)
        self.root, self.gets, self.cut, self.down = root, [], None, False
        served = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                self._answer(head=True)

            def do_GET(self) -> None:
                self._answer(head=False)

            def _answer(self, head: bool) -> None:
                prefix = f"/datasets/{TS_REPO}/resolve/"
                rev, _, name = self.path.removeprefix(prefix).partition("/")
                if served.down:
                    return self.send_error(503)
                if not self.path.startswith(prefix):  # the hub's front page: it answers
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    return self.end_headers()
                if rev not in ("main", SHA) or name not in served.files:
                    return self.send_error(404)
                data = served.files[name]
                start, stop, status = 0, len(data), 200
                if not head and (asked := self.headers.get("Range")):
                    a, b = asked.removeprefix("bytes=").split("-")
                    start, stop, status = int(a), min(int(b) + 1, len(data)), 206
                self.send_response(status)
                self.send_header("X-Repo-Commit", SHA)
                self.send_header("X-Linked-Etag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("X-Linked-Size", str(len(data)))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("Content-Length", str(stop - start))
                if status == 206:
                    self.send_header("Content-Range", f"bytes {start}-{stop - 1}/{len(data)}")
                self.end_headers()
                if head:
                    return None
                body = data[start:stop]
                if served.cut is not None and name == TS_TRAIN:  # the connection drops, and the hub with it
                    body, served.down = body[: served.cut], True
                served.gets.append((name, start, start + len(body)))
                self.wfile.write(body)
                return None

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def served(self, name: str = TS_TRAIN) -> int:
        return sum(stop - start for n, start, stop in self.gets if n == name)


@pytest.fixture
def range_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> RangeHub:
    """The hub above, with HF_ENDPOINT (and what huggingface_hub read from it at import) pointing there, small
    fetches and reads, and an empty local hub cache."""
    hub_ = RangeHub(tmp_path / "remote-ts")
    monkeypatch.setenv("HF_ENDPOINT", hub_.url)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", hub_.url)
    template = hub_.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(huggingface_hub.constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    monkeypatch.setattr(ranged, "CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(corpus_mod, "BLOCK_BYTES", 16 << 10)
    monkeypatch.setattr(build_mod, "PREFIX_MIN_TOKENS", 0)
    yield hub_
    hub_.server.shutdown()
    hub_.server.server_close()


def ts_cfg(cache: Path, **kw) -> DataConfig:
    """The default corpus (no --data) with a small BPE trained on its first 20 kB."""
    return DataConfig(
        paths=(), cache_dir=str(cache), tokenizer="bpe", bpe_vocab_size=300, bpe_train_bytes=20_000, **kw
    )


def local_store(range_hub: RangeHub, cache: Path, train_tokens: int | None = None):
    root = range_hub.root
    cfg = ts_cfg(cache)
    cfg = dataclasses.replace(cfg, paths=(str(root / TS_TRAIN),), val_paths=(str(root / TS_VALID),))
    return prepare(cfg, train_tokens=train_tokens)


def part_file(cache: Path) -> Path:
    return cache / "datasets--roneneldan--TinyStories" / "minigpt" / "ranged" / SHA / (TS_TRAIN + ".part")


def test_a_run_fetches_only_the_prefix_it_tokenizes_and_extending_fetches_only_what_follows(
    range_hub: RangeHub, tmp_path: Path
) -> None:
    size = len(range_hub.files[TS_TRAIN])
    first = prepare(ts_cfg(tmp_path / "cache"), train_tokens=30_000)
    n = first.size("train")
    assert not first.complete and range_hub.served(TS_VALID) == len(range_hub.files[TS_VALID])  # whole
    fetched = range_hub.served()
    assert 0 < fetched < size // 4  # the prefix, not the file
    assert part_file(tmp_path / "hf-cache").stat().st_size == fetched
    assert (
        first.meta["sources"]["train"][0]["sha256"] == hashlib.sha256(range_hub.files[TS_TRAIN]).hexdigest()
    )
    local = local_store(range_hub, tmp_path / "local", train_tokens=30_000)
    assert np.array_equal(first.tokens("train"), local.tokens("train"))  # the same text, the same tokens
    assert np.array_equal(first.tokens("val"), local.tokens("val"))
    # a run that needs more extends the store, fetching only the bytes after those it has
    range_hub.gets.clear()
    second = prepare(ts_cfg(tmp_path / "cache"), train_tokens=90_000)
    assert second.path == first.path and second.size("train") > 2 * n
    assert range_hub.gets and range_hub.gets[0][1] == fetched  # from where the first fetch ended
    assert all(b == c for (_, _, b), (_, c, _) in itertools.pairwise(range_hub.gets))  # each byte once
    assert range_hub.served() < size // 2 and range_hub.served(TS_VALID) == 0
    # the whole file (minigpt prepare): the rest, checked and kept where a whole download is kept
    fetched = part_file(tmp_path / "hf-cache").stat().st_size
    range_hub.gets.clear()
    whole = prepare(ts_cfg(tmp_path / "cache"))
    assert whole.complete and range_hub.gets[0][1] == fetched and range_hub.gets[-1][2] == size
    assert all(b == c for (_, _, b), (_, c, _) in itertools.pairwise(range_hub.gets))
    snapshot = tmp_path / "hf-cache" / "datasets--roneneldan--TinyStories" / "snapshots" / SHA / TS_TRAIN
    assert (
        snapshot.read_bytes() == range_hub.files[TS_TRAIN] and not part_file(tmp_path / "hf-cache").exists()
    )
    full = local_store(range_hub, tmp_path / "local-full")
    assert np.array_equal(whole.tokens("train"), full.tokens("train"))
    assert np.array_equal(whole.tokens("train")[:n], first.tokens("train"))
    # reused with nothing fetched, online or offline
    range_hub.gets.clear()
    assert prepare(ts_cfg(tmp_path / "cache")).meta == whole.meta and range_hub.gets == []


def test_offline_a_prefix_that_covers_the_run_is_enough_and_one_that_does_not_ends_in_one_line(
    range_hub: RangeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    built = prepare(ts_cfg(tmp_path / "cache"), train_tokens=30_000)
    range_hub.down = True  # and offline: nothing is asked of it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert prepare(ts_cfg(tmp_path / "cache"), train_tokens=30_000).meta == built.meta  # built: no bytes
    again = prepare(ts_cfg(tmp_path / "other"), train_tokens=20_000)  # not built, but the bytes are here
    assert np.array_equal(again.tokens("train"), built.tokens("train")[: again.size("train")])
    with raises_config_error(
        f"hf:{TS_REPO} file {TS_TRAIN} (revision {SHA[:12]}): the build reads its first"
    ) as e:
        prepare(ts_cfg(tmp_path / "cache"), train_tokens=600_000)
    assert "\n" not in str(e.value) and "HF_HUB_OFFLINE set" in str(e.value)


def test_an_interrupted_fetch_resumes_from_the_bytes_it_has_and_damaged_bytes_are_fetched_again(
    range_hub: RangeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    range_hub.cut = 40_000  # the first request for the training text drops after 40 kB, and the hub with it
    monkeypatch.setattr(build_mod, "JOURNAL_SECONDS", 0.0)
    with raises_config_error(f"could not download hf:{TS_REPO} file {TS_TRAIN}") as e:
        prepare(ts_cfg(tmp_path / "cache"), train_tokens=60_000)
    assert "\n" not in str(e.value) and "rerun to resume" in str(e.value)
    assert range_hub.served() == 40_000 and part_file(tmp_path / "hf-cache").stat().st_size == 40_000
    range_hub.cut, range_hub.down = None, False
    range_hub.gets.clear()
    store = prepare(ts_cfg(tmp_path / "cache"), train_tokens=60_000)
    assert range_hub.gets[0][1] == 40_000  # resumed: nothing fetched twice
    local = local_store(range_hub, tmp_path / "local", train_tokens=60_000)
    assert np.array_equal(store.tokens("train"), local.tokens("train"))
    # a torn append (bytes written but never recorded) and a damaged recorded byte: neither is ever read
    part = part_file(tmp_path / "hf-cache")
    have = part.stat().st_size
    with open(part, "r+b") as f:
        f.seek(50_000)
        f.write(b"#")
        f.seek(have)
        f.write(b"torn" * 1000)
    range_hub.gets.clear()
    more = prepare(ts_cfg(tmp_path / "cache"), train_tokens=150_000)
    assert range_hub.gets[0][1] <= 50_000  # the damaged piece again, and from there on
    local = local_store(range_hub, tmp_path / "local2", train_tokens=150_000)
    assert np.array_equal(more.tokens("train"), local.tokens("train"))


def test_a_whole_download_from_before_is_read_as_it_is(
    range_hub: RangeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TinyStories downloaded whole (by an older minigpt, or hf download): its local path, online or offline,
    so stores built from it stay the same; nothing is fetched by range."""
    cache = tmp_path / "hf-cache"
    for name, data in range_hub.files.items():
        cache_file(cache, TS_REPO, name, data)
    (cache / "datasets--roneneldan--TinyStories" / "refs").mkdir()
    (cache / "datasets--roneneldan--TinyStories" / "refs" / "main").write_text(SHA)
    local = [
        str(cache / "datasets--roneneldan--TinyStories" / "snapshots" / SHA / n) for n in (TS_TRAIN, TS_VALID)
    ]
    assert download_tinystories() == ((local[0],), (local[1],)) and range_hub.gets == []
    range_hub.down = True
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert download_tinystories() == ((local[0],), (local[1],))
    assert not (cache / "datasets--roneneldan--TinyStories" / "minigpt").exists()
