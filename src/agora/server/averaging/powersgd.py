"""``powersgd``: the ``full`` decision and repairs, but a round moves rank-r PowerSGD factors with error feedback.

Both all-reduces of a round run in one hivemind group (``allreduce.PowerSGDAverager``): ``8 r (n + m)`` bytes per
``n x m`` matrix instead of ``8 n m``. Every replica applies the same update, so replicas stay bit-identical and the
fingerprint repair works unchanged. A failed round costs no repair: every replica whose round failed takes a
zero-gradient step and keeps ``G + E`` in its error buffer for the next round. A state download resets the error
buffer (it belongs to the trajectory left behind); a replica alone steps on ``G + E``.
"""

from __future__ import annotations

from typing import Optional

import torch

from agora.compression.powersgd import PowerSGD
from agora.server.averaging.allreduce import PowerSGDAverager
from agora.server.averaging.full import FullSync


class PowerSGDSync(FullSync):
    scheme = "powersgd"

    def _make_averager(self):
        m, rt = self.ctx.manifest, self.ctx.runtime
        a = m.averaging
        self.psgd = PowerSGD([p.shape for p in rt.stage.parameters()], a.rank, run_id=m.run_id,
                             stage=rt.stage_index, warm_start=a.warm_start)
        self._compressed_step: Optional[int] = None  # step whose payload is built and not yet resolved
        f64 = torch.float64
        phase1 = [torch.zeros(s, dtype=f64) for s in [*self.psgd.p_shapes(), *self.psgd.passthrough_shapes()]]
        qs = [torch.zeros(s, dtype=f64) for s in self.psgd.q_shapes()]
        matrices = [torch.zeros(ps[0], qs_[0], dtype=f64) for ps, qs_ in zip(self.psgd.p_shapes(), self.psgd.q_shapes())]
        return PowerSGDAverager(phase1, qs, matrices, self.ctx.dht, **self.averager_settings())

    def _load_buffers(self, grads: list[torch.Tensor], step: int) -> None:
        """``P = (G + E) Q`` and the passthrough gradients for phase 1, and ``M = G + E`` for the averager to
        compute phase 2's ``Q`` from."""
        ps = self.psgd.compress_p(grads, step)
        self._compressed_step = step
        payload = [*ps, *self.psgd.passthrough_tensors(grads)]
        with self.averager.get_tensors() as bufs:
            for b, t in zip(bufs, payload):
                b.copy_(t)
            for b, mat in zip(self.averager.matrices, self.psgd.matrices()):
                b.copy_(mat)

    def _averaged(self) -> list[torch.Tensor]:
        with self.averager.get_tensors() as bufs:
            k, n1 = len(self.psgd.compressed), self.averager.n_phase1
            p_hat, passthrough, q_avg = ([b.clone() for b in bufs[:k]], [b.clone() for b in bufs[k:n1]],
                                         [b.clone() for b in bufs[n1:]])
        self._compressed_step = None
        return self.psgd.assemble(self.psgd.decompress(p_hat, q_avg), passthrough)

    def _not_averaged(self, grads: list[torch.Tensor], alone: bool) -> list[torch.Tensor]:
        """Alone: ``G + E`` (the error buffer is flushed: there is no group to compress for). After a failed round:
        a zero update, the whole ``G + E`` staying in the error buffer. Why not our own gradient here: it would be
        applied now *and* again through the error buffer; and replicas whose round failed together take the same
        zero-gradient step, so they stay identical and need no state download."""
        compressed, self._compressed_step = self._compressed_step, None
        if alone:
            return self.psgd.flush(grads)
        if compressed is None:  # the round failed before its payload was built: build M = G + E to keep it
            self.psgd.compress_p(grads, self.ctx.runtime.step)
        self.psgd.abort()
        return [torch.zeros_like(g) for g in grads]

    def _state_replaced(self) -> None:
        self.psgd.reset()  # the error buffer belongs to the trajectory we just left
