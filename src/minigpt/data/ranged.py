"""A hub file fetched only as far as it is read: the default corpus's 1.9 GB training text, of which a run's
token store tokenizes a prefix.

`RangedFile` is the file at its place in the hub cache's snapshot, at a pinned commit. Its bytes arrive
CHUNK_BYTES at a time, by HTTP range requests against the hub's resolve URL for that commit, as its `reader()`
asks for them. They are appended to `datasets--OWNER--NAME/minigpt/ranged/SHA/NAME.part`, and NAME.json
records each piece appended with its sha256 once the piece is on disk. A piece torn by a kill is not in the
record, so its bytes are cut off before the next append; a recorded piece is checked against its digest
before its bytes are served (a damaged one is fetched again). So the partial file never serves bytes the
hub's file does not hold, and a later build (a run that needs more tokens, a download cut short) fetches
from where the last piece ends. Once every byte has arrived, the file is checked against its sha256 (the
hub's LFS etag) and put where huggingface_hub keeps a whole download (blobs/SHA256, linked from the
snapshot). Like `hub.HubFile`, `stat()` answers the hub's size with mtime 0, and the sha256 is the etag, so a
store's identity needs none of the bytes.

Offline (HF_HUB_OFFLINE=1, or the hub unreachable) the file resolves from the record, and the bytes already
fetched are read; a read past them ends in one line.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import sys
from pathlib import Path

from minigpt.data import hub
from minigpt.data.progress import megabytes
from minigpt.runtime import files as atomic

CHUNK_BYTES = 32 << 20
"""Bytes asked for per request (at least what the read needs): a few requests for a run's prefix."""
TIMEOUT_S = 30.0
"""How long a request may wait for the hub to answer (or to send more) before it counts as failed."""
_SHA256 = re.compile(r"[0-9a-f]{64}")


def hub_text(repo_id: str, name: str, why_offline: str | None) -> Path | None:
    """Dataset `repo_id`'s file `name` at its main branch's commit: a RangedFile, or the whole file's path
    where it was downloaded whole before (and never by range); None if it cannot be read by range (not an
    LFS file) or, offline (`why_offline` says why), is not in the local hub cache."""
    from huggingface_hub import try_to_load_from_cache

    storage = hub.hub_cache() / f"datasets--{repo_id.replace('/', '--')}"
    if why_offline is None:
        sha, size, digest = _head(repo_id, name)
        if not _SHA256.fullmatch(digest or ""):
            return None
        with contextlib.suppress(OSError):  # a read-only cache: offline use then needs the network once more
            (storage / "refs").mkdir(parents=True, exist_ok=True)
            atomic.write_text(storage / "refs" / "main", sha)
    else:
        try:
            sha = (storage / "refs" / "main").read_text().strip()
        except OSError:
            return None
    record = _record_path(hub.hub_cache(), repo_id, sha, name)
    if not record.is_file():
        whole = try_to_load_from_cache(repo_id, name, hub.hub_cache(), revision=sha, repo_type="dataset")
        if isinstance(whole, str):
            return Path(whole)
        if why_offline is not None:
            return None
        record.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_json(record, {"size": size, "sha256": digest, "pieces": []})
    saved = json.loads(record.read_text())
    remote = hub._Remote(repo_id, sha, name, int(saved["size"]), str(hub.hub_cache()))
    return _ranged_file(str(remote.local), remote, saved["sha256"])


def _head(repo_id: str, name: str) -> tuple[str, int, str | None]:
    """The commit main is at, and the file's size and etag there (a sha256 for an LFS file)."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    meta = get_hf_file_metadata(hf_hub_url(repo_id, name, repo_type="dataset"), timeout=hub.PROBE_TIMEOUT_S)
    if meta.commit_hash is None or meta.size is None:
        raise ValueError(f"the hub did not say which commit or size {name} has")
    return meta.commit_hash, int(meta.size), meta.etag


def _record_path(cache: Path | str, repo_id: str, sha: str, name: str) -> Path:
    return Path(cache, f"datasets--{repo_id.replace('/', '--')}", "minigpt", "ranged", sha, name + ".json")


class RangedFile(hub.HubFile):
    """A hub file whose bytes are fetched by range as `reader()` reads them (see the module's docstring).
    Anything that opens it through the operating system (os.fspath) gets the whole file, fetched first."""

    sha256: str = ""
    _checked: int = 0  # bytes of the partial file checked against their pieces' digests in this process

    @property
    def _record(self) -> Path:
        r = self.remote
        return _record_path(r.cache, r.repo_id, r.sha, r.name)

    @property
    def _part(self) -> Path:
        return self._record.with_suffix(".part")

    @property
    def _where(self) -> str:
        return f"hf:{self.remote.repo_id} file {self.remote.name} (revision {self.remote.sha[:12]})"

    def reader(self) -> io.BufferedReader:
        """The file for reading bytes (seek, read, lines), each read waiting for its bytes to arrive."""
        return io.BufferedReader(_Raw(self))  # a small buffer: a large one would read (and fetch) ahead

    def __fspath__(self) -> str:
        if self.remote is not None:
            self.available(self.remote.size)
        return str(self)

    def __reduce__(self):
        return _ranged_file, (str(self), self.remote, self.sha256)

    def available(self, end: int) -> Path:
        """A plain path to a file whose first `end` bytes are this one's: the whole file, or the partial one
        once it holds (checked) at least `end` bytes, fetching what is missing."""
        whole = Path(str(self))
        while True:
            if whole.is_file():
                return whole
            if end <= self._checked:
                return self._part
            pieces = _load(self._record)["pieces"]
            have = sum(n for n, _ in pieces)
            if have >= self.remote.size:
                self._finish()
            elif have >= end:
                self._check(pieces, end)
            else:
                self._fetch(end)

    def _check(self, pieces: list, end: int) -> None:
        """Check the recorded pieces holding bytes up to `end` (not yet checked) against their digests; a
        damaged one is cut off, with all after it, to be fetched again."""
        at = 0
        with (
            open(self._part, "rb") if self._part.exists() else io.BytesIO() as f
        ):  # gone: every piece is damaged
            for n, digest in pieces:
                if at >= self._checked and at < end:
                    f.seek(at)
                    if hashlib.sha256(f.read(n)).hexdigest() != digest:
                        print(
                            f"{self._where}: the bytes fetched from {at:,} on are damaged; fetching them again"
                        )
                        self._cut(at)
                        return
                    self._checked = at + n
                at += n

    def _cut(self, at: int) -> None:
        with atomic.locked(self._record.with_suffix(".lock")):
            saved = _load(self._record)
            kept, total = [], 0
            for n, digest in saved["pieces"]:
                if total + n > at:
                    break
                kept.append([n, digest])
                total += n
            atomic.write_json(self._record, {**saved, "pieces": kept})
            if self._part.exists():
                os.truncate(self._part, total)

    def _fetch(self, end: int) -> None:
        """Append at least up to `end` (CHUNK_BYTES at least, unless the file ends first) to the partial file,
        from where its recorded pieces end; a one-line DownloadError if nothing arrives."""
        if hub.offline():
            have = sum(n for n, _ in _load(self._record)["pieces"])
            raise hub.DownloadError(
                f"{self._where}: the build reads its first {end:,} bytes, and the local hub cache holds "
                f"{have:,} of its {self.remote.size:,}, with HF_HUB_OFFLINE set; unset it (or set "
                "HF_HUB_OFFLINE=0) and connect to fetch the rest, or pass local text with --data"
            )
        with atomic.locked(self._record.with_suffix(".lock")):
            saved = _load(self._record)
            have = sum(n for n, _ in saved["pieces"])
            if have >= end:  # another process fetched it meanwhile
                return
            stop = min(self.remote.size, max(end, have + CHUNK_BYTES))
            if have == 0:
                print(
                    f"downloading {self._where} as far as tokenizing reads it ({megabytes(self.remote.size)} "
                    f"in all, {megabytes(CHUNK_BYTES)} at a time) ...",
                    file=sys.stderr,
                    flush=True,
                )
            self._part.parent.mkdir(parents=True, exist_ok=True)
            with open(self._part, "ab") as f:
                f.truncate(have)  # a piece torn by a kill: bytes that were never recorded
                _append(self, f, have, stop, saved)

    def _finish(self) -> None:
        """Every byte has arrived: check the whole against the hub's sha256, and put it where huggingface_hub
        keeps a whole download."""
        with atomic.locked(self._record.with_suffix(".lock")):
            whole = Path(str(self))
            if whole.is_file():
                return
            h = hashlib.sha256()
            with open(self._part, "rb") as f:
                while block := f.read(1 << 24):
                    h.update(block)
            if h.hexdigest() != self.sha256:  # start over: which bytes are wrong is not known
                atomic.write_json(self._record, {**_load(self._record), "pieces": []})
                self._part.unlink()
                raise hub.DownloadError(
                    f"{self._where} as downloaded does not match its sha256 on the hub; rerun to download it again"
                )
            blob = Path(
                self.remote.cache, f"datasets--{self.remote.repo_id.replace('/', '--')}", "blobs", self.sha256
            )
            blob.parent.mkdir(parents=True, exist_ok=True)
            os.replace(self._part, blob)
            whole.parent.mkdir(parents=True, exist_ok=True)
            whole.symlink_to(os.path.relpath(blob, whole.parent))
            print(f"downloaded {self._where} whole, checked against its sha256", file=sys.stderr, flush=True)


def _append(file: RangedFile, f, start: int, stop: int, saved: dict) -> None:
    """GET bytes [start, stop) of the hub's file and append them to `f`, recording what arrived as a piece once
    it is on disk (also when cut short, Ctrl-C included); a one-line DownloadError if nothing did."""
    from huggingface_hub import hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session

    r = file.remote
    url = hf_hub_url(r.repo_id, r.name, repo_type="dataset", revision=r.sha)
    headers = {**build_hf_headers(), "Range": f"bytes={start}-{stop - 1}", "Accept-Encoding": "identity"}
    h, n, failure = hashlib.sha256(), 0, None
    try:
        with get_session().stream(
            "GET", url, headers=headers, timeout=TIMEOUT_S, follow_redirects=True
        ) as got:
            if got.status_code != 206 or not got.headers.get("Content-Range", "").startswith(
                f"bytes {start}-"
            ):
                raise ValueError(f"the hub answered HTTP {got.status_code} to a range request")
            for block in got.iter_bytes():  # as they arrive: a dropped connection keeps what came
                block = block[: stop - start - n]
                f.write(block)
                h.update(block)
                n += len(block)
    except Exception as e:
        failure = f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"
    finally:
        if n:
            f.flush()
            os.fsync(f.fileno())
            saved["pieces"].append([n, h.hexdigest()])
            atomic.write_json(file._record, saved)
    if n == 0:
        raise hub.DownloadError(
            f"could not download {file._where} ({failure or 'no bytes arrived'}); rerun to resume (the bytes "
            "fetched are kept), or set HF_HUB_OFFLINE=1 to use only what is cached"
        )


def _load(record: Path) -> dict:
    try:
        return json.loads(record.read_text())
    except (OSError, ValueError) as e:
        raise hub.DownloadError(
            f"{record} is unreadable ({type(e).__name__}); delete it to download again"
        ) from None


class _Raw(io.RawIOBase):
    """A RangedFile's bytes from any position, each read fetching what it needs first (none past the end)."""

    def __init__(self, file: RangedFile) -> None:
        self.file, self.pos = file, 0
        self.f, self.opened = None, None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = (0, self.pos, self.file.remote.size)[whence]
        self.pos = base + offset
        return self.pos

    def readinto(self, buffer) -> int:
        end = min(self.pos + len(buffer), self.file.remote.size)
        if end <= self.pos:
            return 0
        path = self.file.available(end)
        if path != self.opened:
            if self.f is not None:
                self.f.close()
            self.f, self.opened = open(path, "rb"), path  # noqa: SIM115  # held across reads, closed in close()
        self.f.seek(self.pos)
        n = self.f.readinto(memoryview(buffer)[: end - self.pos])
        if n != end - self.pos:  # never a short read: it would end the text early
            raise OSError(f"{path} holds fewer bytes than recorded")
        self.pos = end
        return n

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None
        super().close()


def _ranged_file(path: str, remote: hub._Remote | None, sha256: str) -> RangedFile:
    out = RangedFile(path)
    if remote is not None:
        out._attach(remote, None)
        out.sha256 = sha256
    return out
