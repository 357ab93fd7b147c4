"""DCP's reader with nothing unpickled: metadata through an allow-list, tensors weights_only (internal)."""

from __future__ import annotations

import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from replicator.checkpoint.errors import CheckpointError

__all__: list[str] = []

DCP_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                 "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name to torch's own object
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class MetadataUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; accept only DCP's own record types, as weights_only does for tensors."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in DCP_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise CheckpointError(
            f"the checkpoint's .metadata refers to {module}.{name}, which is not part of DCP's metadata; "
            "refusing to load it (it could run arbitrary code)"
        )


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata unpickled through an allow-list; tensors load weights_only."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"  # DCP's name for the collective (rank-0) metadata file
        try:
            with open(path, "rb") as handle:
                metadata = MetadataUnpickler(handle).load()
        except CheckpointError:
            raise
        except FileNotFoundError as error:
            raise CheckpointError(f"{path} is missing: without DCP's index of its tensors the checkpoint cannot be "
                                  "read; restore another checkpoint") from error
        except Exception as error:  # truncated or overwritten: pickle's own errors name no file
            raise CheckpointError(f"{path} (DCP's index of the checkpoint's tensors) cannot be read "
                                  f"({type(error).__name__}: {error}): the file is damaged; restore another checkpoint"
                                  ) from error
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path} does not hold DCP metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id  # as DCP's own reader does, for its logging
        metadata.storage_meta = storage_meta
        return metadata


class TensorsOnlyPlanner(DefaultLoadPlanner):
    """Replicator writes no pickled entries, so one found at load time is refused, not unpickled."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        raise CheckpointError(
            f"checkpoint entry {read_item.dest_index.fqn} is pickled bytes, which replicator never writes; "
            "refusing to unpickle it"
        )


@dataclass(frozen=True)
class Index:
    """What a checkpoint's .metadata says of its tensors: shape and dtype, and where each chunk's bytes lie."""

    path: Path
    tensors: dict[str, TensorStorageMetadata]
    chunks: dict[str, list[tuple[str, int, int]]]  # key -> (data file, first byte, length) of each chunk

    def where(self, key: str) -> str:
        """`key` and the data file(s) holding it, for an error message."""
        files = sorted({file for file, _, _ in self.chunks.get(key, [])})
        return f"{key} (in {', '.join(str(self.path / file) for file in files) or self.path / '.metadata'})"

    def check_files(self, keys: Iterable[str]) -> None:
        """Every chunk of `keys` lies inside its data file: a missing or cut file is named with a key it holds
        before dcp.load, whose own error would name neither."""
        sizes: dict[str, int | None] = {}
        for key in keys:
            for file, start, length in self.chunks.get(key, []):
                if file not in sizes:
                    sizes[file] = (self.path / file).stat().st_size if (self.path / file).is_file() else None
                size = sizes[file]
                if size is None or start + length > size:
                    found = "is missing" if size is None else f"ends at byte {size}"
                    raise CheckpointError(
                        f"checkpoint {self.path} cannot be read: {self.path / file} {found}, but the checkpoint's "
                        f"entry {key} lies at bytes {start} to {start + length} of it (an interrupted copy?); "
                        "restore another checkpoint")


def read_index(path: Path) -> Index:
    metadata = SafeReader(path).read_metadata()
    tensors = {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    chunks: dict[str, list[tuple[str, int, int]]] = {}
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}  # a file system writer's
    for index, info in storage.items():
        chunks.setdefault(index.fqn, []).append((str(info.relative_path), int(info.offset), int(info.length)))
    return Index(path, tensors, chunks)

