"""Replicas hold the same tensors: layouts and values compared by digest, replica 0's copied, differences named.

Every check costs one agreement of a few integers in the common case (the replicas agree).
Only when digests differ do replicas gather the full lists (names, shapes and dtypes as
text, or one CRC per tensor) to name what differs, never unpickling anything from a peer.
"""

from __future__ import annotations

import functools
import weakref
import zlib
from collections.abc import Callable, Sequence
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parameter import is_lazy

from replicator.comm.agreement import Agreement
from replicator.comm.objects import all_gather_values
from replicator.errors import ReplicaMismatchError

__all__ = ["NamedTensors", "describe", "fingerprint", "Fingerprints", "require_same_layout", "copy_from_first",
           "broadcast_from_first", "require_identical"]

NamedTensors = Sequence[tuple[str, torch.Tensor]]

_SHOWN = 5  # differing tensors an error names before it summarises


def describe(name: str, tensor: torch.Tensor) -> str:
    """'Linear.weight (3, 4) float32': what replicas must agree on before they exchange values."""
    if is_lazy(tensor):  # a lazy module's parameter: no shape until its first forward
        return f"{name} (uninitialized)"
    return f"{name} {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _layout(named: NamedTensors) -> list[str]:
    return [describe(name, tensor) for name, tensor in named]


def _digest(lines: list[str]) -> int:
    return zlib.crc32("\n".join(lines).encode("utf-8"))


_BLOCK_WORDS = 1 << 17  # 8-byte words per block of a large tensor's digest: the multipliers (1 MB) stay in cache
_CRC_BYTES = 1 << 18  # tensors up to this size get the CRC of their bytes; larger ones, the faster block digest


@functools.cache
def _multipliers() -> np.ndarray:
    """One odd 64-bit multiplier per word of a block: splitmix64 of the word's index, the same on every machine."""
    z = np.arange(1, _BLOCK_WORDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return (z ^ (z >> np.uint64(31))) | np.uint64(1)


def _block_digest(data: np.ndarray) -> int:
    """A 32-bit digest of many bytes at about three times the speed of their CRC (which zlib computes at ~4 GB/s).

    Each block of 8-byte words is summed with fixed odd multipliers modulo 2**64 (integer
    arithmetic, exact on every machine), and the CRC of those sums and of the bytes left over
    is the digest. A change to any one word always changes its block's sum, since an odd
    multiplier is invertible modulo 2**64; other changes escape it with a chance of the order of
    2**-32, as they do a CRC. It is for the identity checks at run()'s start and end, which read
    the whole model and its optimizer state.
    """
    words = data[: data.size // 8 * 8].view(np.dtype("<u8"))
    multipliers = _multipliers()
    sums = np.array([np.dot(words[start:start + _BLOCK_WORDS], multipliers[:len(words[start:start + _BLOCK_WORDS])])
                     for start in range(0, words.size, _BLOCK_WORDS)], dtype=np.dtype("<u8"))
    return zlib.crc32(data[words.size * 8:].tobytes(), zlib.crc32(sums.tobytes(), data.size))


def fingerprint(tensor: torch.Tensor) -> int:
    """A 32-bit digest of the tensor's bytes (their CRC, or for large tensors the faster `_block_digest`).

    Equal whenever the values are bit-for-bit equal; different values give equal digests with
    a chance of about 2**-32.
    """
    if tensor.is_sparse:  # a sparse optimizer state (SGD's momentum of sparse gradients): its rows and values
        sparse = tensor.detach().coalesce()
        return zlib.crc32(fingerprint(sparse.values()).to_bytes(4, "little"), fingerprint(sparse.indices()))
    data = tensor.detach().to("cpu").reshape(-1)  # 1-d: a 0-d tensor cannot be viewed as bytes
    if not data.numel():
        return zlib.crc32(b"")
    raw = data.view(torch.uint8).numpy()  # the buffer, not a copy
    return zlib.crc32(raw.data) if raw.size <= _CRC_BYTES else _block_digest(raw)


class Fingerprints:
    """Fingerprints of large tensors, computed again only for those changed in place since (their version counter).

    A run's end and the next run's start (or a checkpoint right after a run) then hash the
    model once, not twice. Tensors are known by a weak reference, so a new tensor at an old
    one's address is never mistaken for it. Writes through `.data` do not advance the version
    counter; those go unseen until the tensor is next changed through autograd-visible ops.
    """

    _SMALL = 1 << 16  # elements: cheaper to hash again than to look up (optimizer options, step counts)

    def __init__(self) -> None:
        self._known: dict[int, tuple[weakref.ref[torch.Tensor], int, int]] = {}

    def __call__(self, tensor: torch.Tensor) -> int:
        if tensor.numel() < self._SMALL:
            return fingerprint(tensor)
        known = self._known.get(id(tensor))
        if known is not None and known[0]() is tensor and known[1] == tensor._version:
            return known[2]
        value = fingerprint(tensor)
        self._known[id(tensor)] = (weakref.ref(tensor), tensor._version, value)
        return value


def _first_difference(mine: list[str], reference: list[str]) -> str:
    """'has X where replica 0 has Y': the first entry at which two layouts part."""
    for index in range(max(len(mine), len(reference))):
        ours = mine[index] if index < len(mine) else None
        theirs = reference[index] if index < len(reference) else None
        if ours != theirs:
            if ours is None:
                return f"lacks {theirs}, which replica 0 has ({len(mine)} tensors against replica 0's {len(reference)})"
            if theirs is None:
                return f"has {ours}, which replica 0 lacks ({len(mine)} tensors against replica 0's {len(reference)})"
            return f"has {ours} where replica 0 has {theirs}"
    return "differs from replica 0"  # the digests collided on text that differs elsewhere: not expected


def _raise_layout_mismatch(agreement: Agreement, lines: list[str], where: str, advice: str) -> NoReturn:
    layouts = [text.split("\n") if text else [] for text in all_gather_values("\n".join(lines), agreement.group)]
    report = [f"replicas hold differently shaped parameters or state {where} (raised on replica {agreement.rank}):"]
    report += [f"  replica {replica} {_first_difference(layout, layouts[0])}"
               for replica, layout in enumerate(layouts) if layout != layouts[0]]
    report.append(advice)
    raise ReplicaMismatchError("\n".join(report))


def require_same_layout(agreement: Agreement, named: NamedTensors, where: str, advice: str) -> None:
    """Raise on every replica unless all replicas hold tensors of the same names, shapes and dtypes, in order."""
    if agreement.size == 1:
        return
    lines = _layout(named)
    what = f"checking that every replica's parameters and state have the same names and shapes {where}"
    verdict = agreement.require_same(what, "", [_digest(lines)])
    if not verdict.unanimous:
        _raise_layout_mismatch(agreement, lines, where, advice)


def copy_from_first(named: NamedTensors, group: dist.ProcessGroup | None, source: int, agreement: Agreement,
                    where: str, advice: str) -> None:
    """Overwrite every tensor with replica 0's (global rank `source`), once all replicas agree on their layout.

    Without that check, a replica with a differently shaped model would hand the backend
    buffers of another size (Gloo aborts the process), and one with the same sizes in another
    order would silently take values meant for other tensors.
    """
    require_same_layout(agreement, named, where, advice)
    broadcast_from_first([tensor for _, tensor in named], group, source)


def broadcast_from_first(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, source: int) -> None:
    """Overwrite every tensor with global rank `source`'s, one message per dtype and device (layouts agreed)."""
    if group is None or dist.get_world_size(group) == 1:
        return
    by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_kind.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for kind in sorted(by_kind, key=str):
        members = by_kind[kind]
        flat = torch.cat([t.detach().reshape(-1) for t in members])
        dist.broadcast(flat, src=source, group=group)
        with torch.no_grad():
            for tensor, part in zip(members, flat.split([t.numel() for t in members])):
                tensor.copy_(part.view_as(tensor))


def require_identical(agreement: Agreement, named: NamedTensors, where: str, advice: str | Callable[[list[str]], str],
                      fingerprint_of: Callable[[torch.Tensor], int] = fingerprint) -> None:
    """Raise on every replica unless all replicas hold bit-identical `named` tensors, naming the first that differ.

    One agreement of two digests (the layout's and the values') in the common case; on a
    mismatch, the layouts or the per-tensor fingerprints are gathered to say where. `advice`
    may be a function of the differing tensors' names, for advice that depends on which differ.
    """
    if agreement.size == 1:
        return
    lines = _layout(named)
    prints = [fingerprint_of(tensor) for _, tensor in named]
    combined = zlib.crc32(b"".join(value.to_bytes(4, "little") for value in prints))
    what = f"checking that every replica holds the same parameters and state {where}"
    verdict = agreement.require_same(what, "", [_digest(lines), combined])
    if verdict.unanimous:
        return
    if verdict.maxima[0] != verdict.minima[0]:
        _raise_layout_mismatch(agreement, lines, where, advice([]) if callable(advice) else advice)
    mine = torch.tensor(prints, dtype=torch.int64)
    everyone = [torch.empty_like(mine) for _ in range(agreement.size)]
    dist.all_gather(everyone, mine, group=agreement.group)
    reference = everyone[0]
    report = [f"replicas hold different values {where} (raised on replica {agreement.rank}):"]
    differing: list[str] = []
    for replica, theirs in enumerate(everyone):
        names = [name for (name, _), a, b in zip(named, theirs.tolist(), reference.tolist()) if a != b]
        if names:
            shown = ", ".join(names[:_SHOWN]) + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")
            report.append(f"  replica {replica} differs from replica 0 in {shown}")
            differing += [name for name in names if name not in differing]
    report.append(advice(differing) if callable(advice) else advice)
    raise ReplicaMismatchError("\n".join(report))
