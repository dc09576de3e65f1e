"""``powersgd``: the ``full`` decision and repairs, but a round moves rank-r PowerSGD factors with error feedback.

Both all-reduces of a round run in one hivemind group (``allreduce.PowerSGDAverager``): ``8 r (n + m)`` bytes per
``n x m`` matrix instead of ``8 n m``. Every replica applies the same update, so replicas stay bit-identical and the
fingerprint repair works unchanged. A failed round costs no repair: every replica whose round failed takes a
zero-gradient step and keeps ``G + E`` in its error buffer for the next round. A state download resets the error
buffer (it belongs to the trajectory left behind); a replica alone steps on ``G + E``.

The first ``averaging.dense_steps`` steps are ``full`` rounds of ``G + E``, in a second averager (its own
matchmaking prefix) that is shut down once the stage is past them. A failed dense round fails as a compressed one
does (a zero step, ``G + E`` kept in the error buffer), so replicas whose round failed together need no state
download, which a slow link could not afford either. Why dense at all: the early steps are where a low-rank update
costs the most loss (docs/COMPRESSION.md, "Dense first steps"). With ``averaging.dense_every`` = N, every N-th step
after them is a dense round too (the averager then stays up): it delivers the whole error buffer at once, so what
rank ``r`` left behind never piles up for more than N steps (docs/COMPRESSION.md, "Periodic dense rounds").
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from agora.compression.powersgd import PowerSGD
from agora.server.averaging.allreduce import GuardedAverager, PowerSGDAverager
from agora.server.averaging.full import FullSync

logger = logging.getLogger("agora.averaging")


class PowerSGDSync(FullSync):
    scheme = "powersgd"

    def _make_averager(self):
        m, rt = self.ctx.manifest, self.ctx.runtime
        a = m.averaging
        self.psgd = PowerSGD([p.shape for p in rt.stage.parameters()], a.rank, run_id=m.run_id,
                             stage=rt.stage_index, warm_start=a.warm_start)
        self._compressed_step: Optional[int] = None  # step whose payload is built and not yet resolved
        self.dense_steps, self.dense_every = a.dense_steps, a.dense_every
        self.dense: Optional[GuardedAverager] = None  # full rounds: before compression starts, then every dense_every
        self._dense_round = False  # the payload loaded last went into ``dense``
        self._dense_payload: Optional[list[torch.Tensor]] = None  # its ``G + E`` (taken out of the error buffers)
        if rt.step < self.dense_steps or self.dense_every > 0:
            self.dense = super()._make_averager(prefix=f"{self.prefix}_dense")
        f64 = torch.float64
        phase1 = [torch.zeros(s, dtype=f64) for s in [*self.psgd.p_shapes(), *self.psgd.passthrough_shapes()]]
        qs = [torch.zeros(s, dtype=f64) for s in self.psgd.q_shapes()]
        matrices = [torch.zeros(ps[0], qs_[0], dtype=f64) for ps, qs_ in zip(self.psgd.p_shapes(), self.psgd.q_shapes())]
        return PowerSGDAverager(phase1, qs, matrices, self.ctx.dht, **self.averager_settings())

    def round_averager(self):
        return self.dense if self._dense_round else self.averager  # as ``_load_buffers`` chose for this round

    def averagers(self) -> list:
        return [self.averager, self.dense]

    def _dense_at(self, step: int) -> bool:
        """Every replica at ``step`` decides alike: the first ``dense_steps``, then every ``dense_every``-th."""
        if self.dense is None:
            return False
        return step < self.dense_steps or (self.dense_every > 0 and step % self.dense_every == 0)

    def _load_buffers(self, grads: list[torch.Tensor], step: int) -> None:
        """``P = (G + E) Q`` and the passthrough gradients for phase 1, and ``M = G + E`` for the averager to
        compute phase 2's ``Q`` from; at a dense step, the whole gradient into the dense averager."""
        self._dense_round = self._dense_at(step)
        if self._dense_round:
            self._dense_payload = self.psgd.flush(grads)  # G + E: averaged in full, the error is delivered
            with self.dense.get_tensors() as bufs:
                for b, g in zip(bufs, self._dense_payload):
                    b.copy_(g)
            return
        ps = self.psgd.compress_p(grads, step)
        self._compressed_step = step
        payload = [*ps, *self.psgd.passthrough_tensors(grads)]
        with self.averager.get_tensors() as bufs:
            for b, t in zip(bufs, payload):
                b.copy_(t)
            for b, mat in zip(self.averager.matrices, self.psgd.matrices()):
                b.copy_(mat)

    def _averaged(self) -> list[torch.Tensor]:
        if self._dense_round:
            self._dense_round, self._dense_payload = False, None
            with self.dense.get_tensors() as bufs:
                return [b.float() for b in bufs]
        with self.averager.get_tensors() as bufs:
            k, n1 = len(self.psgd.compressed), self.averager.n_phase1
            p_hat, passthrough, q_avg = ([b.clone() for b in bufs[:k]], [b.clone() for b in bufs[k:n1]],
                                         [b.clone() for b in bufs[n1:]])
        self._compressed_step = None
        return self.psgd.assemble(self.psgd.decompress(p_hat, q_avg), passthrough)

    def _not_averaged(self, grads: list[torch.Tensor], alone: bool) -> list[torch.Tensor]:
        """Alone: ``G + E`` (the error buffer is flushed: there is no group to compress for). After a failed round,
        compressed or dense: a zero update, the whole ``G + E`` staying in the error buffer. Why not our own
        gradient here: it would be applied now *and* again through the error buffer; and replicas whose round failed
        together take the same zero-gradient step, so they stay identical and need no state download."""
        compressed, self._compressed_step = self._compressed_step, None
        loaded, self._dense_payload, self._dense_round = self._dense_payload, None, False
        if loaded is not None:  # a dense round's payload, G + E already out of the error buffer, without a result
            if alone:
                return loaded
            self.psgd.compress_p(loaded, self.ctx.runtime.step)  # M = G + E back into the error buffer
            self.psgd.abort()
            return [torch.zeros_like(g) for g in grads]
        if alone:
            return self.psgd.flush(grads)
        if compressed is None:  # the round failed before its payload was built: build M = G + E to keep it
            self.psgd.compress_p(grads, self.ctx.runtime.step)
        self.psgd.abort()
        return [torch.zeros_like(g) for g in grads]

    def _state_replaced(self) -> None:
        self.psgd.reset()  # the error buffer belongs to the trajectory we just left
        self._end_dense_phase()

    def _after_step(self) -> None:
        super()._after_step()
        self._end_dense_phase()

    def _end_dense_phase(self) -> None:
        """Compute thread: past the dense steps, shut the dense averager down (its process and its stage-sized
        float64 buffers); with ``dense_every`` it stays up. A replica that comes back to an earlier step (a restore)
        compresses from then on."""
        if (self.dense is not None and self.dense_every == 0 and self.ctx.runtime.step >= self.dense_steps
                and not self._dense_round):
            dense, self.dense = self.dense, None
            _shut_down(dense)

    def shutdown(self) -> None:
        if self.dense is not None and not self.closed:
            _shut_down(self.dense)
        super().shutdown()


def _shut_down(averager: GuardedAverager) -> None:
    try:
        averager.shutdown()
    except Exception as err:  # already gone: nothing left to release
        logger.debug(f"dense averager shutdown: {err!r}")
