"""Point-to-point messages between neighbouring stages: header and tensors packed in one buffer."""

from __future__ import annotations

import struct
from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

__all__ = [
    "FIRST_BYTES",
    "Link",
    "Message",
    "StructureError",
    "encode_structure",
    "decode_structure",
    "fill_structure",
]

FIRST_BYTES = 512  # the first message of a key; at least the header prefix
# A transfer's remainder travels under its own tag, so that it cannot meet a receive the
# peer posted ahead for its next transfer (where the backend honours tags: Gloo does).
_REMAINDER_TAG = 1
_ALIGN = 64  # tensor offsets in a message: enough for any dtype and vectorised kernels
_MAX_ERROR_BYTES = 2000

_KIND_DATA = 1
_KIND_ABORT = 2
# A message is one uint8 buffer: an int64 header, then each tensor's bytes at an aligned
# offset. The header is a prefix (kind, micro-batch, micro-batch size, mini-batch size,
# number of structure codes, total bytes, bytes of the first message, has a loss, the loss
# as float64 bits) and the structure codes of the value (nesting of tuples, lists and dicts;
# each tensor's dtype, shape and whether it needs a gradient), or an abort's text, one byte
# per code. The receiver rebuilds the tensors from the header, so shapes may change from
# step to step without a dry run.
_PREFIX = 9
_PREFIX_BYTES = 8 * _PREFIX

_TENSOR, _TUPLE, _LIST, _DICT, _NONE = 1, 2, 3, 4, 5

_DTYPES: list[torch.dtype] = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


class StructureError(TypeError):
    """A value cannot travel between stages: only tensors and tuples, lists and dicts of them can."""


@dataclass
class Message:
    """A received message: a value (data) or the text of a failure upstream or downstream (abort)."""

    microbatch: int
    microbatch_size: int
    batch_size: int
    value: Any = None
    error: str | None = None
    loss: float | None = None  # the mini-batch loss, relayed towards the first stage

    @property
    def is_abort(self) -> bool:
        return self.error is not None


def encode_structure(
    value: Any, path: str = "output", allow_none: bool = False
) -> tuple[list[int], list[torch.Tensor]]:
    """Header codes describing `value` and its tensors in order. Raises StructureError on anything else."""
    codes: list[int] = []
    tensors: list[torch.Tensor] = []
    _encode(value, path, allow_none, codes, tensors)
    return codes, tensors


def _encode(item: Any, where: str, allow_none: bool, codes: list[int], tensors: list[torch.Tensor]) -> None:
    # A module-level function, not a closure that calls itself: such a closure is a
    # reference cycle, which would keep the sent tensors alive until the garbage collector
    # runs.
    if isinstance(item, torch.Tensor):
        if item.dtype not in _DTYPE_CODE:
            raise StructureError(f"{where} has dtype {item.dtype}, which cannot be sent between stages")
        if item.is_sparse or item.layout != torch.strided:
            raise StructureError(f"{where} is a {item.layout} tensor; only dense tensors can be sent between stages")
        codes.extend([_TENSOR, _DTYPE_CODE[item.dtype], int(item.requires_grad), item.dim(), *item.shape])
        tensors.append(item)
    elif isinstance(item, (tuple, list)):
        if isinstance(item, tuple) and hasattr(item, "_fields"):
            raise StructureError(f"{where} is a namedtuple ({type(item).__name__}); send a plain tuple or a dict")
        codes.extend([_TUPLE if isinstance(item, tuple) else _LIST, len(item)])
        for k, sub in enumerate(item):
            _encode(sub, f"{where}[{k}]", allow_none, codes, tensors)
    elif isinstance(item, dict):
        codes.extend([_DICT, len(item)])
        for key, sub in item.items():
            if not isinstance(key, str):
                raise StructureError(f"{where} has the key {key!r}; dicts sent between stages need string keys")
            raw = key.encode("utf-8")
            codes.extend([len(raw), *raw])
            _encode(sub, f"{where}[{key!r}]", allow_none, codes, tensors)
    elif item is None and allow_none:
        codes.append(_NONE)
    else:
        raise StructureError(
            f"{where} is a {type(item).__name__}; a stage that is not the last must return a tensor or a "
            "tuple, list or dict of tensors (other values cannot be sent to the next stage)"
        )


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


def decode_structure(codes: list[int]) -> tuple[Any, list[TensorSpec]]:
    """The skeleton of a value (tensor positions as ints) and the spec of each tensor."""
    specs: list[TensorSpec] = []
    skeleton, _ = _decode(codes, 0, specs)
    return skeleton, specs


def _decode(codes: list[int], position: int, specs: list[TensorSpec]) -> tuple[Any, int]:
    """The skeleton of the value whose codes start at `position`, and the position after them."""
    code = codes[position]
    position += 1
    if code == _TENSOR:
        dtype, requires_grad, ndim = _DTYPES[codes[position]], bool(codes[position + 1]), codes[position + 2]
        position += 3
        specs.append(TensorSpec(dtype, tuple(codes[position:position + ndim]), requires_grad))
        return ("tensor", len(specs) - 1), position + ndim
    if code in (_TUPLE, _LIST):
        n, position = codes[position], position + 1
        items = []
        for _ in range(n):
            item, position = _decode(codes, position, specs)
            items.append(item)
        return ("tuple" if code == _TUPLE else "list", items), position
    if code == _DICT:
        n, position = codes[position], position + 1
        entries = []
        for _ in range(n):
            length = codes[position]
            key = bytes(codes[position + 1:position + 1 + length]).decode("utf-8")
            value, position = _decode(codes, position + 1 + length, specs)
            entries.append((key, value))
        return ("dict", entries), position
    if code == _NONE:
        return ("none", None), position
    raise ValueError(f"corrupt pipeline header (structure code {code}); are both stages running the same version?")


def fill_structure(skeleton: Any, tensors: list[torch.Tensor | None]) -> Any:
    """Rebuild the value a skeleton describes from its received tensors."""
    kind, content = skeleton
    if kind == "tensor":
        return tensors[content]
    if kind == "tuple":
        return tuple(fill_structure(s, tensors) for s in content)
    if kind == "list":
        return [fill_structure(s, tensors) for s in content]
    if kind == "dict":
        return {key: fill_structure(s, tensors) for key, s in content}
    return None


def _align(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def _layout(n_codes: int, specs: list[tuple[torch.dtype, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Each tensor's byte offset in a message with `n_codes` structure codes, and the message's length."""
    offsets = []
    end = _PREFIX_BYTES + 8 * n_codes
    for dtype, shape in specs:
        offsets.append(_align(end))
        numel = 1
        for size in shape:
            numel *= size
        end = offsets[-1] + numel * _itemsize(dtype)
    return offsets, end


_ITEMSIZE: dict[torch.dtype, int] = {}


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


def _tensor_at(buffer: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor over `buffer`'s bytes at `offset`.

    Not a view: it shares the storage but not the version counter, so an in-place change
    to one received tensor cannot invalidate what autograd saved of another one.
    """
    tensor = torch.empty(0, dtype=dtype, device=buffer.device)
    return tensor.set_(buffer.untyped_storage(), offset // _itemsize(dtype), shape, _contiguous_strides(shape))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of `shape` (an empty dimension counts as 1)."""
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


class Link:
    """Messages in one direction between this process and global rank `peer`, one per transfer.

    A receive must be posted with the message's size before the message arrives (NCCL
    needs the exact size; Gloo accepts a shorter message but ends the process on a longer
    one). So both ends remember the size of the last message of each *key* (the stage
    uses the step kind, the direction and the micro-batch): the next message of that key
    is first sent as exactly that many bytes, padded when it is shorter, and what does not
    fit follows in a second message whose size the header gives. In steady state every
    transfer is one message, one rendezvous; a new key or a grown shape costs a second
    message once; a key's first message is FIRST_BYTES long. An *abort* message carries an
    error text instead of a value, so that a stage that failed can keep its side of the
    schedule and its neighbours learn of the failure instead of waiting forever.

    Use one Link per peer and direction on each end. Both ends must exchange the same
    sequence of keys (they do when they run the same schedule). A sent message's buffer
    stays alive until `settle` or `settle_all` has waited for its send: Gloo reports a
    send complete only once it is waited for.

    Receives may be posted ahead (`post_recv`), in the order they will be received, so
    that a message arrives while this process computes; `recv` then only waits. Only where
    the backend keeps tags apart (`posts_ahead`, Gloo): elsewhere a remainder could meet a
    receive posted for the next transfer, and `post_recv` does nothing.
    """

    def __init__(self, peer: int, group: dist.ProcessGroup, device: torch.device) -> None:
        self.peer = peer
        self.group = group
        self.device = device
        self.sizes: dict[Hashable, int] = {}  # the last total length of each key
        self.messages = 0  # point-to-point messages posted on this link (both kinds of end)
        self.sent = 0  # transfers sent so far (a transfer is one or two messages)
        self._in_flight: deque[tuple[int, list[Any], torch.Tensor]] = deque()  # (transfer, works, buffer)
        self._posted: deque[tuple[Hashable, torch.Tensor, dist.Work]] = deque()  # receives posted ahead, in order
        self.posts_ahead = dist.get_backend(group) == "gloo"

    def _first_bytes(self, key: Hashable) -> int:
        return self.sizes.get(key, FIRST_BYTES)

    def _send(self, key: Hashable, prefix: list[int], codes: list[int], tensors: list[torch.Tensor]) -> None:
        offsets, total = _layout(len(codes), [(t.dtype, tuple(t.shape)) for t in tensors])
        first = self._first_bytes(key)
        prefix[5], prefix[6] = total, first
        header_end = _PREFIX_BYTES + 8 * len(codes)
        buffer = torch.empty(max(total, first), dtype=torch.uint8, device=self.device)
        if buffer.device.type == "cpu":  # numpy writes the header without building a tensor first
            buffer[:header_end].numpy().view(np.int64)[:] = prefix + codes
        else:
            buffer[:header_end].view(torch.int64).copy_(torch.tensor(prefix + codes, dtype=torch.int64))
        end = header_end
        for tensor, offset in zip(tensors, offsets):
            if offset > end:
                buffer[end:offset].zero_()  # deterministic bytes on the wire
            _tensor_at(buffer, offset, tensor.dtype, tuple(tensor.shape)).copy_(tensor.detach())
            end = offset + tensor.numel() * tensor.element_size()
        if first > total:
            buffer[total:].zero_()
        works = [dist.isend(buffer[:first], dst=self.peer, group=self.group)]
        if total > first:
            works.append(dist.isend(buffer[first:], dst=self.peer, group=self.group, tag=_REMAINDER_TAG))
        self.messages += len(works)
        self._in_flight.append((self.sent, works, buffer))
        self.sent += 1
        self.sizes[key] = total

    def settle(self, through: int) -> None:
        """Wait for the sends of transfers 0 ... through - 1 and let go of their buffers.

        Call it for transfers the peer has received (it has answered after them), so that
        waiting costs nothing.
        """
        while self._in_flight and self._in_flight[0][0] < through:
            for work in self._in_flight.popleft()[1]:
                work.wait()

    def settle_all(self) -> None:
        """Wait for every send still in flight."""
        self.settle(self.sent)

    def send(self, key: Hashable, value: Any, *, microbatch: int, microbatch_size: int, batch_size: int,
             allow_none: bool = False, loss: float | None = None) -> None:
        """Start sending `value` (and optionally the mini-batch loss)."""
        body, tensors = encode_structure(value, allow_none=allow_none)
        prefix = [_KIND_DATA, microbatch, microbatch_size, batch_size, len(body), 0, 0,
                  int(loss is not None), _float_bits(loss) if loss is not None else 0]
        self._send(key, prefix, body, tensors)

    def send_abort(self, key: Hashable, error: str, *, microbatch: int) -> None:
        """Send, in place of the message of `key`, the text of the failure that stopped this step."""
        raw = list(error.encode("utf-8")[:_MAX_ERROR_BYTES])
        self._send(key, [_KIND_ABORT, microbatch, 0, 0, len(raw), 0, 0, 0, 0], raw, [])

    def post_recv(self, key: Hashable) -> None:
        """Post the receive of a coming message of `key` now, after those posted before (where `posts_ahead`)."""
        if self.posts_ahead:
            self._post(key)

    def _post(self, key: Hashable) -> None:
        buffer = torch.empty(self._first_bytes(key), dtype=torch.uint8, device=self.device)
        self._posted.append((key, buffer, _started(dist.irecv(buffer, src=self.peer, group=self.group))))
        self.messages += 1

    def recv(self, key: Hashable) -> Message:
        """Receive the next message, of `key` (blocking; posted now unless `post_recv` posted it).

        Its tensors lie in the one received buffer, without a copy, but are not views of
        it (see _tensor_at). A sender that disagrees on the size of the first message
        raises here when its message is shorter; when it is longer, Gloo ends this process
        (it cannot deliver part of a message), which is why both ends must follow the same
        schedule.
        """
        if not self._posted:
            self._post(key)
        posted, buffer, work = self._posted.popleft()
        if posted != key:
            raise RuntimeError(f"the receive of {posted!r} was posted before that of {key!r}: post receives in the "
                               "order they are received")
        first = buffer.numel()
        work.wait()
        prefix = buffer[:_PREFIX_BYTES].view(torch.int64).tolist()
        kind, microbatch, microbatch_size, batch_size, n_codes, total, sent_first, has_loss, loss_bits = prefix
        if kind not in (_KIND_DATA, _KIND_ABORT):
            raise RuntimeError(f"corrupt pipeline header from rank {self.peer} (kind {kind}); are both stages running "
                               "the same version?")
        if sent_first != first:
            raise RuntimeError(
                f"rank {self.peer} sent a message of {sent_first} bytes where {first} were expected: the two stages "
                "exchange different sequences of messages (are they running the same schedule and chunks?)"
            )
        if total > first:
            whole = torch.empty(total, dtype=torch.uint8, device=self.device)
            whole[:first].copy_(buffer)
            _started(dist.irecv(whole[first:], src=self.peer, group=self.group, tag=_REMAINDER_TAG)).wait()
            self.messages += 1
            buffer = whole
        self.sizes[key] = total
        codes = buffer[_PREFIX_BYTES:_PREFIX_BYTES + 8 * n_codes].view(torch.int64).tolist()
        if kind == _KIND_ABORT:
            text = bytes(codes).decode("utf-8", errors="replace")
            return Message(microbatch, microbatch_size, batch_size, error=text)
        skeleton, specs = decode_structure(codes)
        offsets, _ = _layout(n_codes, [(spec.dtype, spec.shape) for spec in specs])
        tensors: list[torch.Tensor | None] = []
        for spec, offset in zip(specs, offsets):
            tensor = _tensor_at(buffer, offset, spec.dtype, spec.shape)
            if spec.requires_grad:
                tensor.requires_grad_(True)
            tensors.append(tensor)
        return Message(microbatch, microbatch_size, batch_size, value=fill_structure(skeleton, tensors),
                       loss=_bits_float(loss_bits) if has_loss else None)


def _started(work: dist.Work | None) -> dist.Work:
    """The work of a point-to-point operation (torch types it optional; it is None only for coalesced ops)."""
    assert work is not None, "torch.distributed returned no work for a point-to-point receive"
    return work
