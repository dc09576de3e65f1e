"""UPM frames: function-preserving orthogonal transforms of a stage's weights (METHODS sections 6 and 7).

Each stage computes in its own coordinate frame of the residual stream and ends with an explicit boundary map M
into the next stage's frame (``Stage.boundary_map``). A rotation R at boundary b changes stage b's map (M <- M R)
and the whole frame of stage b+1 (its reads, writes, embedding and its own map), so the swarm computes the same
function while weights captured before and after the rotation no longer fit together. In subspace mode R acts on
the k coordinates only: Q(R) = I + U (R - I) U^T. In dense mode (imported models) R is d x d.

Transforms are computed in float64 from the stage's fp32 (or fp64) masters and written back once, so they never
compound in low precision. docs/UPM.md has the algebra and what it does not hide.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from agora.model import Stage

READS_AFTER_INPUT_NORM = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
READS_AFTER_POST_NORM = ("mlp.gate_proj", "mlp.up_proj")
WRITES = ("self_attn.o_proj", "mlp.down_proj")

# How Adam's second moment follows a transform W' = L W R (METHODS s6: Adam is not rotation-equivariant). The first
# moment is linear in the gradients and is always transformed exactly (m' = L m R).
V_MODES = ("mixed", "isotropic", "keep")
# - mixed: v' = (L*L) v (R*R), the elementwise second moment of the rotated gradient if its coordinates were
#   uncorrelated; exact for signed permutations, and it conserves v's total.
# - isotropic: v' = mean(v) everywhere (the tensor's scale is kept, the per-coordinate information dropped).
# - keep: v unchanged (the cheapest; wrong in proportion to how far the rotation moves the coordinates).

FRAME_MAP = "frame/boundary_map"  # the name of a stage's boundary map in exported state and checkpoints

Moments = Callable[[nn.Parameter], Optional[dict]]  # a parameter's optimizer state (exp_avg, exp_avg_sq), or None


def haar_orthogonal(n: int, generator: torch.Generator) -> Tensor:
    """A Haar-distributed n x n orthogonal matrix (float64): QR of a Gaussian, column signs fixed by diag(R)."""
    a = torch.randn(n, n, generator=generator, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    return q * torch.sign(torch.diagonal(r)).where(torch.diagonal(r) != 0, torch.ones(n, dtype=torch.float64))


def reorthogonalize(r: Tensor) -> Tensor:
    """The orthogonal matrix nearest to ``r`` (polar factor, float64): a received or stored R is cleaned before
    use, so rounding never accumulates into a non-orthogonal frame. A signed permutation is returned as it is:
    its polar factor would be the same matrix up to rounding, which would end its exactness."""
    if as_signed_permutation(r) is not None:
        return r.double().clone()
    u, _, vh = torch.linalg.svd(r.double())
    return u @ vh


@torch.no_grad()
def exact_basis(stage: Stage) -> None:
    """In a float64 stage, make U orthonormal to float64 precision and F orthogonal to it. U is derived in float64
    but stored in float32, so it is orthonormal to ~1e-8 only: fine for fp32 compute, not for measuring fp64
    transforms (tests, ``agora bench upm``). Deterministic: every stage gets the same U."""
    if not stage.subspace:
        return
    if stage.basis.dtype != torch.float64:
        raise ValueError("exact_basis is for float64 stages (call stage.double() first)")
    q, r = torch.linalg.qr(stage.basis)
    q = q * torch.sign(torch.diagonal(r))  # the same columns as U, up to rounding
    stage.basis.copy_(q)
    if stage.frozen_embed is not None:
        f = stage.frozen_embed
        f.copy_(f - (f @ q) @ q.T)


def orthogonality_error(r: Tensor) -> float:
    """max |R^T R - I| of a square float64 matrix (inf when it holds NaN or Inf)."""
    if not bool(torch.isfinite(r).all()):
        return math.inf
    return float((r.T @ r - torch.eye(r.shape[0], dtype=torch.float64)).abs().max())


def check_frame_map(stage: Stage, m: Optional[Tensor]) -> Optional[Tensor]:
    """A boundary map received in a state (a download, a checkpoint) for ``stage``, checked: None stays None;
    otherwise a finite orthogonal n x n matrix (n = ``frame_width``) for a non-tail stage, returned in float64
    and re-orthogonalised. Raises ValueError, so a malformed state never replaces a good one."""
    if m is None:
        return None
    n = frame_width(stage)
    if stage.spec.is_tail:
        raise ValueError("the state carries a boundary map, but the tail stage has no next stage to map into")
    if m.dim() != 2 or tuple(m.shape) != (n, n) or not m.is_floating_point():
        raise ValueError(f"boundary map must be a {n} x {n} float matrix, got {tuple(m.shape)} {m.dtype}")
    m = m.double()
    if not bool(torch.isfinite(m).all()):
        raise ValueError("boundary map contains NaN or Inf")
    drift = orthogonality_error(m)
    if drift > 1e-4:
        raise ValueError("boundary map is not orthogonal")
    # Cleaned only when it drifted: a map orthogonal to rounding is kept bit for bit, so a replica that downloads
    # it holds exactly the sender's (parameter fingerprints include it).
    return reorthogonalize(m) if drift > 1e-10 else m


def frame_width(stage: Stage) -> int:
    """The size of a boundary rotation for this stage's run: k (subspace) or d_model (dense)."""
    return stage.basis.shape[1] if stage.subspace else stage.shape.d_model


def lift(stage: Stage, r: Tensor) -> Tensor:
    """Q(R), the d x d orthogonal map R induces on the residual stream (float64)."""
    r = r.double()
    if not stage.subspace:
        return r
    u = stage.basis.double()
    return torch.eye(u.shape[0], dtype=torch.float64) + u @ (r - torch.eye(r.shape[0], dtype=torch.float64)) @ u.T


def enable_frames(stage: Stage, allow_tied_copies: bool = False, moments: Optional[Moments] = None,
                  fold: bool = True) -> None:
    """Give a non-tail stage its boundary map (identity: nothing changes yet) and fold every input-side norm gain
    into the reads after it, so rotations commute with the norms. Idempotent. ``fold=False``: signed permutations
    only (they permute the gains instead, ``rotate_input``), so a trained stage's gains and reads stay as they are;
    folding them mid-training reparametrises what Adam steps, so training no longer matches a run without frames.

    ``allow_tied_copies``: the head's embedding and the tail's LM head of a tied model are separate copies here
    (an offline measurement) and may each live in their own frame. In a swarm they are kept equal by averaging
    their gradients, which frames would break: refused."""
    tied_ends = stage.spec.n_stages > 1 and (stage.spec.is_head or stage.spec.is_tail)
    if stage.shape.tie_embeddings and tied_ends and not allow_tied_copies:
        raise ValueError("UPM frames cannot rotate a tied embedding held by two stages (head and tail would need "
                         "the same matrix in two frames); untie it (model.tie_embeddings: false)")
    if not stage.spec.is_tail and stage.boundary_map is None:
        n = frame_width(stage)
        stage.boundary_map = torch.eye(n, dtype=torch.float64, device=stage.rope_cos.device)
    if fold:
        fold_gains(stage, moments)


@torch.no_grad()
def fold_gains(stage: Stage, moments: Optional[Moments] = None) -> None:
    """W <- W diag(g) for every read after a gain-carrying RMSNorm, then g <- 1: the same function, and a norm
    that commutes with orthogonal frames (N(xQ) = N(x) Q only without a per-channel gain).

    With ``moments``, the optimizer state follows the reparametrisation exactly: the folded read's gradient is the
    old one times diag(1/g) (m <- m / g, v <- v / g^2 per input column), the new gain's is the old one times g."""
    for block in stage.layers.values():
        _fold(block.input_layernorm.weight, [block.get_submodule(n).weight for n in READS_AFTER_INPUT_NORM], moments)
        _fold(block.post_attention_layernorm.weight, [block.get_submodule(n).weight for n in READS_AFTER_POST_NORM],
              moments)
    if stage.spec.is_tail:
        _fold(stage.norm.weight, [stage.lm_head.weight], moments)


def _fold(gain: Optional[nn.Parameter], reads: list[nn.Parameter], moments: Optional[Moments]) -> None:
    if gain is None:
        return
    g = gain.detach().double()
    if bool((g == 1).all()):
        return  # already folded: nothing moves
    if moments is not None and bool((g.abs() < 1e-6).any()):
        raise ValueError("a norm gain is ~0: its read cannot carry it exactly with optimizer state (1/g)")
    for w in reads:
        w.copy_((w.double() * g).to(w.dtype))
        st = moments(w) if moments is not None else None
        if st:
            _set(st, "exp_avg", st["exp_avg"].double() / g)
            _set(st, "exp_avg_sq", st["exp_avg_sq"].double() / g.square())
    st = moments(gain) if moments is not None else None
    if st:
        _set(st, "exp_avg", st["exp_avg"].double() * g)
        _set(st, "exp_avg_sq", st["exp_avg_sq"].double() * g.square())
    gain.fill_(1.0)


def _permute_vector(gain: nn.Parameter, src: Tensor, moments: Optional[Moments]) -> None:
    """g <- g|Q| (entry j takes entry src[j]) for a norm gain under a signed permutation, with its moments."""
    gain.copy_(gain.detach()[src])
    st = moments(gain) if moments is not None else None
    if st:
        for key in ("exp_avg", "exp_avg_sq"):
            if key in st:
                st[key].copy_(st[key][src])


def _set(state: dict, key: str, value: Tensor) -> None:
    state[key].copy_(value.to(state[key].dtype))


SignedPermutation = tuple[Tensor, Tensor]  # (src, sign): X[src[j], j] = sign[j], every other entry 0


def as_signed_permutation(x: Tensor) -> Optional[SignedPermutation]:
    """``x`` as (src, sign) if it is exactly a signed permutation matrix (entries 0 and +-1, one non-zero per row
    and column), else None. Rotations that are signed permutations of the whole stream move every weight, gain and
    Adam moment exactly (``rotate_input``)."""
    if x.dim() != 2 or x.shape[0] != x.shape[1]:
        return None
    nonzero = x != 0
    if not bool(((x == 1) | (x == -1) | ~nonzero).all()):
        return None
    if not (bool((nonzero.sum(dim=0) == 1).all()) and bool((nonzero.sum(dim=1) == 1).all())):
        return None
    src = nonzero.to(torch.int8).argmax(dim=0)
    return src, x[src, torch.arange(x.shape[1])].double()


class _Side:
    """One side of a transform W' = L W R: how to apply its matrix X and X's elementwise square X*X (what
    Adam's second moment follows, ``mixed``) to a tensor. In subspace runs X = Q(R) = I + U (R - I) U^T, and both
    are applied without forming a d x d matrix (``lifted``): a dense d x d product per tensor made each rotation
    of a stage with an LM head take seconds of compute on a CPU."""

    def __init__(self, apply: Callable[[Tensor], Tensor], apply_sq: Callable[[Tensor], Tensor],
                 perm: Optional["SignedPermutation"] = None, on_left: bool = False):
        self.apply, self.apply_sq = apply, apply_sq
        # a signed permutation (``signed``): ``_transform`` then moves only the entries it changes, in place
        self.perm, self.on_left = perm, on_left
        self._moved: Optional[Tensor] = None  # its indices that it moves or flips (computed once per side)
        if perm is not None:
            src, sign = perm
            self._moved = ((src != torch.arange(src.numel(), device=src.device)) | (sign != 1)).nonzero().flatten()

    @staticmethod
    def dense(x: Tensor, on_left: bool) -> "_Side":
        if on_left:
            return _Side(lambda t: x @ t, lambda t: x.square() @ t)
        return _Side(lambda t: t @ x, lambda t: t @ x.square())

    @staticmethod
    def signed(perm: "SignedPermutation", on_left: bool) -> "_Side":
        """A signed permutation X (``as_signed_permutation``) applied by indexing: exact in any dtype, where a
        product (or the low-rank form's t + (t' - t)) could round."""
        src, sign = perm
        if on_left:  # (X^T t)_j = s_j t_{src(j)}
            return _Side(lambda t: t[src] * sign.to(t.dtype)[:, None], lambda t: t[src], perm, True)
        return _Side(lambda t: t[:, src] * sign.to(t.dtype), lambda t: t[:, src], perm, False)

    def permute_in_place(self, t: Tensor, square: bool = False) -> None:
        """``t <- apply(t)`` (``apply_sq`` with ``square``) for a signed permutation, writing only the rows (on the
        left) or columns it moves, in ``t``'s own dtype: exact, as indexing and sign flips are in any dtype. On a
        coordinate basis a frame moves k of the d coordinates, so this touches k/d of each tensor instead of
        copying all of it through float64 several times (a rotation of `small`'s tail took 124 ms of CPU so)."""
        src, sign = self.perm
        if self._moved.numel() == 0:
            return
        src, moved = src.to(t.device), self._moved.to(t.device)
        flip = None if square else sign.to(device=t.device, dtype=t.dtype)[moved]
        if self.on_left:
            rows = t[src[moved]]  # a copy: read before any row is written
            t[moved] = rows if flip is None else rows * flip[:, None]
        else:
            cols = t[:, src[moved]]
            t[:, moved] = cols if flip is None else cols * flip

    @staticmethod
    def lifted(r: Tensor, u: Tensor, q: Tensor, on_left: bool) -> "_Side":
        """Q(R) on the right (t Q), or Q(R)^T on the left (Q^T t), with u: the basis U (d x k)."""
        k = u.shape[1]
        if k * k >= u.shape[0]:  # the low-rank form would cost more than the dense product
            return _Side.dense(q.T if on_left else q, on_left)
        m = r - torch.eye(k, dtype=torch.float64)
        diag_a = ((u @ m) * u).sum(dim=1)  # diag(A), A = U M U^T
        w = (u[:, :, None] * u[:, None, :]).reshape(u.shape[0], k * k)  # W[:, i k + j] = U_i * U_j
        kk = torch.kron(m, m)  # A*A = W (M (x) M) W^T
        if on_left:  # Q^T t and (Q*Q)^T t (Q*Q is not symmetric: M is not)
            return _Side(lambda t: t + u @ (m.T @ (u.T @ t)),
                         lambda t: t + 2 * diag_a[:, None] * t + w @ (kk.T @ (w.T @ t)))
        return _Side(lambda t: t + ((t @ u) @ m) @ u.T,
                     lambda t: t + 2 * t * diag_a[None, :] + ((t @ w) @ kk) @ w.T)


def _transform(w: nn.Parameter, left: Optional[Tensor], right: Optional[Tensor], moments: Optional[Moments],
               v_mode: str, weight: Optional[Tensor] = None, left_side: Optional[_Side] = None,
               right_side: Optional[_Side] = None) -> None:
    """W <- L W R (float64, written back in W's dtype), and its optimizer moments. ``weight``: the new W already
    computed (a cheaper form of the same product); ``left_side``/``right_side``: cheaper ways to apply L or R and
    their elementwise squares (``_Side``)."""
    ls = left_side or (_Side.dense(left, True) if left is not None else None)
    rs = right_side or (_Side.dense(right, False) if right is not None else None)
    sides = [side for side in (ls, rs) if side is not None]
    if weight is None and sides and all(side.perm is not None for side in sides):
        _permute(w, sides, moments, v_mode)
        return

    def apply(x: Tensor, square: bool = False) -> Tensor:
        x = x.double()
        if ls is not None:
            x = ls.apply_sq(x) if square else ls.apply(x)
        if rs is not None:
            x = rs.apply_sq(x) if square else rs.apply(x)
        return x

    w.copy_((weight if weight is not None else apply(w)).to(w.dtype))
    st = moments(w) if moments is not None else None
    if not st:
        return
    _set(st, "exp_avg", apply(st["exp_avg"]))
    v = st["exp_avg_sq"]
    if v_mode == "mixed":
        _set(st, "exp_avg_sq", apply(v, square=True).clamp_min(0))
    elif v_mode == "isotropic":
        v.fill_(float(v.double().mean()))
    elif v_mode != "keep":
        raise ValueError(f"v_mode must be one of {V_MODES}, got {v_mode!r}")


def _permute(w: nn.Parameter, sides: list[_Side], moments: Optional[Moments], v_mode: str) -> None:
    """``_transform`` when every side is a signed permutation: W, m and (``mixed``: without the signs) v in place.
    Bit for bit what the float64 products give, since every entry of the result is one entry of the input, signed."""
    st = moments(w) if moments is not None else None
    targets = [(w.data, False)]
    if st:
        targets.append((st["exp_avg"], False))
        if v_mode == "mixed":
            targets.append((st["exp_avg_sq"], True))
        elif v_mode == "isotropic":
            st["exp_avg_sq"].fill_(float(st["exp_avg_sq"].double().mean()))
        elif v_mode != "keep":
            raise ValueError(f"v_mode must be one of {V_MODES}, got {v_mode!r}")
    for t, square in targets:
        for side in sides:
            side.permute_in_place(t, square)


@torch.no_grad()
def rotate_input(stage: Stage, r: Tensor, moments: Optional[Moments] = None, v_mode: str = "mixed") -> None:
    """The residual stream entering (and living in) this stage is now x Q(R): move every weight that reads or
    writes it, and the boundary map, so the stage computes the same function on the rotated stream.

    Reads (Linear weight W, y = x W^T): W <- W Q. Writes into the subspace (k outputs): W <- R^T W. Dense writes
    (the tail's blocks, dense runs): W <- Q^T W. Head embedding: Z <- Z R (subspace) or E <- E R (dense).
    Boundary map: M <- R^T M. Gains are folded first (``fold_gains``). With ``moments`` the optimizer state
    follows: m exactly, v by ``v_mode`` (``V_MODES``). When Q is a signed permutation (a signed permutation R with
    ``residual.basis: coordinates``, or in a dense run) gains are permuted instead of folded, and every tensor and
    moment moves exactly whatever ``v_mode`` says.
    """
    r = reorthogonalize(r)
    q = lift(stage, r)
    u = stage.basis.double() if stage.subspace else None
    params = dict(stage.named_parameters())
    exact = as_signed_permutation(q)
    if exact is not None:
        # A signed permutation of the stream commutes with per-channel gains once they are permuted too
        # (N(xQ) (g|Q|) = (N(x) g) Q): nothing is folded, and every tensor and moment is moved by indexing, so the
        # stage afterwards is the same stage with its coordinates renamed, and Adam's next step renames with it.
        for gain, _ in gain_groups(stage):
            _permute_vector(params[gain], exact[0], moments)
        v_mode = "mixed"  # exact for signed permutations (``V_MODES``)
        read_side, dense_write = _Side.signed(exact, on_left=False), _Side.signed(exact, on_left=True)
        embed_side = _Side.signed(as_signed_permutation(r), on_left=False)
    else:
        fold_gains(stage, moments)
        read_side = _Side.lifted(r, u, q, on_left=False) if u is not None else None
        dense_write = _Side.lifted(r, u, q, on_left=True) if u is not None else None
        embed_side = None
    for name, role in weight_roles(stage):
        w = params[name]
        if role == "read":
            weight = _read(w.double(), r, u, q) if exact is None else None
            _transform(w, None, q, moments, v_mode, weight=weight, right_side=read_side)
        elif role == "write_k":  # a subspace write has k outputs, lifted by U^T after its norm
            _transform(w, r.T, None, moments, v_mode)
        elif role == "write_d":
            _transform(w, q.T, None, moments, v_mode, left_side=dense_write)
        else:  # the head's embedding: Z (V x k) in subspace runs, E (V x d) in dense ones; R is that wide
            _transform(w, None, r, moments, v_mode, right_side=embed_side)
    if stage.boundary_map is not None:  # a new tensor: a forward still in flight keeps the map it ran with
        stage.boundary_map = (r.T @ stage.boundary_map.double()).to(stage.boundary_map.dtype)


def weight_roles(stage: Stage) -> list[tuple[str, str]]:
    """Every parameter that a rotation of the stage's input frame moves (gains aside), by name, with how:
    ``read`` W <- W Q (a Linear reading the stream, the LM head), ``write_k`` W <- R^T W (a subspace block's
    write: k outputs), ``write_d`` W <- Q^T W (a dense write), ``embed`` Z <- Z R (the head's embedding). The one
    walk over a stage's weights that ``rotate_input``, ``input_gradients`` and ``input_weights`` share."""
    roles = []
    for layer, block in stage.layers.items():
        pre = f"layers.{layer}."
        roles += [(f"{pre}{n}.weight", "read") for n in (*READS_AFTER_INPUT_NORM, *READS_AFTER_POST_NORM)]
        roles += [(f"{pre}{n}.weight", "write_k" if block.subspace else "write_d") for n in WRITES]
    if stage.spec.is_tail:
        roles.append(("lm_head.weight", "read"))
    if stage.spec.is_head:
        roles.append(("embed_tokens.weight", "embed"))
    return roles


def _move(role: str, x: Tensor, r: Tensor, u: Optional[Tensor], q: Tensor,
          exact: Optional[SignedPermutation] = None) -> Tensor:
    """``x`` (float64, laid out as a parameter of ``role``, see ``weight_roles``) moved as that parameter is.
    ``exact``: Q as a signed permutation (``as_signed_permutation``), moved by indexing."""
    if role == "write_k":
        return r.T @ x
    if exact is not None:
        if role == "read":
            return _Side.signed(exact, on_left=False).apply(x)
        if role == "write_d":
            return _Side.signed(exact, on_left=True).apply(x)
        return _Side.signed(as_signed_permutation(r), on_left=False).apply(x)
    if role == "read":
        return _read(x, r, u, q)
    if role == "write_d":
        return q.T @ x
    return x @ r


def _read(w: Tensor, r: Tensor, u: Optional[Tensor], q: Tensor) -> Tensor:
    """W Q, as a rank-k update W + (W U)(R - I) U^T in subspace runs (O(m d k) instead of O(m d^2))."""
    if u is None:
        return w @ q
    return w + (w @ u) @ (r - torch.eye(r.shape[0], dtype=torch.float64)) @ u.T


@torch.no_grad()
def rotate_output(stage: Stage, r: Tensor) -> None:
    """The next stage now works in a frame rotated by R: this stage's boundary map follows (M <- M R)."""
    if stage.boundary_map is None:
        raise ValueError(f"stage {stage.spec.index} has no boundary map (the tail, or enable_frames was not called)")
    m = stage.boundary_map
    stage.boundary_map = (m.double() @ reorthogonalize(r)).to(m.dtype)  # a new tensor (see rotate_input)


def rotate_boundary(stages: list[Stage], boundary: int, r: Tensor, moments: Optional[Moments] = None,
                    v_mode: str = "mixed") -> None:
    """Apply rotation R at ``boundary`` (between stages ``boundary`` and ``boundary + 1``) to both sides."""
    rotate_output(stages[boundary], r)
    rotate_input(stages[boundary + 1], r, moments, v_mode)


def gain_groups(stage: Stage) -> list[tuple[str, list[str]]]:
    """(an input-side norm gain's parameter name, the reads after it), by parameter name; gain-free norms left out."""
    names = {n for n, _ in stage.named_parameters()}
    groups = []
    for layer in stage.layers:
        pre = f"layers.{layer}."
        groups.append((pre + "input_layernorm.weight", [f"{pre}{n}.weight" for n in READS_AFTER_INPUT_NORM]))
        groups.append((pre + "post_attention_layernorm.weight", [f"{pre}{n}.weight" for n in READS_AFTER_POST_NORM]))
    if stage.spec.is_tail:
        groups.append(("norm.weight", ["lm_head.weight"]))
    return [(g, reads) for g, reads in groups if g in names]


def current_gains(stage: Stage) -> dict[str, Tensor]:
    """The input-side norm gains as they are now (float64 copies): what the next rotation folds."""
    params = dict(stage.named_parameters())
    return {g: params[g].detach().double().clone() for g, _ in gain_groups(stage)}


@torch.no_grad()
def input_gradients(stage: Stage, grads: dict[str, Optional[Tensor]], r: Tensor, gains: dict[str, Tensor],
                    weights: Optional[dict[str, Tensor]] = None) -> dict[str, Optional[Tensor]]:
    """Gradients (by parameter name) taken in the frame before ``rotate_input(stage, r)``, moved to the frame after
    it. ``gains``: the gains that rotation folded (``current_gains`` just before it); ``weights``: the parameters
    the gradients were taken at (default: the stage's own, before the rotation). A backward that ran on weights of
    the old frame lands in the new one through this (server/runtime.py).

    Reads and writes move as Adam's first moment does (``rotate_input``'s m: G <- G diag(1/g) Q, G <- R^T G). A norm
    gain is not rotated: after the rotation it scales the coordinates of the new frame, so its gradient there is
    sum_i G'_ij W'_ij over the reads after it (G', W': their gradients and weights in the new frame, gain 1). Exact
    at ``weights``; for a microbatch that ran on older weights than the rotation folded, as stale as it is."""
    params = dict(stage.named_parameters())

    def at(name: str) -> Tensor:  # only the reads after a gain with a gradient are needed, in float64
        return (weights[name] if weights is not None and name in weights else params[name]).detach().double()

    out = dict(grads)
    r = reorthogonalize(r)
    q = lift(stage, r)
    u = stage.basis.double() if stage.subspace else None
    exact = as_signed_permutation(q)
    for gain, reads in gain_groups(stage):
        if exact is not None:  # nothing was folded: the gain was permuted, and so is its gradient
            if out.get(gain) is not None:
                out[gain] = out[gain].double()[exact[0]]
            continue
        g = gains.get(gain, torch.ones(1, dtype=torch.float64))
        if out.get(gain) is not None:
            moved = [(_read(out[n].double() / g, r, u, q), _read(at(n) * g, r, u, q)) for n in reads
                     if out.get(n) is not None]
            out[gain] = sum((gr * w).sum(dim=0) for gr, w in moved) if moved else out[gain]
        for name in reads:
            if out.get(name) is not None:
                out[name] = out[name].double() / g
    for name, role in weight_roles(stage):
        if out.get(name) is not None:
            out[name] = _move(role, out[name].double(), r, u, q, exact)
    return {n: (v.to(grads[n].dtype) if v is not None and grads.get(n) is not None else v) for n, v in out.items()}


@torch.no_grad()
def input_weights(stage: Stage, weights: dict[str, Tensor], r: Tensor, gains: dict[str, Tensor]) -> dict[str, Tensor]:
    """Parameters (by name, e.g. a weight snapshot) as ``rotate_input(stage, r)`` after folding ``gains`` would
    leave them: reads W diag(g) Q, gains w / g, writes R^T W (or Q^T W), the head's embedding Z R."""
    out = {n: w.detach().double() for n, w in weights.items()}
    r = reorthogonalize(r)
    q = lift(stage, r)
    u = stage.basis.double() if stage.subspace else None
    exact = as_signed_permutation(q)
    for gain, reads in gain_groups(stage):
        if exact is not None:  # a signed permutation folds nothing: the gain is permuted (``rotate_input``)
            if gain in out:
                out[gain] = out[gain][exact[0]]
            continue
        g = gains.get(gain, torch.ones(1, dtype=torch.float64))
        for name in reads:
            out[name] = out[name] * g
        out[gain] = out[gain] / g
    for name, role in weight_roles(stage):
        if name in out:
            out[name] = _move(role, out[name], r, u, q, exact)
    return {n: v.to(weights[n].dtype) for n, v in out.items()}


FRAME_KINDS = ("rotations", "signed_permutations")  # ``security.upm.transforms``


def frame_drawer(kind: str) -> Callable[[int, torch.Generator], Tensor]:
    """How a boundary's next transform is drawn for ``security.upm.transforms`` (``FRAME_KINDS``)."""
    if kind not in FRAME_KINDS:
        raise ValueError(f"frames must be one of {', '.join(FRAME_KINDS)}, got {kind!r}")
    return signed_permutation if kind == "signed_permutations" else haar_orthogonal


def signed_permutation(n: int, generator: torch.Generator) -> Tensor:
    """A random signed permutation (float64): the rotations under which Adam's second moment moves exactly."""
    perm = torch.randperm(n, generator=generator)
    signs = torch.randint(0, 2, (n,), generator=generator).double() * 2 - 1
    return torch.eye(n, dtype=torch.float64)[perm] * signs


@torch.no_grad()
def bake_frames(stages: list[Stage]) -> None:
    """Make every boundary map the identity and drop it, keeping the function: head first, stage p+1's input is
    rotated by M_p^T (so M_p becomes I and stage p+1 moves into stage p's frame). The result is an ordinary model
    in the head's frame (gains folded), which exports to formats without boundary maps (a Hugging Face folder)."""
    for p, stage in enumerate(stages[:-1]):
        if stage.boundary_map is None:
            continue
        nxt = stages[p + 1]
        if nxt.boundary_map is None and not nxt.spec.is_tail:
            enable_frames(nxt, allow_tied_copies=True)  # an identity map that takes the rotation of its output
        rotate_boundary(stages, p, stage.boundary_map.double().T.clone())
        stage.boundary_map = None

