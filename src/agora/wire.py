"""What crosses a stage boundary, and its exact compression.

In subspace mode the residual stream is ``x = F[tok] + c U^T`` with F orthogonal to U, so ``c = x U`` (k numbers per
token) plus the token id rebuild x exactly. Reconstruction is affine in c, so autograd through ``decompress`` makes
the backward message (the gradient w.r.t. c) k-wide too. In dense mode the whole d-wide residual is sent.

Token ids travel as an int32 side tensor: fp16/bf16 cannot hold ids above 2048/256 exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import Tensor

WIRE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Boundary:
    """One boundary message: ``coords`` is [B, T, k] (subspace) or [B, T, d] (dense); ``tokens`` is [B, T] int32."""

    coords: Tensor
    tokens: Tensor
    mode: Literal["dense", "subspace"]

    @property
    def nbytes(self) -> int:
        return self.coords.numel() * self.coords.element_size() + self.tokens.numel() * self.tokens.element_size()

    @property
    def n_tokens(self) -> int:
        return self.tokens.numel()


def compress(
    x: Tensor,
    tokens: Tensor,
    basis: Optional[Tensor],
    wire_dtype: str = "fp32",
) -> Boundary:
    """Residual stream -> boundary message. ``basis`` is U (subspace mode) or None (dense).

    Differentiable: calling ``.backward`` on the decompressed tensor on the far side and sending back
    ``coords.grad`` gives the sender exactly ``dL/dx`` projected where x can move, which is all of it.
    """
    dtype = WIRE_DTYPES[wire_dtype]
    if basis is None:
        return Boundary(coords=x.to(dtype), tokens=tokens.to(torch.int32), mode="dense")
    # F U = 0, so the coordinates are the projection of x itself onto U.
    return Boundary(coords=(x @ basis).to(dtype), tokens=tokens.to(torch.int32), mode="subspace")


def decompress(
    boundary: Boundary,
    basis: Optional[Tensor],
    frozen_embed: Optional[Tensor],
    compute_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Boundary message -> residual stream. Exact up to the wire dtype's rounding of the coordinates."""
    coords = boundary.coords.to(compute_dtype)
    if boundary.mode == "dense":
        return coords
    if basis is None or frozen_embed is None:
        raise ValueError("a subspace boundary needs the run's basis U and frozen embedding F to decompress")
    return frozen_embed[boundary.tokens.long()] + coords @ basis.T


def bytes_per_token(d_model: int, mode: str, k: Optional[int], wire_dtype: str) -> int:
    """Bytes one token costs at a boundary: coordinates plus the int32 token id."""
    width = d_model if mode == "dense" else int(k)
    return width * torch.finfo(WIRE_DTYPES[wire_dtype]).bits // 8 + 4


def relative_reconstruction_error(x: Tensor, tokens: Tensor, basis: Tensor, frozen_embed: Tensor) -> float:
    """max |x - decompress(compress(x))| / max |x|, in fp32: the subspace invariant check."""
    rebuilt = decompress(compress(x, tokens, basis, "fp32"), basis, frozen_embed)
    return float(((x - rebuilt).abs().max() / x.abs().max().clamp_min(1e-30)).detach())
