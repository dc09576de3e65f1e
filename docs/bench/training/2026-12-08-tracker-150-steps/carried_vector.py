"""Tried and dropped on 2026-12-08: spending one of the tracker's 3 products on a vector carried from the last
measurement instead of a third Krylov vector. Run from the repository root:

    PYTHONPATH=src:tests python docs/bench/training/2026-12-08-tracker-150-steps/carried_vector.py

METHODS' MLP (tests/test_curvature.py), AdamW, measured every 10 steps with 3 products, each method from its own
warm vector, against dense eigvalsh; then METHODS' drifting 400 x 400 problem. Output: carried_vector.txt.
"""
import math
import statistics
from typing import Callable, List, Optional, Tuple

import torch
from torch import Tensor, nn
from test_curvature import _drifting_problems, _exact_top_eigenvalue, _mlp, _unit

from agora.optim.curvature import CurvatureTracker, warm_lanczos


def warm_lobpcg(matvec: Callable[[Tensor], Tensor], u: Tensor, p: Optional[Tensor],
                iters: int) -> Tuple[float, Tensor, Optional[Tensor]]:
    """LOBPCG (block size 1, no preconditioner) for the top eigenpair of a symmetric operator, from the unit vector
    ``u`` and the previous measurement's search direction ``p``: ``iters`` products. Returns ``(theta, x, p_new)``,
    the top Ritz value, its unit vector and the unit direction to carry to the next measurement (None: none yet).

    Why: Lanczos restarted from one vector at every measurement forgets all but that vector, so when the top
    eigenvalues cluster it creeps towards the top, measurement after measurement, at the pace of a 3-dimensional
    Krylov space. LOBPCG's Rayleigh-Ritz space is ``{x, r, p}`` (``r = A x - theta x``): ``p``, the last step's
    move, carries the earlier steps' progress as conjugate gradients do, so measurements on a slowly drifting matrix
    converge almost like one long iteration. Cost: one product for ``x``, one for the carried ``p`` (the matrix moved
    since), one per residual; with 3 products one step on ``{x, r, p}``, each further product one more step (within a
    measurement ``p``'s product is the last step's combination of known products). With fewer than 3 products or
    no ``p`` yet it steps on ``{x, r}``, the same Krylov space as :func:`warm_lanczos`. ``theta`` approximates the
    largest algebraic eigenvalue and never exceeds it: Rayleigh-Ritz on the basis with its Gram matrix, so a basis
    that lost orthogonality in fp32 cannot inflate it. Memory: up to 6 parameter-sized vectors during the last step
    (x, r, p, one product, the new x and p), 4 more while further steps follow. ``p`` is not modified. Non-finite
    values are propagated (``theta`` NaN), not handled.
    """
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    x = u
    ax: Optional[Tensor] = matvec(x)
    used = 1
    theta = float(torch.dot(x, ax))
    if not math.isfinite(theta) or iters == 1:
        return theta, x, p
    ap: Optional[Tensor] = None
    carried = p is not None and iters >= 3  # else no budget for both p's product and a residual's
    p = p.clone() if carried else None
    while used < iters:
        # products this step: the residual's, and p's when it has none yet; the last step keeps no products
        last = used + 1 + (p is not None and ap is None) >= iters
        r = ax - theta * x
        basis: List[Tensor] = [x]
        images: List[Optional[Tensor]] = [ax]
        stiff = {(0, 0): theta}
        reference = float(torch.linalg.vector_norm(ax))
        for v, av, floor in ((p, ap, 1e-6), (r, None, 1e-6 * reference)):
            if v is None or (av is None and used >= iters):
                continue
            for _ in range(2):  # twice: Gram-Schmidt over parameter-sized fp32 vectors
                for b, ab in zip(basis, images):
                    c = float(torch.dot(b, v))
                    v.sub_(b, alpha=c)
                    if av is not None:
                        av.sub_(ab, alpha=c)
            norm = float(torch.linalg.vector_norm(v))
            if not norm > floor:  # dependent (x is an eigenvector, or p points along x): leave it out
                continue
            v.div_(norm)
            if av is None:
                av = matvec(v)
                used += 1
            else:
                av.div_(norm)
            j = len(basis)
            basis.append(v)
            for i, b in enumerate(basis):  # the upper triangle, from this product; the rest by symmetry
                stiff[(i, j)] = float(torch.dot(b, av))
            images.append(None if last else av)
            del av
        if last:  # the last step combines vectors only
            images, ax, ap = [], None, None
        k = len(basis)
        if k == 1:  # x is an eigenvector and there is nothing else to search: done
            return theta, x, None
        s = torch.tensor([[stiff[(min(i, j), max(i, j))] for j in range(k)] for i in range(k)], dtype=torch.float64)
        if not bool(torch.isfinite(s).all()):
            return float("nan"), x, None
        gram = torch.tensor([[float(torch.dot(basis[i], basis[j])) for j in range(k)] for i in range(k)],
                            dtype=torch.float64)
        # stiff y = theta gram y, through the Cholesky factor of the (near-identity) Gram matrix
        inverse = torch.linalg.inv(torch.linalg.cholesky((gram + gram.T) / 2))
        values, vectors = torch.linalg.eigh(inverse @ s @ inverse.T)
        y = (inverse.T @ vectors[:, -1]).tolist()
        theta = float(values[-1])
        p_new = torch.zeros_like(x)
        ap_new = None if last else torch.zeros_like(x)
        for i in range(1, k):
            p_new.add_(basis[i], alpha=y[i])
            if ap_new is not None:
                ap_new.add_(images[i], alpha=y[i])
        x_new = p_new + basis[0] * y[0]
        scale = float(torch.linalg.vector_norm(x_new))
        x = x_new.div_(scale)
        if ap_new is not None:
            ax = ap_new + images[0] * y[0]
            ax.div_(scale)
        del basis, images, r
        p_norm = float(torch.linalg.vector_norm(p_new))
        if p_norm > 0:
            p, ap = p_new.div_(p_norm), (ap_new.div_(p_norm) if ap_new is not None else None)
        else:
            p, ap = None, None
    return theta, x, p


def rr(basis, images):
    k = len(basis)
    Q = torch.stack(basis); AQ = torch.stack(images)
    G = (Q @ Q.T).double(); S = (Q @ AQ.T).double(); S = (S + S.T) / 2
    L = torch.linalg.inv(torch.linalg.cholesky(G))
    vals, vecs = torch.linalg.eigh(L @ S @ L.T)
    Y = (L.T @ vecs).to(Q.dtype)
    return vals, Y, Q, AQ

def orth(v, basis):
    for _ in range(2):
        for b in basis:
            v = v - torch.dot(b, v) * b
    n = v.norm()
    return v / n if n > 1e-9 else None

def block2(matvec, xs, iters):
    """xs: list of carried unit vectors (1 or 2)."""
    basis, images = [], []
    for x in xs:
        v = orth(x.clone(), basis)
        if v is None: continue
        basis.append(v); images.append(matvec(v))
    used = len(basis)
    while used < iters:
        vals, Y, Q, AQ = rr(basis, images)
        x = Y[:, -1] @ Q; ax = Y[:, -1] @ AQ
        r = orth(ax - vals[-1] * x, basis)
        if r is None: break
        basis.append(r); images.append(matvec(r)); used += 1
    vals, Y, Q, AQ = rr(basis, images)
    top = [(Y[:, -1] @ Q)]
    if len(basis) > 1: top.append(Y[:, -2] @ Q)
    top = [t / t.norm() for t in top]
    return float(vals[-1]), top



def main() -> None:
    model = _mlp()
    g = torch.Generator().manual_seed(1)
    xx, y = torch.randn(64, 32, generator=g), torch.randn(64, 4, generator=g)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    tracker = CurvatureTracker(params, hvps=3, eps=1e-8, seed=0)  # Lanczos
    lob_x, lob_p, blk = tracker._u.clone(), None, [tracker._u.clone()]
    loss_fn = lambda: nn.functional.mse_loss(model(xx), y)  # noqa: E731
    print("MLP, 3 products every 10 steps: relative error against eigvalsh")
    for step in range(1, 81):
        opt.zero_grad()
        loss_fn().backward()
        opt.step()
        if step % 10:
            continue
        moments = [opt.state[q]["exp_avg_sq"] for q in params]
        lanczos = tracker.measure(loss_fn, moments, beta2=0.95, step=step)
        with torch.enable_grad():
            mv = tracker._operator(loss_fn, moments, 0.95, step)
            lobpcg, lob_x, lob_p = warm_lobpcg(mv, lob_x, lob_p, 3)
            block2_value, blk = block2(mv, blk, 3)
        exact = _exact_top_eigenvalue(model, xx, y, opt)
        print(f"step {step}: exact {exact:.1f}, lanczos {abs(lanczos - exact) / exact:.2e}, "
              f"lobpcg (carried direction) {abs(lobpcg - exact) / exact:.2e}, "
              f"second Ritz vector carried {abs(block2_value - exact) / exact:.2e}")
    for iters in (3,):
        g = torch.Generator().manual_seed(1)
        l = _unit(400, g)
        xs, x, p = [l.clone()], l.clone(), None
        errors = {"lanczos": [], "lobpcg": [], "block2": []}
        for mv, exact in _drifting_problems(400):
            lam, l = warm_lanczos(mv, l, iters)
            errors["lanczos"].append(abs(lam - exact) / exact)
            lam, x, p = warm_lobpcg(mv, x, p, iters)
            errors["lobpcg"].append(abs(lam - exact) / exact)
            lam, xs = block2(mv, xs, iters)
            errors["block2"].append(abs(lam - exact) / exact)
        print(f"drifting 400 x 400, {iters} products per step: " + ", ".join(
            f"{k} median {statistics.median(v):.2e} max after step 50 {max(v[50:]):.2e}" for k, v in errors.items()))


if __name__ == "__main__":
    main()
