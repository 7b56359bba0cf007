"""Hugging Face hub datasets by name: `--data hf:OWNER/NAME[@REVISION][?config=NAME&split=SPLIT&files=GLOB]`.

A spec resolves, through huggingface_hub, to the dataset's .txt/.jsonl/.parquet files at one commit: the
revision (default main) is pinned to its commit sha, and the files are chosen as the hub's dataset viewer
chooses them. With `configs:` in the dataset card (README.md), `config` picks one (else the card's default, the
one named default, or the only one) and `split` one of its `data_files`; without, the `datasets` library's
conventions hold: `data/SPLIT-00000-of-00004.parquet` shards, else folders or file names with a split keyword
(train/training, validation/valid/dev/val, test/testing/eval/evaluation), else every file is training data;
`config` then names a folder. `files` (repeatable) picks files by glob pattern instead. The split is train for
--data and validation for --val-data unless given.

The files come back as `HubFile`s: paths into the local hub cache (`$HF_HUB_CACHE/datasets--OWNER--NAME/
snapshots/SHA/...`) that are downloaded when first opened, the next file in the background meanwhile, so the
token store tokenizes shard by shard as they arrive and a resumed preparation finds finished shards in the
cache. Their `stat()` answers from the hub's metadata (size; mtime 0), so a token store's identity is
repository, commit, file names and sizes, and reusing a store downloads nothing.

Offline (HF_HUB_OFFLINE=1, or the hub unreachable) a spec resolves from the local hub cache: the file list
minigpt saved there when it last listed that commit (`datasets--OWNER--NAME/minigpt/SHA.json`), else what
the snapshot folder holds (a dataset fetched with `hf download`); a dataset that is not there ends with one
line saying so, and so does a file not downloaded yet, once it is opened (a token store already built from
it needs none of its files).
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import re
import stat
import sys
import threading
import time
from concurrent.futures import Future
from pathlib import Path

from minigpt.config import ConfigError
from minigpt.data.progress import megabytes
from minigpt.runtime import files as atomic

PREFIX = "hf:"
SUFFIXES = (".txt", ".jsonl", ".parquet")
"""What minigpt reads (corpus.SOURCE_SUFFIXES; not imported from there: corpus imports this module)."""
SPLIT_KEYWORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "dev", "val"),
    "test": ("test", "testing", "eval", "evaluation"),
}
"""The names a split goes by in folder and file names, as the `datasets` library reads them."""
SYNTAX = "hf:OWNER/NAME[@REVISION][?config=NAME&split=SPLIT&files=GLOB]"
_SPEC = re.compile(r"hf:(?P<repo>[\w.-]+(?:/[\w.-]+)?)(?:@(?P<rev>[^?]+))?(?:\?(?P<query>.*))?", re.S)
LIST_TIMEOUT_S = 20.0
PROBE_TIMEOUT_S = 5.0
"""How long listing a dataset may wait for the hub before falling back to the local hub cache."""
_SHA = re.compile(r"[0-9a-f]{40}")
_SEP = "[-._ 0-9]"  # what may stand next to a split keyword in a name


def is_spec(path: str | Path) -> bool:
    """Whether a --data item names a hub dataset rather than a local path (or a file already resolved)."""
    return isinstance(path, str) and path.startswith(PREFIX)


@dataclasses.dataclass(frozen=True)
class Spec:
    """A parsed `hf:` item: repository, revision (branch, tag or sha), config, split and file patterns."""

    text: str
    repo_id: str
    revision: str = "main"
    config: str | None = None
    split: str = "train"
    files: tuple[str, ...] = ()

    @property
    def storage(self) -> Path:
        """The dataset's folder in the local hub cache."""
        return hub_cache() / f"datasets--{self.repo_id.replace('/', '--')}"


def parse(text: str, flag: str = "--data") -> Spec:
    """An `hf:` item as a Spec, or a one-line ConfigError saying what is wrong with it."""
    m = _SPEC.fullmatch(text)
    if m is None:
        raise ConfigError(f"{flag} {text!r} is not a hub dataset name; write {SYNTAX}")
    opts: dict[str, str] = {}
    patterns: list[str] = []
    for part in m["query"].split("&") if m["query"] else []:
        key, eq, value = part.partition("=")
        key = "config" if key == "name" else key  # `name`, as datasets.load_dataset calls it
        if key not in ("config", "split", "files") or not eq or not value:
            raise ConfigError(
                f"{flag} {text}: {part!r} is not config=NAME, split=SPLIT or files=GLOB ({SYNTAX})"
            )
        if key == "files":
            patterns.append(value.lstrip("/"))
        elif key in opts:
            raise ConfigError(f"{flag} {text} gives {key}= twice")
        else:
            opts[key] = value
    if patterns and opts:
        raise ConfigError(f"{flag} {text}: files= picks files itself; leave out {', '.join(opts)}=")
    split = opts.get("split", "validation" if flag == "--val-data" else "train")
    return Spec(text, m["repo"], m["rev"] or "main", opts.get("config"), split, tuple(patterns))


def hub_cache() -> Path:
    """huggingface_hub's cache folder, read from the environment now (its own constant is read at import)."""
    env = os.environ
    if env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE"):
        return Path(env.get("HF_HUB_CACHE") or env["HUGGINGFACE_HUB_CACHE"]).expanduser()
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    """Whether HF_HUB_OFFLINE is set (as now, else as huggingface_hub read it at import)."""
    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def unreachable() -> str | None:
    """Why the hub cannot be reached now (None: it answers). One request, not retried: huggingface_hub
    retries a failed download for half a minute, logging each try, before the error that says so."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if offline():
        return "HF_HUB_OFFLINE is set"
    try:
        get_session().head(constants.ENDPOINT, timeout=PROBE_TIMEOUT_S)
    except Exception as e:
        return f"{constants.ENDPOINT} did not answer: {type(e).__name__}"
    return None


# ------------------------------------------------------------------------------------------- listing


@dataclasses.dataclass(frozen=True)
class Listing:
    """A dataset at one commit: its files with their sizes, and its card's `configs:` (None if it has none)."""

    sha: str
    files: dict[str, int]
    configs: list | None


def resolve(text: str, flag: str = "--data") -> list[HubFile]:
    """The files a spec selects, in sorted order, as HubFiles (downloaded as they are opened)."""
    spec = parse(text, flag)
    listing = _listing(spec, flag)
    names = select(spec, listing)
    snapshot = spec.storage / "snapshots" / listing.sha
    fetcher = _Fetcher()  # offline, a file not cached is refused when opened: a built store opens none
    out = []
    for name in names:
        remote = _Remote(spec.repo_id, listing.sha, name, listing.files[name], str(hub_cache()))
        out.append(HubFile(snapshot / name)._attach(remote, fetcher))
    return out


def _listing(spec: Spec, flag: str) -> Listing:
    """The dataset's files at the spec's revision: from the hub, else (offline) from the local hub cache."""
    reason = "HF_HUB_OFFLINE is set"
    if not offline() and (why := unreachable()) is not None:
        reason = f"the hub could not be reached ({why})"
    elif not offline():
        try:
            return _online_listing(spec)
        except ConfigError:
            raise
        except Exception as e:  # no network, a proxy, the hub down: try the cache
            reason = f"the hub could not be reached ({type(e).__name__})"
    cached = _cached_listing(spec)
    if cached is None:
        raise ConfigError(
            f"{spec.text}: {reason}, and dataset {spec.repo_id} (revision {spec.revision}) is not in the local "
            f"hub cache ({hub_cache()}); connect (with HF_HUB_OFFLINE unset or 0) to download it, fetch it "
            f"first (hf download {spec.repo_id} --repo-type dataset), or pass local files to {flag}"
        )
    if reason != "HF_HUB_OFFLINE is set":
        print(f"{spec.text}: {reason}; using revision {cached.sha[:12]} from the local hub cache")
    return cached


def _online_listing(spec: Spec) -> Listing:
    """The hub's file list (with sizes) and card configs at the revision's commit, saved to the local hub
    cache (the branch's ref and minigpt's file list) for offline use."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    api = HfApi()
    try:
        info = api.dataset_info(spec.repo_id, revision=spec.revision, timeout=LIST_TIMEOUT_S)
        tree = api.list_repo_tree(spec.repo_id, revision=info.sha, repo_type="dataset", recursive=True)
        found = {f.path: int(f.size) for f in tree if getattr(f, "size", None) is not None}
    except GatedRepoError:
        raise ConfigError(
            f"{spec.text}: dataset {spec.repo_id} is gated; accept its terms on the hub and log in (hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise ConfigError(
            f"{spec.text}: no dataset {spec.repo_id} on the hub (if it is private, log in with hf auth login)"
        ) from None
    except RevisionNotFoundError:
        raise ConfigError(f"{spec.text}: dataset {spec.repo_id} has no revision {spec.revision}") from None
    card = info.card_data.to_dict() if info.card_data is not None else {}
    listing = Listing(info.sha, found, card.get("configs"))
    _save(spec, listing)
    return listing


def _save(spec: Spec, listing: Listing) -> None:
    """Record the revision's commit (as huggingface_hub does) and the file list, so offline resolves alike."""
    try:
        (spec.storage / "snapshots" / listing.sha).mkdir(parents=True, exist_ok=True)  # refs need a snapshot
        if spec.revision != listing.sha:
            ref = spec.storage / "refs" / spec.revision
            ref.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_text(ref, listing.sha)
        (spec.storage / "minigpt").mkdir(exist_ok=True)
        atomic.write_json(
            spec.storage / "minigpt" / f"{listing.sha}.json",
            {"files": listing.files, "configs": listing.configs},
        )
    except OSError:  # a read-only cache: offline use then sees what the snapshot holds
        pass


def _cached_listing(spec: Spec) -> Listing | None:
    """The dataset at the spec's revision as the local hub cache knows it, or None."""
    sha = spec.revision
    if not _SHA.fullmatch(sha):
        try:
            sha = (spec.storage / "refs" / spec.revision).read_text().strip()
        except OSError:
            return None
    try:
        saved = json.loads((spec.storage / "minigpt" / f"{sha}.json").read_text())
        return Listing(sha, {k: int(v) for k, v in saved["files"].items()}, saved["configs"])
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    snapshot = spec.storage / "snapshots" / sha
    if not snapshot.is_dir():
        return None
    found = {p.relative_to(snapshot).as_posix(): p.stat().st_size for p in snapshot.rglob("*") if p.is_file()}
    return Listing(sha, found, _card_configs(snapshot / "README.md"))


def _card_configs(readme: Path) -> list | None:
    """The `configs:` of a dataset card's YAML header, or None."""
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    m = re.match(r"---\s*\n(.*?)\n---\s*(\n|$)", text, re.S)
    if m is None:
        return None
    import yaml

    try:
        header = yaml.safe_load(m[1])
    except yaml.YAMLError:
        return None
    return header.get("configs") if isinstance(header, dict) else None


# ----------------------------------------------------------------------------------------- selection


def select(spec: Spec, listing: Listing) -> list[str]:
    """The names of the files a spec picks from a listing, sorted; a one-line ConfigError if none."""
    names = sorted(n for n in listing.files if not _ignored(n))
    where = f"{spec.text} (revision {listing.sha[:12]})"
    if spec.files:
        chosen = [n for n in names if any(_matches(p, n) for p in spec.files)]
        if not chosen:
            raise ConfigError(f"{where}: no file matches files={' files='.join(spec.files)}")
        unreadable = [n for n in chosen if _kind(n) not in SUFFIXES]
        if unreadable:
            raise ConfigError(
                f"{where}: files= matches {unreadable[0]}, which minigpt cannot read (it reads "
                f"{', '.join(SUFFIXES)}); narrow the pattern"
            )
        return chosen
    splits = _splits(spec, listing.configs, names, where)
    if not splits.get(spec.split):
        have = ", ".join(s for s in splits if splits[s]) or "none"
        raise ConfigError(
            f"{where} has no {spec.split!r} split (it has: {have}); pick one with ?split=NAME, or pick files "
            "with ?files=GLOB"
        )
    kinds = collections.Counter(_kind(n) for n in splits[spec.split])
    kind = max(kinds, key=lambda k: (kinds[k], k in SUFFIXES))  # the commonest type: stray files are left out
    if kind not in SUFFIXES:
        raise ConfigError(
            f"{where} holds {kind or 'suffix-less'} files, which minigpt cannot read (it reads "
            f"{', '.join(SUFFIXES)}); try the hub's Parquet conversion: "
            f"hf:{spec.repo_id}@refs/convert/parquet?files=CONFIG/SPLIT/*.parquet"
        )
    return [n for n in splits[spec.split] if _kind(n) == kind]


def _splits(spec: Spec, configs: list | None, names: list[str], where: str) -> dict[str, list[str]]:
    """split -> files: by the card's configs, else by the datasets library's naming conventions."""
    if not configs:
        if spec.config is None:
            return _by_convention(names, "", spec.split)
        base = spec.config.strip("/") + "/"
        if not any(n.startswith(base) for n in names):
            raise ConfigError(
                f"{where}: no config {spec.config!r} (its card lists none, and no folder is so named)"
            )
        return _by_convention(names, base, spec.split)
    config = _pick_config(configs, spec.config, where)
    base = str(config.get("data_dir") or "").strip("/")
    base = base + "/" if base else ""
    data_files = config.get("data_files")
    if data_files is None:
        return _by_convention(names, base, spec.split)
    out: dict[str, list[str]] = {}
    for split, patterns in _data_files(data_files).items():
        out[split] = [n for n in names if any(_matches(base + p.lstrip("/"), n) for p in patterns)]
    return out


def _pick_config(configs: list, name: str | None, where: str) -> dict:
    configs = [c for c in configs if isinstance(c, dict)]
    by_name = {str(c.get("config_name", "default")): c for c in configs}
    if name is not None:
        if name not in by_name:
            raise ConfigError(f"{where} has no config {name!r} (it has: {', '.join(by_name)})")
        return by_name[name]
    default = [c for c in configs if c.get("default")] or [by_name[n] for n in by_name if n == "default"]
    if default or len(configs) == 1:
        return (default or configs)[0]
    raise ConfigError(f"{where} has several configs ({', '.join(by_name)}); pick one with ?config=NAME")


def _data_files(data_files) -> dict[str, list[str]]:
    """A card config's data_files (a pattern, a list of them, a list of {split, path}, or {split: path}) as
    split -> patterns; bare patterns are training data."""
    as_list = lambda p: [str(x) for x in p] if isinstance(p, list) else [str(p)]
    if isinstance(data_files, dict):
        return {str(k): as_list(v) for k, v in data_files.items()}
    if isinstance(data_files, list) and all(isinstance(d, dict) for d in data_files):
        out: dict[str, list[str]] = {}
        for d in data_files:
            out.setdefault(str(d.get("split", "train")), []).extend(as_list(d.get("path", [])))
        return out
    return {"train": as_list(data_files)}


def _by_convention(names: list[str], base: str, wanted: str) -> dict[str, list[str]]:
    """split -> files under `base` by the datasets library's conventions: `data/SPLIT-00000-of-00001.*`
    shards, else split keywords in folder names, else in file names, else all of them for training."""
    inside = [(n, n[len(base) :]) for n in names if n.startswith(base)]
    sharded: dict[str, list[str]] = {}
    for n, rel in inside:
        m = re.fullmatch(r"data/(\w+)-\d{5}-of-\d{5}[^/]*", rel)
        if m:
            sharded.setdefault(m[1], []).append(n)
    if sharded:
        return sharded
    groups = {**SPLIT_KEYWORDS, **({} if wanted in SPLIT_KEYWORDS else {wanted: (re.escape(wanted),)})}
    before = f"(?:.*{_SEP[:-1]}/])?"  # a keyword starts the path, a folder's or file's name, or follows _SEP
    for shape in (before + "(?:{})/.*", before + "(?:{})" + _SEP + "[^/]*"):  # in a folder's name, a file's
        found = {
            s: [n for n, rel in inside if re.fullmatch(shape.format("|".join(k)), rel)]
            for s, k in groups.items()
        }
        if any(found.values()):
            return found
    return {"train": [n for n, _ in inside]}


def _ignored(name: str) -> bool:
    """Hidden files and folders, and the dataset card: never data."""
    return name == "README.md" or any(part.startswith(".") for part in name.split("/"))


def _kind(name: str) -> str:
    """A file's type by its suffix, lower-case; with a compression suffix, both (.jsonl.gz)."""
    suffixes = [s.lower() for s in Path(name).suffixes]
    if len(suffixes) > 1 and suffixes[-1] in (".gz", ".zst", ".bz2", ".xz", ".lz4", ".zip"):
        return "".join(suffixes[-2:])
    return suffixes[-1] if suffixes else ""


def _matches(pattern: str, name: str) -> bool:
    """Whether a glob pattern (`*` within a folder, `**` across folders) matches a file or a folder above it."""
    regex = _glob_regex(pattern)
    parts = name.split("/")
    return any(regex.fullmatch("/".join(parts[:i])) for i in range(len(parts), 0, -1))


def _glob_regex(pattern: str) -> re.Pattern:
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        c, close = pattern[i], pattern.find("]", i + 2)
        if pattern.startswith("**", i):
            out.append(".*")
            i += 1
        elif c in "*?":
            out.append("[^/]*" if c == "*" else "[^/]")
        elif c == "[" and close > i:
            inner = pattern[i + 1 : close]
            out.append(
                "[" + ("^" + inner[1:] if inner.startswith("!") else inner).replace("\\", "\\\\") + "]"
            )
            i = close
        else:
            out.append(re.escape(c))
        i += 1
    return re.compile("".join(out), re.S)


# ---------------------------------------------------------------------------------------- downloading


@dataclasses.dataclass(frozen=True)
class _Remote:
    """One file of a dataset at one commit, and the hub cache it goes to (picklable: no threads)."""

    repo_id: str
    sha: str
    name: str
    size: int
    cache: str

    @property
    def local(self) -> Path:
        return Path(
            self.cache, f"datasets--{self.repo_id.replace('/', '--')}", "snapshots", self.sha, self.name
        )


class DownloadError(ConfigError):
    """A hub file could not be had (the network, or offline): not bad input, so a build it stops is kept
    for the next call to continue."""


def download(remote: _Remote) -> None:
    """Bring one file into the local hub cache (nothing to do if it is there); a one-line ConfigError if it
    cannot be had. huggingface_hub resumes a download cut short."""
    if os.path.isfile(remote.local):
        return
    where = f"hf:{remote.repo_id} file {remote.name} (revision {remote.sha[:12]})"
    if offline():
        raise DownloadError(
            f"{where} is not in the local hub cache ({remote.cache}) and HF_HUB_OFFLINE is set; unset it (or set "
            "HF_HUB_OFFLINE=0) and connect to download it"
        )
    if (why := unreachable()) is not None:
        raise DownloadError(
            f"could not download {where}: the hub could not be reached ({why}); rerun to resume (finished files "
            "are kept), or set HF_HUB_OFFLINE=1 to use only what is cached"
        )
    import huggingface_hub

    print(f"downloading {where}: {megabytes(remote.size)} ...", file=sys.stderr, flush=True)
    started = time.monotonic()
    try:
        got = huggingface_hub.hf_hub_download(
            remote.repo_id, remote.name, repo_type="dataset", revision=remote.sha, cache_dir=remote.cache
        )
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise DownloadError(
            f"could not download {where} ({type(e).__name__}: {reason}); rerun to resume (finished files are "
            "kept), or set HF_HUB_OFFLINE=1 to use only what is cached"
        ) from None
    print(f"downloaded {remote.name} in {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    if not os.path.isfile(remote.local):  # not where the hub cache keeps it: place it there
        os.makedirs(os.path.dirname(remote.local), exist_ok=True)
        os.symlink(os.path.abspath(got), remote.local)


class _Fetcher:
    """Downloads one spec's files in a background thread, one after another: the file that is opened, then
    the next, so file i+1 arrives while file i is tokenized. The thread ends when nothing is asked for."""

    def __init__(self) -> None:
        self.files: list[HubFile] = []
        self.futures: dict[int, Future] = {}
        self.pending: collections.deque[int] = collections.deque()
        self.lock = threading.Lock()
        self.thread: threading.Thread | None = None

    def get(self, i: int) -> None:
        """Wait until file i is in the cache (raising its download's error), the next one queued behind it."""
        with self.lock:
            wanted = self._want(i)
            if i + 1 < len(self.files):
                self._want(i + 1)
        wanted.result()

    def _want(self, i: int) -> Future:
        if i not in self.futures:
            self.futures[i] = Future()
            self.pending.append(i)
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="minigpt-hub-download", daemon=True)
                self.thread.start()
        return self.futures[i]

    def _run(self) -> None:
        while True:
            with self.lock:
                if not self.pending:
                    self.thread = None
                    return
                i = self.pending.popleft()
            future = self.futures[i]
            try:
                download(self.files[i].remote)
            except BaseException as e:  # handed to whoever opens the file
                future.set_exception(e)
            else:
                future.set_result(None)


class HubFile(type(Path())):  # type: ignore[misc]  # PosixPath or WindowsPath: Path itself cannot be subclassed
    """A hub dataset's file at its place in the local hub cache, there or not yet: opening it (anything that
    asks the operating system for it through os.fspath) waits for its download first; `stat()` answers from
    the hub's metadata (its size; mtime 0) without downloading. A copy in another process downloads alone."""

    remote: _Remote | None = None
    _fetcher: _Fetcher | None = None
    _index: int = 0

    def _attach(self, remote: _Remote, fetcher: _Fetcher | None) -> HubFile:
        self.remote, self._fetcher = remote, fetcher
        self._index = len(fetcher.files) if fetcher is not None else 0
        if fetcher is not None:
            fetcher.files.append(self)
        return self

    def __fspath__(self) -> str:
        if self.remote is not None:
            if self._fetcher is not None:
                self._fetcher.get(self._index)
            else:
                download(self.remote)
        return str(self)

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        if self.remote is None:  # a path derived from this one (its parent, say): an ordinary path
            return super().stat(follow_symlinks=follow_symlinks)
        return os.stat_result(
            (stat.S_IFREG | 0o444, 0, 0, 1, 0, 0, self.remote.size, 0, 0, 0, 0.0, 0.0, 0.0, 0, 0, 0)
        )

    def __reduce__(self):
        return _hub_file, (str(self), self.remote)


def _hub_file(path: str, remote: _Remote | None) -> HubFile:
    out = HubFile(path)
    if remote is not None:
        out._attach(remote, None)
    return out
