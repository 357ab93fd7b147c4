"""Point-to-point messages between neighbouring stages: a small header, then the tensors.

Every transfer starts with a fixed-size int64 header: the kind of message, the micro-batch
it belongs to, that micro-batch's size and the mini-batch size, and the structure of the
value (nesting of tuples, lists and dicts; each tensor's dtype, shape and whether it
needs a gradient). The receiver allocates from the header, so shapes may change from step
to step without a dry run. A header longer than the fixed size continues in a second
message. An *abort* message carries an error text instead of a value: it lets a stage
that failed keep its side of the schedule, so its neighbours learn of the failure instead
of waiting forever.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "HEADER_SLOTS",
    "Message",
    "StructureError",
    "encode_structure",
    "decode_structure",
    "fill_structure",
    "send_value",
    "send_abort",
    "recv_message",
]

HEADER_SLOTS = 64
_MAX_ERROR_BYTES = 2000

_KIND_DATA = 1
_KIND_ABORT = 2
# Header layout: kind, micro-batch, micro-batch size, mini-batch size, total length, body...
_PREFIX = 5

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

    @property
    def is_abort(self) -> bool:
        return self.error is not None


def encode_structure(value: Any, path: str = "output", allow_none: bool = False) -> tuple[list[int], list[torch.Tensor]]:
    """Header codes describing `value` and its tensors in order. Raises StructureError on anything else."""
    codes: list[int] = []
    tensors: list[torch.Tensor] = []

    def visit(item: Any, where: str) -> None:
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
                visit(sub, f"{where}[{k}]")
        elif isinstance(item, dict):
            codes.extend([_DICT, len(item)])
            for key, sub in item.items():
                if not isinstance(key, str):
                    raise StructureError(f"{where} has the key {key!r}; dicts sent between stages need string keys")
                raw = key.encode("utf-8")
                codes.extend([len(raw), *raw])
                visit(sub, f"{where}[{key!r}]")
        elif item is None and allow_none:
            codes.append(_NONE)
        else:
            raise StructureError(
                f"{where} is a {type(item).__name__}; a stage that is not the last must return a tensor or a "
                "tuple, list or dict of tensors (other values cannot be sent to the next stage)"
            )

    visit(value, path)
    return codes, tensors


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    requires_grad: bool


def decode_structure(codes: list[int]) -> tuple[Any, list[TensorSpec]]:
    """The skeleton of a value (tensor positions as ints) and the spec of each tensor."""
    specs: list[TensorSpec] = []
    position = 0

    def take() -> int:
        nonlocal position
        position += 1
        return codes[position - 1]

    def visit() -> Any:
        code = take()
        if code == _TENSOR:
            dtype, requires_grad, ndim = _DTYPES[take()], bool(take()), take()
            specs.append(TensorSpec(dtype, tuple(take() for _ in range(ndim)), requires_grad))
            return ("tensor", len(specs) - 1)
        if code in (_TUPLE, _LIST):
            n = take()
            return ("tuple" if code == _TUPLE else "list", [visit() for _ in range(n)])
        if code == _DICT:
            n = take()
            items = []
            for _ in range(n):
                length = take()
                key = bytes(take() for _ in range(length)).decode("utf-8")
                items.append((key, visit()))
            return ("dict", items)
        if code == _NONE:
            return ("none", None)
        raise ValueError(f"corrupt pipeline header (structure code {code}); are both stages running the same version?")

    skeleton = visit()
    return skeleton, specs


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


Pending = list[tuple[Any, Any]]  # (work, what must stay alive until it completes)


def _isend(tensor: torch.Tensor, peer: int, group: dist.ProcessGroup, pending: Pending) -> None:
    work = dist.isend(tensor, dst=peer, group=group)
    pending.append((work, tensor))


def _send_header(codes: list[int], peer: int, group: dist.ProcessGroup, device: torch.device, pending: Pending) -> None:
    header = torch.zeros(max(HEADER_SLOTS, len(codes)), dtype=torch.int64)
    header[: len(codes)] = torch.tensor(codes, dtype=torch.int64)
    header = header.to(device)
    _isend(header[:HEADER_SLOTS], peer, group, pending)
    if len(codes) > HEADER_SLOTS:
        _isend(header[HEADER_SLOTS:].contiguous(), peer, group, pending)


def send_value(
    value: Any,
    *,
    microbatch: int,
    microbatch_size: int,
    batch_size: int,
    peer: int,
    group: dist.ProcessGroup,
    device: torch.device,
    pending: Pending,
    allow_none: bool = False,
) -> None:
    """Start sending `value` to global rank `peer`; the works are appended to `pending`."""
    body, tensors = encode_structure(value, allow_none=allow_none)
    codes = [_KIND_DATA, microbatch, microbatch_size, batch_size, _PREFIX + len(body), *body]
    _send_header(codes, peer, group, device, pending)
    for tensor in tensors:
        _isend(tensor.detach().contiguous(), peer, group, pending)


def send_abort(error: str, *, microbatch: int, peer: int, group: dist.ProcessGroup, device: torch.device, pending: Pending) -> None:
    """Tell `peer` that this micro-batch will not come because a stage failed (with why)."""
    raw = error.encode("utf-8")[:_MAX_ERROR_BYTES]
    codes = [_KIND_ABORT, microbatch, 0, 0, _PREFIX + len(raw), *raw]
    _send_header(codes, peer, group, device, pending)


def recv_message(peer: int, group: dist.ProcessGroup, device: torch.device) -> Message:
    """Receive one message from global rank `peer` (blocking), allocating from its header."""
    header = torch.empty(HEADER_SLOTS, dtype=torch.int64, device=device)
    dist.irecv(header, src=peer, group=group).wait()
    codes = header.tolist()
    kind, microbatch, microbatch_size, batch_size, length = codes[:_PREFIX]
    if length > HEADER_SLOTS:
        rest = torch.empty(length - HEADER_SLOTS, dtype=torch.int64, device=device)
        dist.irecv(rest, src=peer, group=group).wait()
        codes += rest.tolist()
    body = codes[_PREFIX:length]
    if kind == _KIND_ABORT:
        text = bytes(body).decode("utf-8", errors="replace")
        return Message(microbatch, microbatch_size, batch_size, error=text)
    if kind != _KIND_DATA:
        raise RuntimeError(f"corrupt pipeline header from rank {peer} (kind {kind}); are both stages running the same schedule?")
    skeleton, specs = decode_structure(body)
    tensors = [torch.empty(spec.shape, dtype=spec.dtype, device=device) for spec in specs]
    works = [dist.irecv(tensor, src=peer, group=group) for tensor in tensors]
    for work in works:
        work.wait()
    for tensor, spec in zip(tensors, specs):
        if spec.requires_grad:
            tensor.requires_grad_(True)
    return Message(microbatch, microbatch_size, batch_size, value=fill_structure(skeleton, tensors))
