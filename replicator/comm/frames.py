"""Frames of the peer link: a fixed binary header, tensor descriptors, raw tensor bytes, parsed against agreed bounds.

A frame on the wire is

    header     32 bytes, little-endian: magic u32, version u16, kind u16, flags u32,
               request id u64, extension length u32, payload length u64
    extension  `extension length` bytes: for a tensor frame, a count u16 and per tensor its
               dtype code u8, its number of dimensions u8 and each dimension u64
    payload    `payload length` bytes: the tensors' bytes, one after another, dense

Nothing in a frame is ever unpickled: every field is a number checked against the bounds
both ends agreed on (`Limits`) before a byte of the payload is read, and the descriptors
must account for the payload to the byte. A frame that breaks a rule raises `FrameError`.
"""

from __future__ import annotations

import ctypes
import functools
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

__all__ = ["HEADER", "MAGIC", "VERSION", "HELLO", "WELCOME", "FIRST_USER_KIND", "Limits", "FrameError", "Header",
           "TensorSpec", "Frame", "Outgoing", "encode", "parse_header", "parse_specs", "byte_view"]

HEADER = struct.Struct("<IHHIQIQ")
MAGIC = 0x4B4C5052  # b"RPLK" read as a little-endian u32
VERSION = 1
# Kinds below FIRST_USER_KIND belong to the link itself.
HELLO = 1  # a connecting peer: the job's token and who it is
WELCOME = 2  # the accepting side: who it is and the bounds it holds frames to
FIRST_USER_KIND = 16

_COUNT = struct.Struct("<H")
_SPEC = struct.Struct("<BB")
_DIM = struct.Struct("<Q")

# Codes on the wire, fixed: a new dtype gets a new code, an old code never changes meaning.
DTYPE_CODES: dict[torch.dtype, int] = {
    torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4, torch.int8: 5, torch.uint8: 6,
    torch.int16: 7, torch.int32: 8, torch.int64: 9, torch.bool: 10, torch.complex64: 11, torch.complex128: 12,
    torch.uint16: 13, torch.uint32: 14, torch.uint64: 15,
}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


class FrameError(ValueError):
    """A frame broke the protocol: a wrong magic or version, lengths past the bounds, descriptors that do not add up."""


@dataclass(frozen=True)
class Limits:
    """The bounds both ends of a link hold every frame to (the accepting side's, told in its WELCOME)."""

    max_payload: int = 1 << 31  # bytes of tensor data in one frame (2 GiB: a 500M-parameter float32 model)
    max_extension: int = 64 << 10  # bytes of descriptors
    max_tensors: int = 4096
    max_dims: int = 16


class Header(NamedTuple):
    """A frame header's fields (a named tuple: parsed for every frame, it costs a third of a frozen dataclass)."""

    kind: int
    flags: int
    request: int
    extension: int  # its length in bytes
    payload: int  # its length in bytes


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass
class Frame:
    """One received frame. Its tensors are the caller's own (`into=`) or views of a buffer the
    link reuses: valid until the next receive on the same connection (clone to keep)."""

    kind: int
    flags: int = 0
    request: int = 0
    tensors: list[torch.Tensor] = field(default_factory=list)


def byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (writable: a receive can land in it)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError(f"the peer link moves contiguous CPU tensors, got one on {tensor.device} "
                         f"(contiguous: {tensor.is_contiguous()}); call .contiguous().cpu() first")
    nbytes = tensor.nbytes
    if not nbytes:
        return memoryview(b"")
    # A ctypes array over the tensor's own bytes: cheaper than going through numpy, for any dtype; it holds the
    # tensor, so the memory outlives every view of it.
    raw = (ctypes.c_char * nbytes).from_address(tensor.data_ptr())
    raw._tensor = tensor  # type: ignore[attr-defined]
    return memoryview(raw).cast("B")


# PyMemoryView_FromMemory, through its own prototype (the shared `ctypes.pythonapi` entry stays as it is).
_FROM_MEMORY = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)(
    ("PyMemoryView_FromMemory", ctypes.pythonapi))
_READ_ONLY = 0x100  # PyBUF_READ


def _borrowed_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, read-only, for a send that holds the tensor meanwhile: a third of
    `byte_view`'s cost, because the view does not keep the tensor alive (never let it outlive the call)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        return byte_view(tensor)  # which raises, saying why
    nbytes = tensor.nbytes
    return _FROM_MEMORY(tensor.data_ptr(), nbytes, _READ_ONLY) if nbytes else memoryview(b"")


class Outgoing(tuple[torch.Tensor, ...]):
    """Tensors sent frame after frame from the same memory (a server's flat buffers, a reply's header): their
    descriptors and byte views are made once, so a send only packs the 32-byte header. A tuple, so that
    it cannot change; the tensors must keep their storage (no `.data =`, `set_` or resize) while it is used."""

    extension: bytes
    views: list[memoryview]
    payload: int
    max_dims: int

    def __new__(cls, tensors: Sequence[torch.Tensor]) -> Outgoing:
        made = super().__new__(cls, tensors)
        made.extension = describe(made, Limits())
        made.views = [view for view in map(byte_view, made) if view.nbytes]
        made.payload = sum(view.nbytes for view in made.views)
        made.max_dims = max((tensor.dim() for tensor in made), default=0)
        return made


def encode(kind: int, tensors: Sequence[torch.Tensor], request: int, flags: int, limits: Limits,
           extension: bytes | None = None) -> list[memoryview | bytes]:
    """The buffers of one frame, for a single `sendmsg`: header and extension, then each tensor's bytes in place
    (views that do not hold the tensors: send them before the caller lets go of `tensors`).

    `extension` replaces the tensor descriptors (the link's own HELLO and WELCOME frames)."""
    if not 0 <= kind < 1 << 16 or not 0 <= flags < 1 << 32 or not 0 <= request < 1 << 64:
        raise ValueError(f"kind must fit 16 bits, flags 32 and the request id 64, got {kind}, {flags}, {request}")
    if isinstance(tensors, Outgoing) and extension is None:
        _check_counts(len(tensors), tensors.max_dims, len(tensors.extension), limits)
        views: list[memoryview] = tensors.views
        payload, extension = tensors.payload, tensors.extension
    else:
        if extension is None:
            extension = describe(tensors, limits)
        views = [view for view in map(_borrowed_view, tensors) if view.nbytes]  # the caller holds the tensors
        payload = sum(view.nbytes for view in views)
    if payload > limits.max_payload:
        raise ValueError(f"a frame may carry at most {limits.max_payload} bytes of tensors, these are {payload}")
    return [HEADER.pack(MAGIC, VERSION, kind, flags, request, len(extension), payload) + extension, *views]


# The descriptors of the last few lists of (dtype, shape) sent: a peer sends the same shapes frame after frame.
_DESCRIBED: dict[tuple[tuple[torch.dtype, torch.Size], ...], tuple[bytes, int]] = {}


def describe(tensors: Sequence[torch.Tensor], limits: Limits) -> bytes:
    key = tuple((tensor.dtype, tensor.shape) for tensor in tensors)
    known = _DESCRIBED.get(key)
    if known is None:
        known = _described(key)
        if len(_DESCRIBED) >= 256:
            _DESCRIBED.clear()
        _DESCRIBED[key] = known
    extension, max_dims = known
    _check_counts(len(tensors), max_dims, len(extension), limits)
    return extension


def _check_counts(count: int, max_dims: int, extension: int, limits: Limits) -> None:
    if count > limits.max_tensors:
        raise ValueError(f"a frame may carry at most {limits.max_tensors} tensors, got {count}")
    if max_dims > limits.max_dims:
        raise ValueError(f"a tensor on the peer link has at most {limits.max_dims} dimensions, got {max_dims}")
    if extension > limits.max_extension:
        raise ValueError(f"the tensors' descriptors take {extension} bytes, more than {limits.max_extension}")


def _described(key: tuple[tuple[torch.dtype, torch.Size], ...]) -> tuple[bytes, int]:
    """The descriptors of tensors of these dtypes and shapes, and their largest number of dimensions."""
    if len(key) >= 1 << 16:
        raise ValueError(f"a frame may carry fewer than {1 << 16} tensors, got {len(key)}")
    parts = [_COUNT.pack(len(key))]
    for dtype, shape in key:
        code = DTYPE_CODES.get(dtype)
        if code is None:
            raise ValueError(f"the peer link cannot carry {dtype}; it carries {sorted(map(str, DTYPE_CODES))}")
        if len(shape) > 255:
            raise ValueError(f"a tensor on the peer link has at most 255 dimensions, got {len(shape)}")
        parts.append(_SPEC.pack(code, len(shape)))
        parts.extend(_DIM.pack(size) for size in shape)
    return b"".join(parts), max((len(shape) for _, shape in key), default=0)


def parse_header(raw: bytes | bytearray | memoryview, limits: Limits) -> Header:
    """The header's fields, once magic, version and both lengths are within `limits`."""
    magic, version, kind, flags, request, extension, payload = HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise FrameError(f"not a frame of the peer link (magic {magic:#010x}, expected {MAGIC:#010x})")
    if version != VERSION:
        raise FrameError(f"frame version {version}, this end speaks version {VERSION}")
    if extension > limits.max_extension:
        raise FrameError(f"a header extension of {extension} bytes, past the agreed {limits.max_extension}")
    if payload > limits.max_payload:
        raise FrameError(f"a payload of {payload} bytes, past the agreed {limits.max_payload}")
    return Header(kind, flags, request, extension, payload)


def parse_specs(raw: bytes | bytearray | memoryview, payload: int, limits: Limits) -> tuple[TensorSpec, ...]:
    """The tensors an extension describes; they must account for `payload` to the byte.

    A peer sends the same shapes frame after frame: the answer for the last few is kept, and
    the same object returned (a refused extension is not kept: it raises every time)."""
    return _parse_specs(bytes(raw), payload, limits)


@functools.lru_cache(maxsize=64)
def _parse_specs(raw: bytes, payload: int, limits: Limits) -> tuple[TensorSpec, ...]:
    view = memoryview(raw)
    if len(view) < _COUNT.size:
        raise FrameError(f"a tensor frame's extension of {len(view)} bytes has no tensor count")
    (count,) = _COUNT.unpack_from(view)
    if count > limits.max_tensors:
        raise FrameError(f"{count} tensors in one frame, past the agreed {limits.max_tensors}")
    at, specs, total = _COUNT.size, [], 0
    for _ in range(count):
        if at + _SPEC.size > len(view):
            raise FrameError("the extension ends inside a tensor's descriptor")
        code, dims = _SPEC.unpack_from(view, at)
        at += _SPEC.size
        dtype = DTYPES.get(code)
        if dtype is None:
            raise FrameError(f"unknown dtype code {code}")
        if dims > limits.max_dims or at + dims * _DIM.size > len(view):
            raise FrameError(f"a descriptor of {dims} dimensions does not fit the extension or the agreed "
                             f"{limits.max_dims}")
        shape = tuple(_DIM.unpack_from(view, at + n * _DIM.size)[0] for n in range(dims))
        at += dims * _DIM.size
        if any(size >= 1 << 62 for size in shape):
            raise FrameError(f"a dimension past 2**62 in shape {shape}")
        # Checked one by one, so that a huge dimension cannot make a huge number of elements.
        elements = 1
        for size in shape:
            elements *= size
            if elements > payload:
                break
        spec = TensorSpec(dtype, shape)
        total += spec.nbytes if elements <= payload else payload + 1
        if total > payload:
            raise FrameError(f"the descriptors need more than the {payload} bytes of the payload")
        specs.append(spec)
    if at != len(view):
        raise FrameError(f"{len(view) - at} bytes left over after the tensors' descriptors")
    if total != payload:
        raise FrameError(f"the descriptors account for {total} bytes of a {payload}-byte payload")
    return tuple(specs)
