"""A prompt file checked without reading it whole: it exists, holds rows and has the columns asked for.

Run before any expensive work (loop/preflight.py), so a wrong path or key fails at once naming the
config key. Dotted columns (`reward_model.ground_truth`) reach nested fields, as datasets.lookup
reads them. JSONL: the first row that is a JSON object is checked (a bad row before it is the
dataset reader's to skip and count); Parquet: the schema.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from megatron_rl.data.datasets import lookup

__all__ = ["check_prompt_file"]


def check_prompt_file(path: str | Path, columns: dict[str, str], key: str) -> None:
    """ValueError naming `key` unless `path` is a file with at least one row and, in its first row
    (Parquet: its schema), every column of `columns` ({config key that names it: column})."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config key '{key}': no such file {path}")
    has, shown = (_parquet_columns if path.suffix == ".parquet" else _jsonl_columns)(path, key)
    for source, column in columns.items():
        if not has(column):
            where = "columns" if path.suffix == ".parquet" else "first row has keys"
            raise ValueError(f"config key '{key}': {path} has no {source} column {column!r} (its {where}: {shown})")


def _jsonl_columns(path: Path, key: str):
    """(has(column), top-level keys) of the first JSON object row."""
    first: Any = None
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                first = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(first, dict):
                break
    if not isinstance(first, dict):
        raise ValueError(f"config key '{key}': {path} has no rows (no line holds a JSON object)")

    def has(column: str) -> bool:
        try:
            return lookup(first, column) is not None
        except KeyError:
            return False

    return has, sorted(first)


def _parquet_columns(path: Path, key: str):
    """(has(column), top-level names) from the schema; a dotted column is followed through struct
    fields (a map or JSON-string column cannot be followed: its first part is enough here)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise ValueError(f"config key '{key}': {path} is not a Parquet file ({err})") from None
    if parquet.metadata.num_rows == 0:
        raise ValueError(f"config key '{key}': {path} has no rows")
    schema = parquet.schema_arrow

    def has(column: str) -> bool:
        if column in schema.names:
            return True
        head, *rest = column.split(".")
        if head not in schema.names:
            return False
        dtype = schema.field(head).type
        for part in rest:
            if not pa.types.is_struct(dtype):
                return True
            index = dtype.get_field_index(part)
            if index < 0:
                return False
            dtype = dtype.field(index).type
        return True

    return has, list(schema.names)
