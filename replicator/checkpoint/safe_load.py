"""DCP's reader with nothing unpickled: metadata through an allow-list, tensors weights_only (internal)."""

from __future__ import annotations

import pickle
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
        with open(path, "rb") as handle:
            metadata = MetadataUnpickler(handle).load()
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


def tensor_metadata(path: Path) -> dict[str, TensorStorageMetadata]:
    metadata = SafeReader(path).read_metadata()
    return {k: v for k, v in metadata.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}

