"""Reading a dataset's records from disk: JSONL, Parquet, a `datasets.save_to_disk`
directory, or plain text.

Each reader yields (where, record) pairs, `where` being 'file:line' or 'file:row' so that
an error about a record can point at it. Nothing is downloaded: a name that is no local
path (such as a Hugging Face Hub id) is refused with what to do instead. Parquet and Arrow
need pyarrow (`pip install 'specroll[parquet]'`); `datasets` itself is never needed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PARQUET_EXTRA = "pip install 'specroll[parquet]' (or pip install pyarrow)"
"""What to run when pyarrow is missing."""
SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
"""File forms, besides a save_to_disk directory."""


def check_source(field: str, value: str) -> None:
    """ValueError naming `field` unless `value` is '' or a local file or directory (a Hub
    name is told that there is no Hub access)."""
    if not value:
        return
    p = Path(value).expanduser()
    if p.is_file() or p.is_dir():
        return
    if p.suffix in SUFFIXES or value.startswith((".", "/", "~")):
        raise ValueError(f"{field}: no such file or directory {value!r}")
    raise ValueError(
        f"{field}={value!r} is not a local file or directory, and datasets cannot be "
        f"downloaded from the Hugging Face Hub here (no hub access): save it where you have "
        f"access (datasets' save_to_disk, or to_json/to_parquet) and point {field} at that"
    )


def read_records(path: str | Path) -> list[tuple[str, Any]]:
    """(where, record) of every record in a JSONL/Parquet/text file or Arrow directory."""
    p = Path(path).expanduser()
    if p.is_dir():
        return _arrow_dir(p)
    if not p.is_file():
        raise ValueError(f"prompt file {p} does not exist")
    if p.suffix == ".parquet":
        pq = _pyarrow(p, "parquet")
        try:
            rows = pq.read_table(p).to_pylist()
        except Exception as e:  # pyarrow's errors name no file
            raise ValueError(f"{p}: not a readable Parquet file ({e})") from e
        return [(f"{p.name}:{i}", r) for i, r in enumerate(rows)]
    out = []
    for i, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        if p.suffix in (".jsonl", ".json"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{i}: not valid JSON ({e.msg})") from e
        else:
            rec = line.strip()
        out.append((f"{p.name}:{i}", rec))
    return out


def _pyarrow(p: Path, module: str):
    """pyarrow.parquet or pyarrow.ipc, or a ValueError naming the extra to install."""
    try:
        import importlib

        return importlib.import_module(f"pyarrow.{module}")
    except ImportError as e:
        raise ValueError(f"reading {p} needs pyarrow: {PARQUET_EXTRA}") from e


def _arrow_dir(p: Path) -> list[tuple[str, Any]]:
    """Rows of a directory written by `Dataset.save_to_disk` (state.json lists its Arrow
    files, in order); a DatasetDict's directory is refused naming its splits."""
    splits = p / "dataset_dict.json"
    if splits.is_file():
        names = json.loads(splits.read_text()).get("splits", [])
        raise ValueError(
            f"{p} holds a DatasetDict with splits {', '.join(names)}: point at one of them, "
            f"e.g. {p / (names[0] if names else 'train')}"
        )
    state = p / "state.json"
    if not state.is_file():
        raise ValueError(
            f"{p} is a directory but not one saved by datasets' save_to_disk (no state.json); "
            f"data files are JSONL, Parquet or such a directory"
        )
    files = [f["filename"] for f in json.loads(state.read_text()).get("_data_files", [])]
    ipc = _pyarrow(p, "ipc")
    out = []
    for name in files:
        try:
            with ipc.open_stream(str(p / name)) as reader:
                rows = reader.read_all().to_pylist()
        except Exception as e:
            raise ValueError(f"{p / name}: not a readable Arrow file ({e})") from e
        out += [(f"{p.name}/{name}:{len(out) + i}", r) for i, r in enumerate(rows)]
    return out
