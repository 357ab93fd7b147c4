"""PowerSGD (Vogels et al., 2019): rank-r gradient compression by one power-iteration step, warm-started."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from replicator.sync.bucket import Bucket
from replicator.sync.reducers._summation import Summation
from replicator.sync.reducers._worker import BucketReducer

__all__ = ["PowerSGDReducer"]


@dataclass
class _Matrix:
    """One parameter's gradient seen as a rows x cols matrix, and its running Q."""

    position: int
    start: int
    rows: int
    cols: int
    rank: int
    q: torch.Tensor  # cols x rank, identical on every replica


@dataclass
class _BucketState:
    matrices: list[_Matrix]
    plain: list[tuple[int, int]]  # (start, length) of the gradients sent uncompressed
    plain_numel: int
    p_numel: int
    q_numel: int
    residual: torch.Tensor | None = None


class PowerSGDReducer(BucketReducer):
    """Sends each large gradient matrix M (a parameter's gradient reshaped to
    shape[0] x rest) as two thin factors, P = M Q and Q' = M^T orth(P), both summed.

    The bucket's sum is then approximated by orth(P_sum) Q'_sum^T. One-dimensional
    gradients, and matrices too small to gain from rank `rank`, are summed exactly, and so
    are the presence slots (they ride with P). Two messages per bucket: [exact part | P |
    presence], then [Q'].

    Error feedback (on by default): each replica keeps what the approximation misses of
    its own M, (I - B B^T) M with B = orth(P_sum), and adds it to its next gradient of that
    bucket; over the replicas these add up exactly to what compression has not yet
    delivered, so nothing is lost, only late. Warm start: Q'_sum seeds the next step's power
    iteration, which then tracks the gradients' leading subspace across steps. State is kept
    per bucket (by identity).
    """

    def __init__(self, summation: Summation, rank: int, error_feedback: bool = True) -> None:
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be at least 1, got {rank}")
        self.summation = summation
        self.rank = rank
        self.error_feedback = error_feedback
        topology = "" if summation.name == "flat" else "@" + summation.name
        self.name = f"powersgd:{rank}" + ("" if error_feedback else "+noef") + topology
        super().__init__(self.name, summation.size)
        self._states: weakref.WeakKeyDictionary[Bucket, _BucketState] = weakref.WeakKeyDictionary()

    def residual(self, bucket: Bucket) -> torch.Tensor | None:
        """What this replica still owes to the sum of `bucket` (None before its first reduction)."""
        state = self._states.get(bucket)
        return None if state is None else state.residual

    def wire_numel(self, bucket: Bucket) -> int:
        """Elements this reducer sends for `bucket` per round (the bucket sends numel + slots uncompressed)."""
        state = self._state(bucket)
        return state.plain_numel + state.p_numel + len(bucket.params) + state.q_numel

    def _state(self, bucket: Bucket) -> _BucketState:
        state = self._states.get(bucket)
        if state is None:
            state = self._plan(bucket)
            self._states[bucket] = state
        return state

    def _plan(self, bucket: Bucket) -> _BucketState:
        matrices: list[_Matrix] = []
        plain: list[tuple[int, int]] = []
        for position, param in enumerate(bucket.params):
            start, numel = bucket.offsets[position], param.numel()
            if param.dim() >= 2:
                rows = param.shape[0]
                cols = numel // rows
                rank = min(self.rank, rows, cols)
                # Compress only where the factors are smaller than the matrix.
                if (rows + cols) * rank < rows * cols:
                    q = self._random_q(bucket, position, cols, rank, bucket.buffer)
                    matrices.append(_Matrix(position, start, rows, cols, rank, q))
                    continue
            if plain and plain[-1][0] + plain[-1][1] == start:
                plain[-1] = (plain[-1][0], plain[-1][1] + numel)  # neighbours travel as one slice
            else:
                plain.append((start, numel))
        return _BucketState(matrices, plain, sum(n for _, n in plain), sum(m.rows * m.rank for m in matrices),
                            sum(m.cols * m.rank for m in matrices))

    def _random_q(self, bucket: Bucket, position: int, cols: int, rank: int, like: torch.Tensor) -> torch.Tensor:
        # Seeded by place, not by rank of the process: every replica must start from the same Q.
        generator = torch.Generator().manual_seed((bucket.index * 1_000_003 + position) * 1_000_003)
        q = torch.randn(cols, rank, generator=generator, dtype=torch.float32)
        return q.to(device=like.device, dtype=like.dtype)

    def _reduce(self, buffer: torch.Tensor, bucket: Bucket) -> None:
        state = self._state(bucket)
        numel = bucket.numel
        grads, presence = buffer[:numel], buffer[numel:]
        if self.error_feedback:
            compensated = grads.clone() if state.residual is None else grads + state.residual
        else:
            compensated = grads  # read only before the approximation overwrites it

        first = torch.empty(state.plain_numel + state.p_numel + presence.numel(), dtype=buffer.dtype,
                            device=buffer.device)
        offset = 0
        for start, length in state.plain:
            first[offset : offset + length].copy_(compensated[start : start + length])
            offset += length
        ps = []
        for m in state.matrices:
            p = first[offset : offset + m.rows * m.rank].view(m.rows, m.rank)
            torch.matmul(self._matrix(compensated, m), m.q, out=p)
            ps.append(p)
            offset += m.rows * m.rank
        first[offset:].copy_(presence)
        self.summation.sum_(first)

        offset = 0
        for start, length in state.plain:
            grads[start : start + length].copy_(first[offset : offset + length])
            offset += length
        presence.copy_(first[state.plain_numel + state.p_numel :])
        counts = presence.tolist()

        second = torch.empty(state.q_numel, dtype=buffer.dtype, device=buffer.device)
        offset = 0
        bases, qs = [], []
        for m, p in zip(state.matrices, ps):
            # P_sum is identical on every replica, and so is its orthonormal basis.
            basis = torch.linalg.qr(p).Q if m.rank > 1 else p / p.norm().clamp_min(torch.finfo(p.dtype).tiny)
            q = second[offset : offset + m.cols * m.rank].view(m.cols, m.rank)
            matrix = self._matrix(compensated, m)
            torch.matmul(matrix.t(), basis, out=q)
            if self.error_feedback and counts[m.position] > 0:
                # Owe what the basis misses of this replica's M. Summed over replicas that is
                # exactly sum(M) - approximation, as with the paper's M - approximation / replicas,
                # but it stays as small as M instead of accumulating how replicas differ.
                # (A parameter nobody produced keeps all of M: the synchronizer drops its sum.)
                matrix.addmm_(basis, q.t(), alpha=-1.0)
            bases.append(basis)
            qs.append(q)
            offset += m.cols * m.rank
        if state.matrices:
            self.summation.sum_(second)

        for m, basis, q in zip(state.matrices, bases, qs):
            torch.matmul(basis, q.t(), out=self._matrix(grads, m))
            if counts[m.position] > 0:  # warm start: Q'_sum seeds the next round's power iteration
                m.q = q.clone()
        if self.error_feedback:
            for start, length in state.plain:
                compensated[start : start + length].zero_()  # summed exactly: nothing owed
            state.residual = compensated

    @staticmethod
    def _matrix(flat: torch.Tensor, m: _Matrix) -> torch.Tensor:
        return flat[m.start : m.start + m.rows * m.cols].view(m.rows, m.cols)
