"""Reading a dataset's records from disk: JSONL, a JSON array, Parquet, a
`datasets.save_to_disk` directory, or plain text.

Each reader yields (where, record) pairs, `where` being 'file:line', 'file[index]' or
'file:row' so that an error about a record can point at it. Nothing is downloaded: a name
that is no local path (such as a Hugging Face Hub id) is refused with what to do instead.
Parquet and Arrow need pyarrow (`pip install 'specroll[parquet]'`); `datasets` itself is
never needed.

Data files come from elsewhere, so every reader bounds what it accepts and names the file
when it refuses: text is UTF-8 (a UTF-16/32 byte-order mark is named), lines end at "\\n"
only (U+2028 and U+0085 are characters of a JSON string, not line breaks), a record nests
at most `MAX_NESTING` levels, a FIFO or device is not read (it could block forever),
Parquet/Arrow binary columns are refused (bytes are no text a prompt or reward can use)
and dates and times become ISO 8601 strings, decimals exact strings, so records reach
reward functions as JSON-like values.
"""

from __future__ import annotations

import codecs
import datetime
import decimal
import json
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

PARQUET_EXTRA = "pip install 'specroll[parquet]' (or pip install pyarrow)"
"""What to run when pyarrow is missing."""
SUFFIXES = (".jsonl", ".json", ".parquet", ".txt")
"""File forms, besides a save_to_disk directory."""
MAX_NESTING = 64
"""Levels of objects and lists a record may nest (chat messages with tool calls take
about 6); deeper ones are refused before anything recurses into them."""
PROGRESS_LINES = 50_000
"""Lines between two progress calls of `read_records`."""
MAX_JSON_ARRAY_BYTES = 256 << 20
"""Largest `.json` file read as one array of records (parsed whole, in memory); larger data
goes in JSONL, one record per line."""
BOMS = (
    (codecs.BOM_UTF32_LE, "UTF-32"),  # before UTF-16 LE: it starts with the same two bytes
    (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"),
    (codecs.BOM_UTF16_BE, "UTF-16"),
)
"""Byte-order marks of the encodings that are not UTF-8, and their names."""
_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


def special_kind(path: str | Path) -> str | None:
    """What `path` is when it exists but is neither a regular file nor a directory ('a FIFO
    (named pipe)', ...), else None. Reading one could block forever or never end."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return next((name for test, name in _KINDS if test(mode)), None)


def check_source(field: str, value: str) -> None:
    """ValueError naming `field` unless `value` is '' or a local file or directory (a Hub
    name is told that there is no Hub access)."""
    if not value:
        return
    p = Path(value).expanduser()
    kind = special_kind(p)
    if kind:
        raise ValueError(
            f"{field}={value!r} is {kind}, not a regular file; data files are read whole: "
            f"save the data to a file and point {field} at it"
        )
    if p.is_file() or p.is_dir():
        return
    if p.suffix in SUFFIXES or value.startswith((".", "/", "~")):
        raise ValueError(f"{field}: no such file or directory {value!r}")
    raise ValueError(
        f"{field}={value!r} is not a local file or directory, and datasets cannot be "
        f"downloaded from the Hugging Face Hub here (no hub access): save it where you have "
        f"access (datasets' save_to_disk, or to_json/to_parquet) and point {field} at that"
    )


def decode(data: bytes) -> str:
    """UTF-8 text of a file's bytes (a UTF-8 byte-order mark dropped); ValueError saying
    which encoding it is instead (the caller names the file)."""
    for bom, name in BOMS:
        if data.startswith(bom):
            raise ValueError(
                f"a {name} text file (it starts with a {name} byte-order mark); data files "
                f"must be UTF-8: convert it, e.g. iconv -f {name} -t UTF-8 FILE > NEW"
            )
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"not a UTF-8 text file (byte {e.start}); data files must be UTF-8 text"
        ) from None


def read_records(
    path: str | Path, progress: Callable[[int, int], None] | None = None
) -> list[tuple[str, Any]]:
    """(where, record) of every record in a JSONL/JSON/Parquet/text file or Arrow directory;
    `progress(lines read, lines)` is called as a JSONL file of more than `PROGRESS_LINES`
    lines is read (a million records take seconds)."""
    p = Path(path).expanduser()
    source = read_source(p)
    if isinstance(source, bytes):
        return [(f"{p.name}:{i}", rec) for i, _, _, rec in json_lines(p, source, progress)]
    return source


def read_source(path: str | Path) -> bytes | list[tuple[str, Any]]:
    """A data file read once: a JSON-lines file (`.jsonl`, or a `.json` that is not one
    array) as its bytes, checked to be UTF-8 text, for `json_lines` to parse; any other
    form as its (where, record) pairs (`read_records`)."""
    p = Path(path).expanduser()
    if p.is_dir():
        return _arrow_dir(p)
    kind = special_kind(p)
    if kind:
        raise ValueError(f"prompt file {p} is {kind}, not a regular file")
    if not p.is_file():
        raise ValueError(f"prompt file {p} does not exist")
    if p.suffix == ".parquet":
        pq = _pyarrow(p, "parquet")
        try:
            table = pq.read_table(p)
        except Exception as e:  # pyarrow's errors name no file
            raise ValueError(f"{p}: not a readable Parquet file ({e})") from e
        return _rows(table, p, p.name)
    data = p.read_bytes()
    try:
        text = decode(data)
    except ValueError as e:
        raise ValueError(f"{p}: {e}") from None
    if p.suffix == ".json" and text.lstrip()[:1] == "[":
        return _json_array(p, text)
    if p.suffix in (".jsonl", ".json"):
        return data
    # "\n" only: str.splitlines would also break at U+2028, U+0085 ... inside a string
    lines = text.split("\n")
    return [(f"{p.name}:{i}", x.strip()) for i, x in enumerate(lines, 1) if x.strip()]


def json_lines(
    p: Path, data: bytes, progress: Callable[[int, int], None] | None = None
) -> Iterator[tuple[int, int, int, Any]]:
    """(line number, start, end, record) of each non-empty line of JSON-lines bytes `data`
    (`read_source`), `data[start:end]` being the line; `progress(lines read,
    lines)` as in `read_records`."""
    total = data.count(b"\n") + 1
    start = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    for i in range(1, total + 1):
        end = data.find(b"\n", start)
        end = len(data) if end < 0 else end
        line = data[start:end].decode("utf-8")
        if line.strip():
            yield i, start, end, json_line(p, line, i)
        if progress is not None and i % PROGRESS_LINES == 0:
            progress(i, total)
        start = end + 1
    if progress is not None and total >= PROGRESS_LINES:
        progress(total, total)


def json_line(p: Path, line: str, i: int) -> Any:
    """The record on line `i` of `p`, checked for nesting."""
    rec = _json(p, line, i)
    # a line with fewer brackets than MAX_NESTING cannot nest deeper: no walk needed
    shallow = line.count("{") + line.count("[") < MAX_NESTING
    return rec if shallow else _plain(rec, f"{p}:{i}")


def _json(p: Path, text: str, line: int) -> Any:
    """One JSON value, or a ValueError naming the file and line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}:{line + e.lineno - 1}: not valid JSON ({e.msg})") from None
    except RecursionError:
        raise ValueError(
            f"{p}:{line}: nested too deeply (records may nest at most {MAX_NESTING} levels)"
        ) from None


def _json_array(p: Path, text: str) -> list[tuple[str, Any]]:
    """The records of a `.json` file holding one top-level array of them."""
    size = p.stat().st_size
    if size > MAX_JSON_ARRAY_BYTES:
        raise ValueError(
            f"{p}: a JSON array of {size / 2**20:.0f} MiB, more than the "
            f"{MAX_JSON_ARRAY_BYTES >> 20} MiB read whole; write it as JSONL (one record per "
            f"line, e.g. jq -c '.[]' {p.name} > {p.stem}.jsonl)"
        )
    records = _json(p, text, 1)
    if not isinstance(records, list):  # '[' opened it, so this cannot happen; kept honest
        raise ValueError(f"{p}: expected a JSON array of records")
    return [(f"{p.name}[{i}]", _plain(r, f"{p}[{i}]")) for i, r in enumerate(records)]


def _plain(value: Any, where: str, depth: int = 0) -> Any:
    """A record as JSON-like Python: dates and times as ISO 8601 strings, decimals as exact
    strings; ValueError naming `where` when it nests deeper than MAX_NESTING."""
    if isinstance(value, dict | list):
        if depth >= MAX_NESTING:
            raise ValueError(
                f"{where}: nested more than {MAX_NESTING} levels deep (records may nest at "
                f"most {MAX_NESTING})"
            )
        if isinstance(value, list):
            return [_plain(v, where, depth + 1) for v in value]
        return {k: _plain(v, where, depth + 1) for k, v in value.items()}
    if isinstance(value, datetime.date | datetime.time):  # datetime is a date
        return value.isoformat()
    if isinstance(value, datetime.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return str(value)
    return value


def _pyarrow(p: Path, module: str):
    """pyarrow.parquet or pyarrow.ipc, or a ValueError naming the extra to install."""
    try:
        import importlib

        return importlib.import_module(f"pyarrow.{module}")
    except ImportError as e:
        raise ValueError(f"reading {p} needs pyarrow: {PARQUET_EXTRA}") from e


def _rows(table, p: Path, prefix: str, start: int = 0) -> list[tuple[str, Any]]:
    """(where, record) of an Arrow table's rows; a binary column is refused by name."""
    for field in table.schema:
        if _holds_binary(field.type):
            raise ValueError(
                f"{p}: column {field.name!r} holds binary data ({field.type}), which no "
                f"prompt or reward can read as text: drop it, or cast it to a string column"
            )
    return [
        (f"{prefix}:{start + i}", _plain(r, f"{p}:{start + i}"))
        for i, r in enumerate(table.to_pylist())
    ]


def _holds_binary(t) -> bool:
    """Whether an Arrow type is, or nests, a binary type."""
    import pyarrow as pa

    if pa.types.is_binary(t) or pa.types.is_large_binary(t) or pa.types.is_fixed_size_binary(t):
        return True
    if getattr(pa.types, "is_binary_view", lambda _: False)(t):
        return True
    if pa.types.is_map(t):
        return _holds_binary(t.key_type) or _holds_binary(t.item_type)
    if hasattr(t, "value_type"):  # lists of every kind (and dictionaries: their values)
        return _holds_binary(t.value_type)
    return any(_holds_binary(t.field(i).type) for i in range(getattr(t, "num_fields", 0)))


def _arrow_dir(p: Path) -> list[tuple[str, Any]]:
    """Rows of a directory written by `Dataset.save_to_disk` (state.json lists its Arrow
    files, in order); a DatasetDict's directory is refused naming its splits."""
    splits = p / "dataset_dict.json"
    if splits.is_file():
        names = _json_file(splits).get("splits", [])
        raise ValueError(
            f"{p} holds a DatasetDict with splits {', '.join(map(str, names))}: point at one "
            f"of them, e.g. {p / (str(names[0]) if names else 'train')}"
        )
    state = p / "state.json"
    if not state.is_file():
        raise ValueError(
            f"{p} is a directory but not one saved by datasets' save_to_disk (no state.json); "
            f"data files are JSONL, Parquet or such a directory"
        )
    try:
        files = [str(f["filename"]) for f in _json_file(state).get("_data_files", [])]
    except (TypeError, KeyError) as e:
        raise ValueError(f"{state}: '_data_files' must list {{'filename': ...}} ({e})") from None
    ipc = _pyarrow(p, "ipc")
    out: list[tuple[str, Any]] = []
    for name in files:
        f = (p / name).resolve()
        if not f.is_relative_to(p.resolve()) or not f.is_file():
            raise ValueError(f"{state}: lists {name!r}, which is no file in {p}")
        try:
            with ipc.open_stream(str(f)) as reader:
                table = reader.read_all()
        except Exception as e:
            raise ValueError(f"{p / name}: not a readable Arrow file ({e})") from e
        out += _rows(table, p / name, f"{p.name}/{name}", len(out))
    return out


def _json_file(path: Path) -> dict:
    """A small JSON object of a save_to_disk directory, or a ValueError naming it."""
    try:
        out = json.loads(decode(path.read_bytes()))
    except (ValueError, RecursionError) as e:
        raise ValueError(f"{path}: not a readable JSON object ({e})") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: not a readable JSON object")
    return out
