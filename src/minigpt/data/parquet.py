"""Parquet source files: a text column, or conversations ("messages", or "prompt" and "completion" columns),
read in batches of rows, row group by row group."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from minigpt.config import ConfigError, DataConfig
from minigpt.data.chat import is_conversation

BATCH_ROWS = 4096
"""Parquet files are read in batches of this many rows."""


def values(batch, examples: list[str] | None) -> list:  # batch: pyarrow.RecordBatch
    """A batch's rows: records of the conversation columns, or the text column's values as bytes (or None)."""
    import pyarrow as pa

    return batch.to_pylist() if examples else batch.column(0).cast(pa.large_binary()).to_pylist()


def example_columns(pf, cfg: DataConfig) -> list[str] | None:  # pf: pyarrow.parquet.ParquetFile
    """A Parquet file's conversation columns ("messages", or "prompt" and "completion") where it has no
    `text_field` column; None for a file of text."""
    names = pf.schema_arrow.names
    if cfg.text_field in names or not is_conversation(dict.fromkeys(names)):
        return None
    return ["messages"] if "messages" in names else ["prompt", "completion"]


def open_file(path: Path):  # -> pyarrow.parquet.ParquetFile
    """The Parquet file, if pyarrow can read it; else why not."""
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(f"reading {path} needs pyarrow: pip install pyarrow") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:
        raise ConfigError(f"{path} is not a readable Parquet file ({type(e).__name__}: {e})") from None


def check_text_column(pf, path: Path, field: str) -> None:  # pf: pyarrow.parquet.ParquetFile
    """Refuse a file without a string column `field`, saying why."""
    import pyarrow as pa

    schema = pf.schema_arrow
    if field not in schema.names:
        raise ConfigError(
            f'{path} has no "{field}" column (it has: {", ".join(schema.names[:8])}); '
            "choose one with --data.text-field"
        )
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ConfigError(f'{path}: column "{field}" holds {kind}, not strings')


def batches(pf, columns: list[str], group: int, skip: int) -> Iterator[tuple]:
    """(row group, its row the batch starts at, batch) of the columns from row `skip` of row group `group`
    on: read group by group, so a resume point names a group and a row in it."""
    for g in range(group, pf.num_row_groups):
        row = 0
        for batch in pf.iter_batches(batch_size=BATCH_ROWS, row_groups=[g], columns=columns):
            drop = min(max(skip - row, 0), batch.num_rows) if g == group else 0
            if drop < batch.num_rows:
                yield g, row + drop, batch.slice(drop)
            row += batch.num_rows
