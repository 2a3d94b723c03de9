"""Reading a sharded (DCP) checkpoint that may come from elsewhere, as data only.

`torch.distributed.checkpoint` as shipped reads a checkpoint's `.metadata` with
`pickle.load` and the non-tensor items of its `.distcp` shards (optimizer settings such
as `lr` and `betas`) with `torch.load(weights_only=False)`: either runs whatever code the
file names. `read` is the one way specroll loads a DCP directory (a learner's restore on
any number of ranks, `specroll export`), and it reads every file as data:

* `.metadata` through `model.untrusted.load_restricted`, admitting only DCP's metadata
  classes and the few torch values they hold (sizes, dtypes, layouts), and checked before
  DCP sees it: every shard it names is a regular file beside it, with no stream
  transform (specroll never writes one: a decompressor would be a memory bomb);
* tensor items as DCP reads them (`torch.load(weights_only=True)`), non-tensor items the
  same way (`_DataOnlyPlanner`), instead of DCP's unrestricted `torch.load`.

Any refusal or failure is one `UnreadableFile` line naming the file, on every rank: DCP
gathers a rank's failure to all of them (`CheckpointException`), and `read` unwraps it.
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from specroll.model.untrusted import UnreadableFile, explain, load_restricted, unreadable

METADATA = ".metadata"
"""The file of a DCP directory that describes every item and where its bytes lie."""
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "StorageMeta",
        "MetadataIndex",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # a layout by its name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},  # StorageMeta.checkpoint_id
}
"""The globals a DCP `.metadata` may name (what torch 2.13 writes): constructors of
plain records, none of which runs anything it is given."""


def _allowed(module: str, name: str) -> bool:
    """Whether `.metadata` may import `module.name`: one of ALLOWED, or a torch dtype
    (looked up in torch's namespace without importing anything)."""
    if name in ALLOWED.get(module, ()):
        return True
    return module == "torch" and isinstance(vars(torch).get(name), torch.dtype)


def _not_dcp(f: Path, why: str) -> UnreadableFile:
    return UnreadableFile(f"{f}: not a checkpoint this specroll can read safely ({why})")


def read_metadata(directory: Path) -> Metadata:
    """The DCP directory's metadata, unpickled with only ALLOWED globals and checked: a
    Metadata whose every item lies in a regular file beside it, untransformed."""
    f = directory / METADATA
    md = load_restricted(f, _allowed)
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise _not_dcp(f, f"it holds a {type(md).__name__}, not DCP metadata")
    if md.storage_meta is not None and not isinstance(md.storage_meta, StorageMeta):
        raise _not_dcp(f, "its storage_meta is not DCP's")
    for info in md.storage_data.values():
        if not isinstance(info, _StorageInfo):
            raise _not_dcp(f, "an item's location is not DCP's")
        name = info.relative_path
        shard = directory / name if isinstance(name, str) else None
        plain = isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..")
        if not plain or shard is None or shard.is_symlink() or not shard.is_file():
            raise _not_dcp(f, f"it names {name!r} as a shard, which is not a file beside it")
        if info.transform_descriptors:
            raise _not_dcp(f, f"it asks for stream transforms {info.transform_descriptors!r}")
        for n in (info.offset, info.length):
            if type(n) is not int or n < 0:
                raise _not_dcp(f, f"an item of {name} has offset or length {n!r}")
    return md


class _DataOnlyReader(FileSystemReader):
    """DCP's file reader over metadata checked by `read_metadata` (read once, before DCP
    asks for it), which names the shard a failing item came from."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._metadata = read_metadata(Path(path))
        self._reading: str | None = None

    def read_metadata(self, *args, **kwargs) -> Metadata:
        md = self._metadata
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def _slice_file(self, file, sinfo: _StorageInfo):
        self._reading = sinfo.relative_path
        return super()._slice_file(file, sinfo)

    def read_data(self, plan, planner):
        try:
            return super().read_data(plan, planner)
        except Exception as e:  # noqa: BLE001 - a forged shard fails anywhere: name it
            raise explain(e, Path(self.path) / (self._reading or ""), "checkpoint") from None


class _DataOnlyPlanner(DefaultLoadPlanner):
    """DCP's default load planner, reading non-tensor items (optimizer settings) with
    `torch.load(weights_only=True)` where DCP would unpickle them unrestricted."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)  # a refusal: named by the reader
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def read(state_dict: dict, path: str | Path) -> None:
    """Fill `state_dict` (tensors, sharded or not, and optimizer settings) in place from
    the DCP directory `path`, written with any number of ranks; a collective when a
    process group is up. Files that ask to run code, or do not fit, are refused in one
    `UnreadableFile` line naming the file."""
    path = Path(path)
    reader = _DataOnlyReader(path)
    try:
        with warnings.catch_warnings():  # one process without a group: meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state_dict, storage_reader=reader, planner=_DataOnlyPlanner())
    except CheckpointException as e:  # a BaseException: gathered from every rank
        failures = [exc for exc, _ in e.failures.values()]
        for exc in failures:
            if isinstance(exc, UnreadableFile):
                raise UnreadableFile(str(exc)) from None
        raise unreadable(path, "checkpoint", failures[0] if failures else e) from None
