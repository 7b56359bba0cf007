"""Text sources read as a stream of documents, one file at a time.

Sources are `.txt` files (documents separated by `<|endoftext|>` or by blank lines), `.jsonl` files (one
JSON object per line, the text under `text_field`) and `.parquet` files (the `text_field` column), given as
files, folders or glob patterns (walked into symlinked folders, but never around a symlink loop). They are
read in blocks, so no step holds a whole file or its text in memory; a long document comes out in pieces,
cut where GPT-2's pre-tokenizer splits anyway. Binary or undecodable input is refused naming the file and
position, or (with `encoding_errors="replace"`) used anyway and reported as a `DataWarning`. Empty paths,
.json files and files that cannot be read are refused too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from minigpt.config import ConfigError, DataConfig
from minigpt.data import hub, parquet, ranged
from minigpt.data.chat import ExampleRecord, example_record, is_conversation
from minigpt.data.progress import megabytes
from minigpt.data.tokenizer import EOT

TINYSTORIES = ("roneneldan/TinyStories", "TinyStories-train.txt", "TinyStories-valid.txt")
SOURCE_SUFFIXES = (".txt", ".jsonl", ".parquet")
"""What a folder is searched for; a file named explicitly (or matched by a glob) of any other suffix is text,
except .json, which is refused (minigpt reads JSON Lines)."""

BLOCK_BYTES = 1 << 20
"""Text files are read in blocks of this size."""
PIECE_CHARS = 1 << 20
"""Longer documents go to the tokenizer in pieces of at most this size, cut where GPT-2's pre-tokenizer
splits anyway (after a line break, before a non-space), so the tokens equal those of the whole document."""
LONG_DOC_BYTES = 64 << 20
"""A document longer than this is tokenized (in pieces) but warned about: the separator is probably wrong."""


def resolve_files(paths: Iterable[str | Path], flag: str = "--data") -> list[Path]:
    """Expand files, folders (recursively: .txt, .jsonl, .parquet) and glob patterns into a file list.

    Folders and globs expand in sorted order; a file given twice is read once; missing paths, empty paths
    (which would mean the current folder), .json files and things that are not files are errors. Symlinked
    folders are followed, except into a loop: each real folder is walked once, never one holding the start.
    A hub dataset (`hf:OWNER/NAME...`, see `minigpt.data.hub`) gives its files in the local hub cache, each
    downloaded when it is first opened; a hub file given as such (the default corpus's) is taken as it is."""
    files: list[Path] = []
    for p in paths:
        if isinstance(p, hub.HubFile):
            files.append(p)
            continue
        if not p.strip():
            raise ConfigError(f"{flag} got an empty path {p!r}; name a file, folder or glob pattern")
        if hub.is_spec(p):
            files.extend(hub.resolve(p, flag))
            continue
        path = Path(p).expanduser()
        if glob.has_magic(str(path)):
            matches = [Path(m) for m in sorted(_glob(str(path)))]
            if not matches:
                raise ConfigError(f"no files match {p}")
            for m in matches:
                files.extend(_folder_files(m) if m.is_dir() else [_source_file(m)])
        elif path.is_dir():
            files.extend(_folder_files(path))
        else:
            files.append(_source_file(path))
    unique = {f if isinstance(f, hub.HubFile) else f.resolve(): None for f in files}  # resolve() downloads
    return list(unique)


def _source_file(path: Path) -> Path:
    """path, if it is a regular file minigpt can read as a source; else a one-line reason."""
    if path.is_file():
        _refuse_json(path)
        return path
    if path.is_symlink() and not path.exists():
        raise ConfigError(f"data path {path} is a broken symbolic link (to {os.readlink(path)})")
    if path.exists():
        raise ConfigError(f"data path {path} is not a regular file or folder (a pipe, socket or device?)")
    raise ConfigError(f"data path not found: {path}")


def _refuse_json(path: Path) -> None:
    if path.suffix.lower() == ".json":
        raise ConfigError(
            f"{path}: minigpt reads JSON Lines (.jsonl, one JSON object per line), not .json; if it already "
            f"holds one object per line, rename it to .jsonl, and convert a JSON array with "
            f"jq -c '.[]' {path.name} > {path.stem}.jsonl"
        )


def _walk_dirs(root: Path) -> Iterator[Path]:
    """root and every folder below it (hidden ones skipped), following symlinked folders but entering each
    real folder once and never one that holds root (`ln -s .. loop` would otherwise recurse forever)."""
    seen = set()
    for d in (root.resolve(), *root.resolve().parents):
        with contextlib.suppress(OSError):
            st = d.stat()
            seen.add((st.st_dev, st.st_ino))
    stack = [root]
    while stack:
        d = stack.pop()
        yield d
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name, reverse=True)
        except OSError:
            continue  # unreadable folder: what it holds cannot be a source
        for e in entries:
            try:
                if e.name.startswith(".") or not e.is_dir():
                    continue
                st = e.stat()
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                stack.append(Path(e.path))


def _glob(pattern: str) -> list[str]:
    """glob.glob(pattern, recursive=True), but `**` walks folders with _walk_dirs, so a symlink loop ends."""
    parts = Path(pattern).parts
    if "**" not in parts:
        return glob.glob(pattern)  # no recursion: nothing to loop
    i = parts.index("**")
    head, rest = (str(Path(*parts[:i])) if i else "."), parts[i + 1 :]
    bases = glob.glob(head) if glob.has_magic(head) else [head]
    out: list[str] = []
    for base in bases:
        if not os.path.isdir(base):
            continue
        for d in _walk_dirs(Path(base)):
            out += _glob(os.path.join(glob.escape(str(d)), *rest)) if rest else [str(d)]
    return out


def _folder_files(folder: Path) -> list[Path]:
    found = []
    for d in _walk_dirs(folder):
        try:
            entries = list(os.scandir(d))
        except OSError:
            continue
        found += [
            Path(e.path)
            for e in entries
            if not e.name.startswith(".") and Path(e.name).suffix in SOURCE_SUFFIXES and e.is_file()
        ]
    if not found:
        raise ConfigError(f"folder {folder} holds no {', '.join(SOURCE_SUFFIXES)} files")
    return sorted(found)


@dataclasses.dataclass
class FileStats:
    """What reading one file found: bytes replaced, documents over LONG_DOC_BYTES, documents."""

    replaced: int = 0
    long_docs: int = 0
    documents: int = 0
    doc_bytes: int = 0
    """Bytes of the document being read, so far (kept here so a resume point carries it)."""
    plain_eots: int = 0
    """<|endoftext|> markers read as plain text (--data.separator blank-line)."""


def _decode(raw: bytes, path: Path, offset: int, errors: str, stats: FileStats, where: str = "") -> str:
    """UTF-8 text of raw, which starts at byte `offset` of the file; a byte-order mark at 0 is dropped."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if errors == "error":
            raise ConfigError(
                f"{path}{where} is not valid UTF-8 (bad byte at offset {offset + e.start}); "
                "pass --data.encoding-errors replace to replace undecodable bytes"
            ) from None
        text = raw.decode("utf-8", "replace")
        stats.replaced += text.count("\ufffd") - raw.count("\ufffd".encode())  # minus genuine U+FFFDs
    return text[1:] if offset == 0 and not where and text.startswith("\ufeff") else text


def _check_text(raw: bytes, path: Path, offset: int) -> None:
    nul = raw.find(b"\x00")
    if nul >= 0:
        raise ConfigError(f"{path} is not a text file (NUL byte at offset {offset + nul})")


def _cut(buf, lo: int, hi: int) -> int:
    """Where to end a piece of buf (str or bytes), in [lo, hi]: after a line break, else before a space, that
    has a non-space on either side. GPT-2's pre-tokenizer (tiktoken's and HF's byte-level alike) always
    splits there, so the pieces tokenize exactly like the whole. Failing both (no such break in the window),
    at hi, moved back to a UTF-8 character boundary for bytes."""
    for sep, after in (("\n", 1), (" ", 0)):
        if isinstance(buf, bytes):
            sep = sep.encode()
        j = buf.rfind(sep, lo, hi)
        while j > lo and (buf[j - 1 : j].isspace() or buf[j + 1 : j + 2].isspace() or j + 1 >= len(buf)):
            j = buf.rfind(sep, lo, j)
        if j > lo:
            return j + after
    if isinstance(buf, bytes):
        while hi > lo + 1 and (buf[hi] & 0xC0) == 0x80:
            hi -= 1
    return hi


ONE_KIND = (
    "one source holds one kind (conversations for validation too); train on both as a mixture, "
    "--data chat=FILE text=FILE"
)
CHAT_TOKENIZER = (
    "train on conversations from a transformers checkpoint (--init-from FOLDER) or with its tokenizer "
    "(--data.tokenizer hf --data.hf-tokenizer FOLDER): a chat template renders them"
)


def sources_hold_examples(cfg: DataConfig, train: list[Path], val: list[Path], tokenizer: Any) -> bool:
    """Whether the sources are conversations (examples for the chat template) rather than text; refuses a
    source of both, and conversations without a tokenizer that has a chat template. A hub dataset's files are
    judged by each split's first, and only for a chat tokenizer, so otherwise none is fetched before its turn
    (the build checks the others: `mixed_kinds`)."""
    chat_tokenizer = hasattr(tokenizer, "chat_template")
    remote = lambda f: isinstance(f, (hub.HubFile, ranged.RangedFile))
    firsts = [next((f for f in fs if remote(f)), None) for fs in (train, val)] if chat_tokenizer else []
    kinds = {f: holds_examples(f, cfg) for f in (*train, *val) if not remote(f) or f in firsts}
    chat, text = [f for f, k in kinds.items() if k], [f for f, k in kinds.items() if not k]
    if chat and text:
        raise ConfigError(f"{chat[0]} holds conversations and {text[0]} text: {ONE_KIND}")
    if chat and not chat_tokenizer:
        raise ConfigError(f"{chat[0]} holds conversations: {CHAT_TOKENIZER}")
    return bool(chat)


def mixed_kinds(path: Path, record: str, examples: bool) -> ConfigError:
    """The error for a source file whose `record` is not of the kind (`examples` or text) the store holds."""
    if examples:
        return ConfigError(
            f"{path} holds text, where the source's first file holds conversations: {ONE_KIND}"
        )
    return ConfigError(f"{path} holds conversations, where text was expected: {ONE_KIND}; {CHAT_TOKENIZER}")


def holds_examples(path: Path, cfg: DataConfig) -> bool:
    """Whether a .jsonl or .parquet file holds conversations (or prompt/completion pairs) rather than text:
    its first record (its columns) has no `text_field` but a conversation's fields, as TRL recognises them."""
    if path.suffix == ".parquet":
        return parquet.example_columns(parquet.open_file(path), cfg) is not None
    if path.suffix != ".jsonl":
        return False
    try:
        with open_binary(path) as f:
            line = next((raw for raw in f if raw.strip()), b"")
        record = json.loads(line)
    except (OSError, ValueError):
        return False  # the reader says what is wrong with it
    return isinstance(record, dict) and cfg.text_field not in record and is_conversation(record)


Record = tuple[str, bool, bool]
"""(text, begins a document, ends a document): a whole document, or a piece of a long one."""
Mark = Callable[[dict], None]
"""Called by a reader with a resume point (see `read_records`)."""


def _point(stats: FileStats, read: int, **where: int | bool) -> dict:
    """A resume point: where the reader stands (its own fields), the stats so far and the bytes reported to
    `advance` so far; plain JSON, so it can be journaled."""
    return {**where, "bytes": read, "stats": dataclasses.asdict(stats)}


def _read_txt(
    path: Path,
    cfg: DataConfig,
    stats: FileStats,
    advance: Callable[[int], None],
    start: dict | None,
    mark: Mark,
) -> Iterator[Record]:
    eot = EOT.encode()
    sep_b = re.compile(rb"\n[ \t\r\f\v]*\n")
    sep_s = re.compile(re.escape(EOT) if cfg.separator == "eot" else r"\n[ \t\r\f\v]*\n")
    carry, offset = b"", 0  # offset: position of carry[0] in the file
    in_doc = False  # carry continues a document whose first pieces were already yielded
    with open_binary(path) as f:
        if start:  # carry is the file from offset to where the next read starts: the reads stay aligned
            offset, in_doc = start["offset"], start["in_doc"]
            f.seek(offset)
            carry = f.read(start["pos"] - offset)
        while True:
            pos = offset + len(carry)
            mark(_point(stats, pos, offset=offset, pos=pos, in_doc=in_doc))
            block = f.read(BLOCK_BYTES)
            advance(len(block))
            _check_text(block, path, offset + len(carry))
            buf = carry + block
            if not block:
                cut = len(buf)
            elif cfg.separator == "eot":
                i = buf.rfind(eot)
                cut = i + len(eot) if i >= 0 else 0
            else:
                cut = max((m.end() for m in sep_b.finditer(buf)), default=0)
            if not cut and not block and in_doc:
                yield "", False, True
            if cut:
                docs = sep_s.split(_decode(buf[:cut], path, offset, cfg.encoding_errors, stats))
                if in_doc:
                    stats.plain_eots += docs[0].count(EOT) if cfg.separator != "eot" else 0
                    yield docs[0].rstrip(), False, True
                    docs, in_doc = docs[1:], False
                for doc in docs:
                    doc = doc.strip()
                    if doc:
                        stats.plain_eots += doc.count(EOT) if cfg.separator != "eot" else 0
                        yield doc, True, True
            carry, offset = buf[cut:], offset + cut
            if not block:
                return
            while len(carry) > 2 * PIECE_CHARS:  # no separator in sight: pass on a piece of this document
                c = _cut(carry, PIECE_CHARS // 2, PIECE_CHARS)
                piece = _decode(carry[:c], path, offset, cfg.encoding_errors, stats)
                if not in_doc:
                    piece = piece.lstrip()
                if piece or in_doc:
                    stats.plain_eots += piece.count(EOT) if cfg.separator != "eot" else 0
                    yield piece, not in_doc, False
                    in_doc = True
                carry, offset = carry[c:], offset + c


def open_binary(path: Path) -> BinaryIO:
    """A source file opened for reading bytes; a hub file fetched by range arrives as it is read."""
    return path.reader() if isinstance(path, ranged.RangedFile) else open(path, "rb")


def _read_jsonl(
    path: Path,
    cfg: DataConfig,
    stats: FileStats,
    advance: Callable[[int], None],
    start: dict | None,
    mark: Mark,
) -> Iterator[Record]:
    offset, lines_done, first = (start["offset"], start["line"], start["first"]) if start else (0, 0, True)
    read = _json_example if holds_examples(path, cfg) else _json_text
    next_mark = offset  # a resume point at the start of a line, about every BLOCK_BYTES
    with open_binary(path) as f:
        f.seek(offset)
        for lineno, line in enumerate(f, lines_done + 1):
            if offset >= next_mark:
                mark(_point(stats, offset, offset=offset, line=lineno - 1, first=first))
                next_mark = offset + BLOCK_BYTES
            advance(len(line))
            _check_text(line, path, offset)
            text_line = _decode(line, path, offset, cfg.encoding_errors, stats)
            offset += len(line)
            if not text_line.strip():
                continue
            if first:
                _check_json_lines(path, text_line)
                first = False
            text = read(text_line, f"{path}:{lineno}", cfg, stats)
            if text is not None and text.strip():
                yield text, True, True


def _json_object(line: str, where: str) -> dict:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where} is not valid JSON ({e.msg})") from None
    if not isinstance(obj, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(obj).__name__}")
    return obj


def _json_example(line: str, where: str, cfg: DataConfig, stats: FileStats) -> ExampleRecord:
    """One line of a file of conversations, checked: its messages (or prompt and completion) alone."""
    return example_record(_json_object(line, where), where)


def _json_text(line: str, where: str, cfg: DataConfig, stats: FileStats) -> str | None:
    """The text field of one JSON Lines line (None if null); `where` is "path:lineno" for messages."""
    field = cfg.text_field
    obj = _json_object(line, where)
    if field not in obj and is_conversation(obj):
        raise ConfigError(f"{where} is a conversation, but the file's first record is text: {ONE_KIND}")
    if field not in obj:
        keys = ", ".join(list(obj)[:8])
        raise ConfigError(
            f'{where} has no "{field}" field (it has: {keys}); choose one with --data.text-field'
        )
    text = obj[field]
    if text is None:
        return None
    if not isinstance(text, str):
        raise ConfigError(f'{where}: "{field}" must be a string, got {type(text).__name__}')
    try:
        text.encode()
    except UnicodeEncodeError:  # a lone surrogate written as a \ud8xx escape
        if cfg.encoding_errors == "error":
            raise ConfigError(
                f"{where} holds a lone UTF-16 surrogate escape, which is not text; "
                "pass --data.encoding-errors replace to replace it"
            ) from None
        fixed = text.encode("utf-8", "replace").decode()
        stats.replaced += fixed.count("?") - text.count("?")
        text = fixed
    return text


def _check_json_lines(path: Path, first_line: str) -> None:
    """Refuse a file whose first line shows it is one JSON document (an array, or an object spread over
    lines), not JSON Lines."""
    line = first_line.strip()
    if line.startswith("["):
        what, jq = "a JSON array", "jq -c '.[]'"
    elif line == "{":
        what, jq = "one JSON object spread over lines", "jq -c ."
    else:
        return
    raise ConfigError(
        f"{path} holds {what}, not JSON Lines (one JSON object per line); "
        f"convert it with {jq} {path.name} > {path.stem}.lines.jsonl"
    )


def _read_parquet(
    path: Path,
    cfg: DataConfig,
    stats: FileStats,
    advance: Callable[[int], None],
    start: dict | None,
    mark: Mark,
) -> Iterator[Record]:
    pf = parquet.open_file(path)
    examples = parquet.example_columns(pf, cfg)
    if examples is None:
        parquet.check_text_column(pf, path, cfg.text_field)
    size, rows_total = path.stat().st_size, max(pf.metadata.num_rows, 1)
    at, skip, rows_done, reported = (
        (start["row_group"], start["row"], start["rows_done"], start["bytes"]) if start else (0, 0, 0, 0)
    )
    for group, first_row, batch in parquet.batches(pf, examples or [cfg.text_field], at, skip):
        mark(_point(stats, reported, row_group=group, row=first_row, rows_done=rows_done))
        for row, value in enumerate(parquet.values(batch, examples), rows_done):
            text = (
                example_record(value, f"{path} row {row}")
                if examples
                else value and _decode(value, path, 0, cfg.encoding_errors, stats, where=f" row {row}")
            )
            if text and text.strip():
                yield text, True, True
        rows_done += batch.num_rows
        done = size * rows_done // rows_total
        advance(done - reported)
        reported = done
    advance(size - reported)


def read_records(
    path: Path,
    cfg: DataConfig,
    stats: FileStats,
    advance: Callable[[int], None] = lambda n: None,
    start: dict | None = None,
    mark: Mark = lambda point: None,
) -> Iterator[Record]:
    """One source file's documents, long ones in pieces of at most PIECE_CHARS characters.

    Reading calls `mark` with a resume point about once per BLOCK_BYTES (per batch of rows for Parquet),
    from inside the call that asks for the next record: just then, exactly the records before the point were
    yielded, so the caller's own state matches it. `start=point` (with a fresh `stats`) yields the rest, the
    same records and stats as reading on would have; `advance` then counts only the bytes after the point
    (the point's "bytes" were reported before it)."""
    _refuse_json(path)
    if start is not None:
        for name, value in start["stats"].items():
            setattr(stats, name, value)
    reader = {".jsonl": _read_jsonl, ".parquet": _read_parquet}.get(path.suffix, _read_txt)
    try:
        yield from _pieces(reader(path, cfg, stats, advance, start, mark), stats)
    except OSError as e:  # vanished, unreadable, a folder, an I/O error: the file, not a traceback
        raise ConfigError(f"{path} could not be read ({os_reason(e)})") from None


def os_reason(e: OSError) -> str:
    """An OSError's reason in a few words ("Permission denied"), without the path it repeats."""
    return e.strerror or (str(e).splitlines() or [type(e).__name__])[0]


def _pieces(records: Iterator[Record], stats: FileStats) -> Iterator[Record]:
    """records, counting documents and long ones, with any longer than PIECE_CHARS cut into pieces."""
    for text, begins, ends in records:
        if begins:
            stats.doc_bytes = 0
        stats.doc_bytes += len(text) if text.isascii() else len(text.encode())
        if ends:
            stats.documents += 1
            stats.long_docs += stats.doc_bytes > LONG_DOC_BYTES
        if len(text) <= PIECE_CHARS or isinstance(text, ExampleRecord):
            yield text, begins, ends
            continue
        start = 0
        while len(text) - start > PIECE_CHARS:
            end = _cut(text, start + PIECE_CHARS // 2, start + PIECE_CHARS)
            yield text[start:end], begins and start == 0, False
            start = end
        yield text[start:], begins and start == 0, ends


def read_documents(path: str | Path, cfg: DataConfig | None = None) -> list[str]:
    """A source file's documents as strings (whole, as the store holds them); for tests and inspection."""
    cfg = cfg or DataConfig()
    docs: list[str] = []
    current: list[str] = []
    for text, _, ends in read_records(Path(path), cfg, FileStats()):
        current.append(text)
        if ends:
            docs.append("".join(current))
            current = []
    return docs


def file_warnings(path: Path, stats: FileStats) -> list[str]:
    """The DataWarning messages for what reading `path` found: replaced bytes, suspiciously long documents."""
    out = []
    if stats.replaced:
        out.append(f"{path}: replaced {stats.replaced:,} undecodable byte sequences with U+FFFD")
    if stats.long_docs:
        out.append(
            f"{path}: {stats.long_docs:,} documents longer than {megabytes(LONG_DOC_BYTES)} "
            "(tokenized in pieces; is --data.separator right?)"
        )
    if stats.plain_eots:
        out.append(
            f"{path}: {stats.plain_eots:,} {EOT} lines read as plain text, since --data.separator blank-line "
            "splits documents at blank lines only; pass --data.separator eot to split at them"
        )
    return out


def download_tinystories() -> tuple[tuple[Path | str, ...], tuple[str, ...]]:
    """TinyStories' training and validation text from the Hugging Face hub, the default corpus: the training
    text fetched only as far as a build reads it (`ranged.RangedFile`), the validation text whole; offline (or
    the hub unreachable), what the hub cache holds."""
    from huggingface_hub import hf_hub_download, try_to_load_from_cache

    repo, train, valid = TINYSTORIES
    why = hub.unreachable()  # then only the hub cache's copy, at once
    cache = str(hub.hub_cache())
    try:
        train_file = ranged.hub_text(repo, train, why)
        if train_file is None and why is None:  # not one the hub serves by range: whole, as it used to be
            train_file = hf_hub_download(repo, train, repo_type="dataset", cache_dir=cache)
        if train_file is None:
            raise FileNotFoundError(train)
        if not isinstance(train_file, hub.HubFile):  # a whole download: a local path like any other
            train_file = str(train_file)
        sha = Path(train_file).parent.name  # snapshots/SHA/NAME: the commit the text is pinned to
        if why is None and not isinstance(try_to_load_from_cache(repo, valid, cache, sha, "dataset"), str):
            print(
                f"downloading TinyStories' validation text ({repo}) from the Hugging Face hub ...", flush=True
            )
        val = hf_hub_download(
            repo, valid, repo_type="dataset", revision=sha, cache_dir=cache, local_files_only=why is not None
        )
    except hub.DownloadError:
        raise
    except Exception as e:
        raise ConfigError(
            f"could not download TinyStories from the Hugging Face hub ({why or type(e).__name__}); "
            "pass local text with --data PATH [--val-data PATH]"
        ) from None
    return (train_file,), (val,)
