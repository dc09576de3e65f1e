"""A Llama-style decoder that can be cut into pipeline stages, read top to bottom.

Two residual modes:

* ``dense``: a standard Llama (RMSNorm, RoPE, grouped-query attention, SwiGLU). Parameter names follow Hugging
  Face's ``LlamaForCausalLM`` (minus the ``model.`` prefix) so state dicts convert by renaming only.
* ``subspace``: the Protocol Models / Subspace Networks construction. A frozen token embedding ``F`` (V x d) and an
  orthonormal basis ``U`` (d x k) are derived from the run seed on every peer, with F drawn orthogonal to span(U).
  Every matrix that writes into the residual stream outputs k coordinates that are lifted by U^T, and branch
  outputs pass through a gain-free RMSNorm (a per-dimension gain would leave the subspace). Hence after every
  block ``x = F[tok] + c U^T`` exactly, and a stage boundary only has to carry ``c = x U`` (k numbers) plus the
  token id. The last stage sends nothing onwards, so its blocks are dense.

Stages are built independently (a peer only ever materialises its own stage), so every parameter is initialised
from a generator seeded by (run seed, global parameter name): a stage built alone is bit-identical to the same
slice of a full model.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from agora.config import Manifest, ModelShape

# --------------------------------------------------------------------------- seeded, split-independent init


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def seeded_randn(shape: tuple[int, ...], seed: int, name: str, std: float = 1.0) -> Tensor:
    gen = torch.Generator().manual_seed(_seed_for(seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def subspace_basis(shape: ModelShape, k: int, seed: int) -> Tensor:
    """U (d x k) with orthonormal columns, identical on every peer of the run."""
    q, _ = torch.linalg.qr(seeded_randn((shape.d_model, k), seed, "subspace.U").double())
    return q.float().contiguous()


def frozen_embedding(shape: ModelShape, basis: Tensor, seed: int) -> Tensor:
    """F (V x d), frozen, with F U = 0 so that c = x U and the UPM frame cannot be recovered from F (METHODS s7).

    Rows have norm ~ sqrt(k), the same as one normalised branch write, so the token identity is neither drowned
    nor dominant at initialisation.
    """
    k = basis.shape[1]
    table = seeded_randn((shape.vocab_size, shape.d_model), seed, "subspace.F", std=math.sqrt(k / shape.d_model))
    table = table.double()
    table -= (table @ basis.double()) @ basis.double().T
    return table.float().contiguous()


# --------------------------------------------------------------------------- building blocks


class RMSNorm(nn.Module):
    """RMSNorm with an optional per-dimension gain. Branch outputs in subspace mode must be gain-free."""

    def __init__(self, dim: int, eps: float, gain: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if gain else None

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        x = x.to(dtype)
        return x * self.weight if self.weight is not None else x


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    return x * cos + _rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, out_dim: int):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = shape.n_heads, shape.n_kv_heads, shape.head_dim
        d = shape.d_model
        self.q_proj = nn.Linear(d, self.n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv * self.hd, bias=False)
        # out_dim is d (dense write) or k (subspace write, lifted by U^T outside).
        self.o_proj = nn.Linear(self.n_heads * self.hd, out_dim, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, out_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(shape.d_model, shape.ffn_dim, bias=False)
        self.up_proj = nn.Linear(shape.d_model, shape.ffn_dim, bias=False)
        self.down_proj = nn.Linear(shape.ffn_dim, out_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    """Pre-norm transformer block. With ``basis`` set, both branches write k coordinates lifted by U^T."""

    def __init__(self, shape: ModelShape, basis: Optional[Tensor]):
        super().__init__()
        out_dim = shape.d_model if basis is None else basis.shape[1]
        self.subspace = basis is not None
        self.input_layernorm = RMSNorm(shape.d_model, shape.norm_eps)
        self.self_attn = Attention(shape, out_dim)
        self.post_attention_layernorm = RMSNorm(shape.d_model, shape.norm_eps)
        self.mlp = MLP(shape, out_dim)
        if self.subspace:
            self.branch_norm = RMSNorm(out_dim, shape.norm_eps, gain=False)

    def _write(self, x: Tensor, update: Tensor, basis: Optional[Tensor]) -> Tensor:
        if not self.subspace:
            return x + update
        return x + self.branch_norm(update) @ basis.T

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, basis: Optional[Tensor]) -> Tensor:
        x = self._write(x, self.self_attn(self.input_layernorm(x), cos, sin), basis)
        return self._write(x, self.mlp(self.post_attention_layernorm(x)), basis)


# --------------------------------------------------------------------------- a stage


@dataclass(frozen=True)
class StageSpec:
    index: int
    n_stages: int
    layers: range

    @property
    def is_head(self) -> bool:
        return self.index == 0

    @property
    def is_tail(self) -> bool:
        return self.index == self.n_stages - 1


class Stage(nn.Module):
    """The part of the model one peer holds: head (embedding + blocks), body (blocks) or tail (blocks + LM head).

    ``forward`` maps the residual stream entering the stage (or token ids, for the head) to the residual stream
    leaving it; ``loss`` applies the tail's final norm and LM head. Compression happens outside (``agora.wire``).
    """

    def __init__(self, manifest: Manifest, index: int):
        super().__init__()
        if not 0 <= index < manifest.n_stages:
            raise ValueError(f"stage {index} does not exist: the manifest has {manifest.n_stages} stages")
        shape = manifest.model
        self.manifest_hash = manifest.hash
        self.shape = shape
        self.spec = StageSpec(index, manifest.n_stages, manifest.stage_layers(index))
        self.subspace = manifest.residual.mode == "subspace"
        if self.subspace:
            basis = subspace_basis(shape, manifest.residual.k, manifest.seed)
            self.register_buffer("basis", basis, persistent=False)
            self.register_buffer("frozen_embed", frozen_embedding(shape, basis, manifest.seed), persistent=False)
        else:
            self.basis = None
            self.frozen_embed = None

        if self.spec.is_head:
            width = manifest.residual.k if self.subspace else shape.d_model
            self.embed_tokens = nn.Embedding(shape.vocab_size, width)
        # The tail sends nothing onwards, so its blocks may write densely.
        block_basis = self.basis if self.subspace and not self.spec.is_tail else None
        self.layers = nn.ModuleDict({str(i): Block(shape, block_basis) for i in self.spec.layers})
        if self.spec.is_tail:
            self.norm = RMSNorm(shape.d_model, shape.norm_eps)
            self.lm_head = nn.Linear(shape.d_model, shape.vocab_size, bias=False)
        cos, sin = rope_tables(shape.head_dim, shape.seq_len, shape.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters(manifest.seed)

    # ------------------------------------------------------------------ init
    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Parameter names are global (``layers.5.mlp.up_proj.weight``), so seeding by name splits cleanly."""
        n_layers = self.shape.n_layers
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
                continue
            std = 0.02
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                std = 0.02 / math.sqrt(2 * n_layers)  # GPT-2 style scaled init for residual writes
            p.copy_(seeded_randn(tuple(p.shape), seed, name, std))

    # ------------------------------------------------------------------ compute
    def embed(self, tokens: Tensor) -> Tensor:
        if not self.spec.is_head:
            raise RuntimeError(f"stage {self.spec.index} is not the head stage; it has no embedding")
        if self.subspace:
            return self.frozen_embed[tokens] + self.embed_tokens(tokens) @ self.basis.T
        return self.embed_tokens(tokens)

    def forward(self, x_or_tokens: Tensor) -> Tensor:
        """Residual stream in -> residual stream out. The head stage takes token ids [B, T] instead."""
        x = self.embed(x_or_tokens) if self.spec.is_head else x_or_tokens
        t = x.shape[1]
        if t > self.shape.seq_len:
            raise ValueError(f"sequence length {t} exceeds the manifest's seq_len {self.shape.seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        for block in self.layers.values():
            x = block(x, cos, sin, self.basis if block.subspace else None)
        return x

    def logits(self, x: Tensor) -> Tensor:
        if not self.spec.is_tail:
            raise RuntimeError(f"stage {self.spec.index} is not the tail stage; it has no LM head")
        return self.lm_head(self.norm(x))

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        logits = self.logits(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def build_stages(manifest: Manifest) -> list[Stage]:
    return [Stage(manifest, s) for s in range(manifest.n_stages)]


class PipelineModel(nn.Module):
    """All stages in one process: the centralized baseline and the reference for split-equivalence tests.

    Runs the stages back to back on the raw residual stream (no compression), i.e. the unsplit model.
    """

    def __init__(self, manifest: Manifest):
        super().__init__()
        self.manifest = manifest
        self.stages = nn.ModuleList(build_stages(manifest))

    def forward(self, tokens: Tensor) -> Tensor:
        x = tokens
        for stage in self.stages:
            x = stage(x)
        return self.stages[-1].logits(x)

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        x = tokens
        for stage in self.stages:
            x = stage(x)
        return self.stages[-1].loss(x, targets)


# --------------------------------------------------------------------------- size accounting


def count_parameters(manifest: Manifest) -> dict[str, int]:
    """Trainable parameters per stage and in total, computed from shapes (no allocation: works for 8B)."""
    shape, res = manifest.model, manifest.residual
    d, hd = shape.d_model, shape.head_dim
    attn_in = d * hd * (shape.n_heads + 2 * shape.n_kv_heads)
    mlp_in = 2 * d * shape.ffn_dim
    per_stage = []
    for s in range(manifest.n_stages):
        tail = s == manifest.n_stages - 1
        width = res.k if res.mode == "subspace" and not tail else d
        block = attn_in + shape.n_heads * hd * width + mlp_in + shape.ffn_dim * width + 2 * d
        n = block * manifest.stages[s]
        if s == 0:
            n += shape.vocab_size * (res.k if res.mode == "subspace" else d)
        if tail:
            n += d + shape.vocab_size * d
        per_stage.append(n)
    return {"per_stage": per_stage, "total": sum(per_stage)}


# Training bytes per fp32 parameter: the weight, its gradient, AdamW's two moments and the weight snapshot that
# microbatches in flight run on (``server/runtime.py``).
TRAIN_BYTES_PER_PARAMETER = 4 + 4 + 8 + 4


def stage_memory_bytes(manifest: Manifest, stage: Optional[int] = None) -> int:
    """A lower bound of the memory one stage (``None``: the whole model in one process, no weight snapshot) needs
    to train, before activations: parameters with their gradients, optimizer moments and weight snapshot, plus the
    subspace tables (the frozen embedding is built in float64)."""
    shape, res = manifest.model, manifest.residual
    counts = count_parameters(manifest)
    if stage is None:
        need = counts["total"] * (TRAIN_BYTES_PER_PARAMETER - 4)
    else:
        need = counts["per_stage"][stage] * TRAIN_BYTES_PER_PARAMETER
    if res.mode == "subspace":
        need += shape.vocab_size * shape.d_model * (4 + 8) + shape.d_model * res.k * 4
    return need + 2 * shape.seq_len * shape.head_dim * 4


def flops_per_token(manifest: Manifest) -> float:
    """Training FLOPs per token: 6 x (non-embedding-lookup parameters) + attention scores (Kaplan et al.)."""
    shape = manifest.model
    params = count_parameters(manifest)["total"]
    lookup = shape.vocab_size * (manifest.residual.k if manifest.residual.mode == "subspace" else shape.d_model)
    attention = 6 * shape.n_layers * shape.seq_len * shape.d_model  # QK^T and AV, forward + backward, causal avg
    return 6.0 * (params - lookup) + attention
