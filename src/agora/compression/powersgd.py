"""PowerSGD gradient averaging (Vogels et al. 2019) split into the steps that fit around two all-reduces.

Why: a dense all-reduce moves ``n*m`` numbers per matrix, rank-``r`` PowerSGD ``r*(n+m)``. With error feedback
(what the low-rank approximation missed is added to the next gradient) the applied updates track the true
gradients, so training converges at low rank. A round all-reduces ``P = (G + E) Q`` (phase 1, with the tensors not
worth compressing), orthogonalizes it canonically, then all-reduces ``Q = M^T P^`` (phase 2); ``Q`` is seeded, never
sent. If both phases run over the same group, every replica computes the same update.

:meth:`PowerSGD.run_round` does a whole round given an all-reduce; ``agora.server.averaging.powersgd`` drives the
steps across processes (with ``agora.server.averaging.allreduce.PowerSGDAverager``). The round step by step and the
rules for wiring it in: docs/COMPRESSION.md.
"""

from __future__ import annotations

import math
from typing import Awaitable, Callable, List, Optional, Sequence, Tuple

import torch

from agora.compression.seeding import generator

__all__ = ["PowerSGD", "orthogonalize"]

AllReduce = Callable[[List[torch.Tensor]], Awaitable[List[torch.Tensor]]]


def orthogonalize(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of ``p``'s columns: reduced QR in float64 with the sign fix ``diag(R) >= 0``.

    QR is unique up to column signs; fixing them makes the result a function of ``p`` alone, so replicas holding
    the same averaged ``P`` derive the same ``P^``. Float64 keeps cross-library rounding differences far below the
    precision of the float32 result.
    """
    q, r = torch.linalg.qr(p.double(), mode="reduced")
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return (q * signs).to(p.dtype)


class PowerSGD:
    """Rank-``rank`` PowerSGD with error feedback over a fixed list of gradient shapes.

    :param shapes: shapes of the gradients, in the order every call will pass them
    :param rank: target rank (capped per tensor at ``min(n, m)``)
    :param run_id: part of the seed of Q (with ``stage``, the step and the tensor index)
    :param min_compression: compress a tensor only if ``n*m >= min_compression * r*(n+m)``
    :param warm_start: start from the last averaged Q of this tensor instead of a fresh seeded one
    """

    def __init__(
        self,
        shapes: Sequence[Sequence[int]],
        rank: int,
        *,
        run_id: str,
        stage: int,
        min_compression: float = 2.0,
        warm_start: bool = False,
    ):
        if rank < 1:
            raise ValueError(f"rank must be >= 1, got {rank}")
        self.shapes = [torch.Size(s) for s in shapes]
        self.rank, self.run_id, self.stage, self.warm_start = rank, run_id, stage, warm_start
        self.compressed: List[int] = []  # indices into shapes
        self.passthrough: List[int] = []
        self._dims: dict = {}  # index -> (n, m, r)
        for i, shape in enumerate(self.shapes):
            if len(shape) >= 2:
                n, m = shape[0], math.prod(shape[1:])
                r = min(rank, n, m)
                if n * m >= min_compression * r * (n + m):
                    self.compressed.append(i)
                    self._dims[i] = (n, m, r)
                    continue
            self.passthrough.append(i)
        self.errors: List[Optional[torch.Tensor]] = [None] * len(self.compressed)
        self._last_q: List[Optional[torch.Tensor]] = [None] * len(self.compressed)
        self._m: Optional[List[torch.Tensor]] = None  # M = G + E of the round in progress

    # ---------------------------------------------------------------------------------------- shapes and sizes
    def p_shapes(self) -> List[Tuple[int, int]]:
        return [(self._dims[i][0], self._dims[i][2]) for i in self.compressed]

    def q_shapes(self) -> List[Tuple[int, int]]:
        return [(self._dims[i][1], self._dims[i][2]) for i in self.compressed]

    def passthrough_shapes(self) -> List[torch.Size]:
        return [self.shapes[i] for i in self.passthrough]

    def numel_sent(self) -> int:
        """Elements each replica contributes per round (phase 1 + phase 2), against ``sum(numel)`` for a full one."""
        return (sum(n * r + m * r for n, m, r in self._dims.values())
                + sum(self.shapes[i].numel() for i in self.passthrough))

    # ---------------------------------------------------------------------------------------- the steps
    def initial_q(self, step: int, dtype: torch.dtype = torch.float32,
                  device: Optional[torch.device] = None) -> List[torch.Tensor]:
        """The seeded Q of every compressed tensor for ``step``: identical on every replica of (run, stage)."""
        out = []
        for j, i in enumerate(self.compressed):
            _, m, r = self._dims[i]
            q = torch.randn(m, r, generator=generator("powersgd", self.run_id, self.stage, step, i))
            out.append(q.to(device=device, dtype=dtype))
        return out

    def compress_p(self, grads: Sequence[torch.Tensor], step: int) -> List[torch.Tensor]:
        """``P = (G + E) @ Q`` for every compressed tensor (phase-1 payload, with :meth:`passthrough_tensors`)."""
        if len(grads) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} gradients, got {len(grads)}")
        dtype = torch.promote_types(grads[self.compressed[0]].dtype, torch.float32) if self.compressed else None
        fresh = self.initial_q(step, dtype, grads[0].device) if self.compressed else []
        self._m, ps = [], []
        for j, i in enumerate(self.compressed):
            n, m, _ = self._dims[i]
            g = grads[i]
            if g.shape != self.shapes[i]:
                raise ValueError(f"gradient {i} has shape {tuple(g.shape)}, expected {tuple(self.shapes[i])}")
            mat = g.detach().reshape(n, m).to(dtype)
            # never keep a view of the caller's gradient: it may be zeroed or accumulated into later
            mat = mat + self.errors[j] if self.errors[j] is not None else mat.clone()
            self._m.append(mat)
            q = self._last_q[j] if self.warm_start and self._last_q[j] is not None else fresh[j]
            ps.append(mat @ q.to(mat.dtype))
        return ps

    def passthrough_tensors(self, grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """The gradients averaged in full (1-d or incompressible), to all-reduce alongside P in phase 1."""
        return [grads[i] for i in self.passthrough]

    def orthogonalize(self, p_avg: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """``P^`` from the averaged P (canonical, see :func:`orthogonalize`)."""
        return [orthogonalize(p) for p in p_avg]

    def compute_q(self, p_hat: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """``Q = M^T @ P^`` (phase-2 payload)."""
        if self._m is None:
            raise RuntimeError("compute_q() before compress_p()")
        return [mat.T @ ph.to(mat.dtype) for mat, ph in zip(self._m, p_hat)]

    def decompress(self, p_hat: Sequence[torch.Tensor], q_avg: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """``update = P^ @ Q_avg^T`` reshaped like the gradients; updates the error buffers ``E = M - update``."""
        if self._m is None:
            raise RuntimeError("decompress() before compress_p()")
        out = []
        for j, i in enumerate(self.compressed):
            mat = self._m[j]
            approx = p_hat[j].to(mat.dtype) @ q_avg[j].to(mat.dtype).T
            self.errors[j] = mat - approx
            if self.warm_start:
                self._last_q[j] = q_avg[j].detach().clone()
            out.append(approx.reshape(self.shapes[i]))
        self._m = None
        return out

    def assemble(self, updates: Sequence[torch.Tensor], passthrough_avg: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """Merge decompressed and passthrough tensors back into the order of ``shapes``."""
        out: List[Optional[torch.Tensor]] = [None] * len(self.shapes)
        for i, u in zip(self.compressed, updates):
            out[i] = u
        for i, t in zip(self.passthrough, passthrough_avg):
            out[i] = t
        return out  # type: ignore[return-value]

    def matrices(self) -> List[torch.Tensor]:
        """``M = G + E`` of the round in progress (one n x m matrix per compressed tensor), for an averager that
        computes ``Q = M^T P^`` in another process; do not modify them."""
        if self._m is None:
            raise RuntimeError("matrices() before compress_p()")
        return list(self._m)

    def flush(self, grads: Sequence[torch.Tensor]) -> List[torch.Tensor]:
        """``G + E`` for every gradient, emptying the error buffers: what a replica applies when it steps alone.

        Without a group there is nothing to compress for, and keeping the error for a later round would only
        delay it; applying it now is what rank-unlimited averaging over a group of one would do.
        """
        if len(grads) != len(self.shapes):
            raise ValueError(f"expected {len(self.shapes)} gradients, got {len(grads)}")
        out = list(grads)
        for j, i in enumerate(self.compressed):
            if self.errors[j] is not None:
                out[i] = grads[i] + self.errors[j].reshape(self.shapes[i]).to(grads[i].dtype)
                self.errors[j] = None
        self._m = None
        return out

    def abort(self) -> None:
        """The round failed after :meth:`compress_p`: nothing was applied, so all of ``M`` stays in the error."""
        if self._m is not None:
            for j, mat in enumerate(self._m):
                self.errors[j] = mat
            self._m = None

    def reset(self) -> None:
        """Forget error buffers and warm-start state (after a state download or a rejoin)."""
        self.errors = [None] * len(self.compressed)
        self._last_q = [None] * len(self.compressed)
        self._m = None

    async def run_round(self, grads: Sequence[torch.Tensor], step: int, all_reduce: AllReduce) -> List[torch.Tensor]:
        """One full round; ``all_reduce`` is awaited twice (P + passthrough, then Q) and must average over one group.

        Returns the averaged update for every gradient, in order. On failure calls :meth:`abort` and re-raises.
        """
        try:
            ps = self.compress_p(grads, step)
            first = await all_reduce(ps + self.passthrough_tensors(grads))
            p_hat = self.orthogonalize(first[: len(ps)])
            q_avg = await all_reduce(self.compute_q(p_hat))
            return self.assemble(self.decompress(p_hat, q_avg), first[len(ps):])
        except BaseException:
            self.abort()
            raise
