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

For decoding, ``Stage.forward(x, cache)`` takes only the new positions and keeps their keys and values in that
stage's ``KVCache``; without a cache the forward is the training one, unchanged.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from agora.config import Manifest, ModelShape
from agora.wire import compress, decompress

# --------------------------------------------------------------------------- seeded, split-independent init


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def seeded_randn(shape: tuple[int, ...], seed: int, name: str, std: float = 1.0) -> Tensor:
    gen = torch.Generator().manual_seed(_seed_for(seed, name))
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std


def subspace_basis(shape: ModelShape, k: int, seed: int, kind: str = "random") -> Tensor:
    """U (d x k) with orthonormal columns, identical on every peer of the run: ``random`` directions, or
    ``coordinates``: k of the d coordinates (in seed-drawn order), so that a signed permutation of the k subspace
    coordinates is a signed permutation of the whole stream, which Adam follows exactly (docs/UPM.md)."""
    if kind == "coordinates":
        gen = torch.Generator().manual_seed(_seed_for(seed, "subspace.coordinates"))
        picked = torch.randperm(shape.d_model, generator=gen)[:k]
        return torch.eye(shape.d_model, dtype=torch.float32)[:, picked].contiguous()
    if kind != "random":
        raise ValueError(f"subspace basis must be 'random' or 'coordinates', got {kind!r}")
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
        x = x.to(torch.promote_types(dtype, torch.float32))  # bf16 is normalised in fp32; fp64 stays fp64
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

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv: Optional["LayerKV"] = None) -> Tensor:
        """``x`` holds positions 0..t-1, or with ``kv`` the t positions after the ones already cached."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        mask, causal = None, True
        if kv is not None:
            k, v = kv.update(k, v)  # now every position so far, [B, n_kv, past + t, hd]
            mask, causal = _chunk_mask(t, k.shape[2], x.device)
        rep = self.n_heads // self.n_kv
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.hd))


def _chunk_mask(t: int, total: int, device: torch.device) -> tuple[Optional[Tensor], bool]:
    """Mask for t new queries at the end of ``total`` keys: query i (absolute position total - t + i) sees keys
    0..total - t + i. SDPA's ``is_causal`` aligns the triangle top-left, which is right only without a past."""
    if t == total:
        return None, True
    if t == 1:
        return None, False  # the newest position sees everything cached
    past = total - t
    return torch.ones(t, total, dtype=torch.bool, device=device).tril(diagonal=past), False


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

    def _write(self, x: Tensor, update: Tensor, basis: Optional[Tensor], scale: float) -> Tensor:
        if self.subspace:
            update = self.branch_norm(update) @ basis.T
        return x + (update if scale == 1.0 else update * scale)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, basis: Optional[Tensor], kv: Optional["LayerKV"] = None,
        scale: float = 1.0,
    ) -> Tensor:
        """``scale`` multiplies both residual writes: 1 but for a block that joined in the last ``ramp_steps``
        steps of an architecture warm-up (``write_scale``)."""
        x = self._write(x, self.self_attn(self.input_layernorm(x), cos, sin, kv), basis, scale)
        return self._write(x, self.mlp(self.post_attention_layernorm(x)), basis, scale)


# The attention kernels ``scaled_dot_product_attention`` may choose (process-wide flags), and what asks for each.
_SDPA_FLAGS = ((SDPBackend.FLASH_ATTENTION, torch.backends.cuda.flash_sdp_enabled),
               (SDPBackend.EFFICIENT_ATTENTION, torch.backends.cuda.mem_efficient_sdp_enabled),
               (SDPBackend.MATH, torch.backends.cuda.math_sdp_enabled),
               (SDPBackend.CUDNN_ATTENTION, torch.backends.cuda.cudnn_sdp_enabled))


def _recompute_with_the_forwards_kernels():
    """``checkpoint``'s context_fn: the recomputation uses the attention kernels the forward could use. Another
    thread (a curvature measurement of another node in this process) may have switched the flags in between, and a
    different kernel saves different tensors, which the checkpoint refuses."""
    enabled = [backend for backend, on in _SDPA_FLAGS if on()]
    return contextlib.nullcontext(), sdpa_kernel(enabled) if enabled else contextlib.nullcontext()


def _checkpointed(block: Block, x: Tensor, cos: Tensor, sin: Tensor, basis: Optional[Tensor], scale: float) -> Tensor:
    """``block(x)`` keeping only ``x`` for the backward, which recomputes the block first.

    The recomputation runs on the tensors the forward ran on, not on whatever the block holds at backward time: a
    stage that stashes weights runs its forwards on a snapshot (``torch.func.functional_call``), and its live
    parameters may have stepped before the backward comes. The model draws no random numbers, so the RNG state is
    not saved."""
    weights = dict(block.named_parameters())  # the snapshot's tensors while a functional_call runs

    def run(inp: Tensor) -> Tensor:
        return torch.func.functional_call(block, weights, (inp, cos, sin, basis), {"scale": scale})

    return checkpoint(run, x, use_reentrant=False, preserve_rng_state=False,
                      context_fn=_recompute_with_the_forwards_kernels)


# --------------------------------------------------------------------------- KV cache for incremental decoding


class KVCache:
    """One stage's keys and values for a batch of sequences, so that decoding feeds only the new positions.

    Self-contained and per stage: a server can keep one per session, and ``nbytes`` is all it holds. Buffers are
    allocated up front for ``capacity`` positions, so memory never grows past what a cap admitted. Keys are stored
    after RoPE and before grouped-query repetition, [B, n_kv_heads, capacity, head_dim] per layer.

    ``Stage.forward`` writes the new positions into every layer and advances ``length`` only after the last one, so
    a forward that fails halfway leaves the cache as it was and the same chunk can simply be sent again. The same
    holds in subspace mode: the layers see the rebuilt residual stream, the cache is no different.
    Inference only: use it under ``torch.no_grad()`` (a graph through the buffers would outlive the step).
    """

    def __init__(
        self,
        layers: Sequence[str],
        batch_size: int,
        n_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        if batch_size < 1 or capacity < 1:
            raise ValueError(f"a KV cache needs batch_size >= 1 and capacity >= 1, got {batch_size} and {capacity}")
        self.layers = tuple(layers)
        self.batch_size, self.capacity = batch_size, capacity
        self.length = 0  # positions cached so far, the same in every layer
        size = (batch_size, n_kv_heads, capacity, head_dim)
        self.keys = {n: torch.zeros(size, dtype=dtype, device=device) for n in self.layers}
        self.values = {n: torch.zeros(size, dtype=dtype, device=device) for n in self.layers}

    @classmethod
    def for_stage(
        cls,
        stage: "Stage",
        batch_size: int = 1,
        capacity: Optional[int] = None,
        dtype: Optional[torch.dtype] = None,
        device: torch.device | str | None = None,
    ) -> "KVCache":
        """A cache shaped for ``stage``; capacity defaults to the model's seq_len, dtype/device to its weights'."""
        shape = stage.shape
        capacity = shape.seq_len if capacity is None else capacity
        if capacity > shape.seq_len:
            raise ValueError(f"KV cache capacity {capacity} exceeds the model's seq_len {shape.seq_len}")
        weight = next(stage.parameters())
        return cls(
            list(stage.layers),
            batch_size,
            shape.n_kv_heads,
            shape.head_dim,
            capacity,
            dtype or weight.dtype,
            device or weight.device,
        )

    @staticmethod
    def nbytes_for(
        shape: ModelShape, n_layers: int, batch_size: int, capacity: int, dtype: torch.dtype = torch.float32
    ) -> int:
        """Bytes a cache of these dimensions holds, before allocating it (for admission control)."""
        per_layer = 2 * batch_size * shape.n_kv_heads * capacity * shape.head_dim
        return n_layers * per_layer * (torch.finfo(dtype).bits // 8)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.keys.values(), *self.values.values()])

    def layer(self, name: str) -> "LayerKV":
        return LayerKV(self, name)

    def check_room(self, batch_size: int, t: int) -> None:
        """Raise unless ``t`` more positions of ``batch_size`` sequences fit."""
        if t < 1:
            raise ValueError("nothing to decode: the input holds no positions")
        if batch_size != self.batch_size:
            raise ValueError(f"KV cache holds {self.batch_size} sequences but the input has {batch_size}")
        if self.length + t > self.capacity:
            raise ValueError(
                f"KV cache is full: it holds {self.length} of {self.capacity} positions, {t} more do not fit"
            )

    def advance(self, t: int) -> None:
        """Mark ``t`` positions written by every layer as cached (``Stage.forward`` calls this at its end)."""
        self.length += t

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (0: start a new sequence; the buffers are kept)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a KV cache of {self.length} positions to {length}")
        self.length = length


class LayerKV:
    """One layer's view of a ``KVCache``: stores the new keys/values after the cached ones and returns them all."""

    def __init__(self, cache: KVCache, name: str):
        self.cache, self.name = cache, name

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        keys, values = self.cache.keys[self.name], self.cache.values[self.name]
        if k.requires_grad or v.requires_grad:
            raise RuntimeError("the KV cache is for inference: run the stage under torch.no_grad()")
        if k.dtype != keys.dtype or k.device != keys.device:
            raise ValueError(
                f"KV cache holds {keys.dtype} on {keys.device} but layer {self.name} made {k.dtype} on {k.device}:"
                " build the cache with the dtype and device the stage computes in"
            )
        start = self.cache.length
        end = start + k.shape[2]
        keys[:, :, start:end] = k
        values[:, :, start:end] = v
        return keys[:, :, :end], values[:, :, :end]


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
        self.manifest = manifest  # the warm-up's schedule (set_step) reads it
        self.manifest_hash = manifest.hash
        self.shape = shape
        self.spec = StageSpec(index, manifest.n_stages, manifest.stage_layers(index))
        self.subspace = manifest.residual.mode == "subspace"
        if self.subspace:
            basis = subspace_basis(shape, manifest.residual.k, manifest.seed, manifest.residual.basis)
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
            if shape.tie_embeddings and self.spec.is_head:
                self.lm_head.weight = self.embed_tokens.weight  # one stage holds both ends: one matrix
        cos, sin = rope_tables(shape.head_dim, shape.seq_len, shape.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        # UPM (agora.frames): the map from this stage's frame into the next stage's, float64, k x k (subspace) or
        # d x d (dense). None: no frames, the identity.
        self.register_buffer("boundary_map", None)
        # Architecture warm-up: blocks with a global index >= active_depth are bypassed (x passes through), and a
        # block that joined recently writes at a scale below 1 (``write_scales``, by name; 1 when absent).
        self.active_depth = active_depth(manifest, 0)
        self.write_scales: dict[str, float] = {}
        # Per-block activation checkpointing (a node's ``--checkpoint-blocks``): a training forward keeps only each
        # block's input, and the backward recomputes one block at a time. Same gradients, less memory.
        self.checkpoint_blocks = False
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
            if name == "lm_head.weight" and self.shape.tie_embeddings:
                name = "embed_tokens.weight"  # the tail's copy of a tied embedding starts equal to the head's
            p.copy_(seeded_randn(tuple(p.shape), seed, name, std))

    # ------------------------------------------------------------------ compute
    def embed(self, tokens: Tensor) -> Tensor:
        if not self.spec.is_head:
            raise RuntimeError(f"stage {self.spec.index} is not the head stage; it has no embedding")
        if self.subspace:
            return self.frozen_embed[tokens] + self.embed_tokens(tokens) @ self.basis.T
        return self.embed_tokens(tokens)

    def forward(self, x_or_tokens: Tensor, cache: Optional[KVCache] = None) -> Tensor:
        """Residual stream in -> residual stream out. The head stage takes token ids [B, T] instead.

        With ``cache`` the input holds only the positions after the ``cache.length`` already cached (a prompt
        chunk, or one token); they attend to the cached ones and are appended to the cache.
        """
        if cache is not None:
            return self._forward_cached(x_or_tokens, cache)
        x = self.embed(x_or_tokens) if self.spec.is_head else x_or_tokens
        t = x.shape[1]
        if t > self.shape.seq_len:
            raise ValueError(f"sequence length {t} exceeds the manifest's seq_len {self.shape.seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        recompute = self.checkpoint_blocks and torch.is_grad_enabled()
        for name, block in self.layers.items():
            if int(name) < self.active_depth:
                basis, scale = self.basis if block.subspace else None, self.write_scales.get(name, 1.0)
                x = (_checkpointed(block, x, cos, sin, basis, scale) if recompute
                     else block(x, cos, sin, basis, scale=scale))
        return self._to_next_frame(x)

    # ------------------------------------------------------------------ architecture warm-up
    @torch.no_grad()
    def grow_to(self, depth: int) -> list[str]:
        """Activate every block below global index ``depth``; a block that joins gets zeroed output projections, so
        it adds nothing to the residual stream and the stage computes the same function (in subspace mode its
        write stays zero, so the residual stays in the subspace). Returns the blocks that joined."""
        joined = [name for name in self.layers if self.active_depth <= int(name) < depth]
        for name in joined:
            block = self.layers[name]
            block.self_attn.o_proj.weight.zero_()
            block.mlp.down_proj.weight.zero_()
        self.active_depth = max(self.active_depth, depth)
        return joined

    def set_step(self, step: int) -> None:
        """Compute as at clock ``step`` of the architecture warm-up (``active_depth``): its depth and its joined
        blocks' write scales (no weight changes: ``grow_for_step`` zeroes the blocks that join)."""
        self.active_depth = active_depth(self.manifest, step)
        self.write_scales = {name: s for name in self.layers
                             if (s := write_scale(self.manifest, int(name), step)) != 1.0}

    def grow_for_step(self, step: int) -> list[str]:
        """The blocks due at ``step`` join (``grow_to``) and the ramps move on (``set_step``); the names joined."""
        joined = self.grow_to(active_depth(self.manifest, step))
        self.set_step(step)
        return joined

    def inactive_parameters(self) -> list[nn.Parameter]:
        """Parameters of bypassed blocks: frozen, and kept out of the optimizer (no gradient, no decay)."""
        return [p for name, block in self.layers.items() if int(name) >= self.active_depth
                for p in block.parameters()]

    def _to_next_frame(self, x: Tensor) -> Tensor:
        """x Q(M): the residual stream in the next stage's frame (UPM). In subspace runs F U = 0, so only the k
        coordinates move: (x - c U^T) + (c M) U^T with c = x U. Written so, not as x + (c M - c) U^T: on a coordinate
        basis with a signed permutation M every operation is then exact (zeroing k coordinates, then filling them)."""
        m = self.boundary_map
        if m is None:
            return x
        m = m.to(x.dtype)
        if not self.subspace:
            return x @ m
        u = self.basis.to(x.dtype)
        c = x @ u
        return (x - c @ u.T) + (c @ m) @ u.T

    def _forward_cached(self, x_or_tokens: Tensor, cache: KVCache) -> Tensor:
        if cache.layers != tuple(self.layers):
            raise ValueError(
                f"this KV cache holds layers {list(cache.layers)}, stage {self.spec.index} has {list(self.layers)}"
            )
        b, t = x_or_tokens.shape[:2]
        start = cache.length
        if start + t > self.shape.seq_len:
            raise ValueError(
                f"decoding past seq_len: {start} positions are cached and {t} more would make {start + t}, "
                f"beyond the model's seq_len {self.shape.seq_len}"
            )
        cache.check_room(b, t)
        x = self.embed(x_or_tokens) if self.spec.is_head else x_or_tokens
        cos, sin = self.rope_cos[start : start + t], self.rope_sin[start : start + t]
        for name, block in self.layers.items():
            if int(name) < self.active_depth:
                x = block(x, cos, sin, self.basis if block.subspace else None, cache.layer(name),
                          scale=self.write_scales.get(name, 1.0))
        cache.advance(t)
        return self._to_next_frame(x)

    def logits(self, x: Tensor) -> Tensor:
        if not self.spec.is_tail:
            raise RuntimeError(f"stage {self.spec.index} is not the tail stage; it has no LM head")
        return self.lm_head(self.norm(x))

    def loss(self, x: Tensor, targets: Tensor) -> Tensor:
        logits = self.logits(x)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))


def active_depth(manifest: Manifest, step: int) -> int:
    """Blocks active (global index below it) after ``step`` steps of the warm-up clock (optimizer steps in mode
    ``steps``; those the curvature did not hold in mode ``curvature``): ``model.n_layers`` without
    ``training.warmup_depth``; with it, ``start_depth`` at step 0, one more block at a time, all of them from
    ``until * optimizer.total_steps`` on."""
    n = manifest.model.n_layers
    warm = manifest.training.warmup_depth
    if warm is None:
        return n
    full_at = warm.until * manifest.optimizer.total_steps
    return min(n, warm.start_depth + math.floor(step * (n - warm.start_depth) / full_at))


def join_step(manifest: Manifest, layer: int) -> int:
    """The first step at which block ``layer`` (global index) is active: 0 without a warm-up or for the first
    ``start_depth`` blocks, and never beyond ``until * total_steps``."""
    if layer < active_depth(manifest, 0):
        return 0
    lo, hi = 0, max(1, math.ceil(manifest.training.warmup_depth.until * manifest.optimizer.total_steps))
    while lo < hi:  # the smallest step whose depth includes the block (active_depth only grows with the step)
        mid = (lo + hi) // 2
        if active_depth(manifest, mid) > layer:
            hi = mid
        else:
            lo = mid + 1
    return lo


def ramp_steps(manifest: Manifest) -> int:
    """Steps over which a joined block's write grows to full size: ``ramp_steps``, by default the steps between two
    joins (so a block reaches full size when the next one joins); 1 without a warm-up."""
    warm = manifest.training.warmup_depth
    if warm is None:
        return 1
    if warm.ramp_steps is not None:
        return warm.ramp_steps
    joins = manifest.model.n_layers - warm.start_depth
    return max(1, round(warm.until * manifest.optimizer.total_steps / joins))


def write_scale(manifest: Manifest, layer: int, step: int) -> float:
    """The factor on block ``layer``'s residual writes at step ``step`` of the warm-up's clock:
    ``(step - joined + 1) / R`` up to 1, where ``joined`` is its join step and R is ``ramp_steps``.

    Why: a joined block starts with zeroed output projections, but its first update is not small: Adam's first
    step moves every weight by about the learning rate, and in subspace mode the write passes through a gain-less
    RMSNorm that makes any non-zero write full size. Measured on ``small`` at 10x the learning rate without it, the
    training loss jumped from 7.8 to 22.0 as the last blocks joined. At the join step the scale is ``1 / R`` on a
    zero write (the function is unchanged, and the block still gets a gradient)."""
    ramp = ramp_steps(manifest)
    if ramp == 1 or manifest.training.warmup_depth is None:
        return 1.0
    joined = join_step(manifest, layer)
    if step < joined or joined == 0:
        return 1.0  # bypassed (the scale is not used) or active from the start
    return min(1.0, (step - joined + 1) / ramp)


# Curvature-mode warm-up: the measurement a step's decision reads is at least this many steps old, so every replica
# of every stage has published its own (after the measurement's step) before anyone reads it.
WARMUP_LAG_STEPS = 2


def warmup_end(manifest: Manifest) -> int:
    """The warm-up clock's value from which every block is active at full scale (0 without a warm-up)."""
    if manifest.training.warmup_depth is None:
        return 0
    return join_step(manifest, manifest.model.n_layers - 1) + ramp_steps(manifest) - 1


def warmup_measurement(manifest: Manifest, step: int) -> Optional[int]:
    """Curvature mode: the measurement (by the optimizer step after which it was taken) that decides whether the
    warm-up clock advances with optimizer step ``step`` (taken from ``step`` to ``step + 1``): the latest one at
    least ``WARMUP_LAG_STEPS`` old; None before the first one (the clock advances)."""
    every = manifest.training.warmup_depth.curvature_every
    m = (step - WARMUP_LAG_STEPS) // every * every
    return m if m >= every else None


def tied_parameter(stage: Stage) -> Optional[nn.Parameter]:
    """This stage's copy of a tied embedding (the head's embedding, the tail's LM head), or None when the stage
    holds none, or holds both ends itself (one stage: one matrix)."""
    if not stage.shape.tie_embeddings or stage.spec.n_stages == 1:
        return None
    if stage.spec.is_head:
        return stage.embed_tokens.weight
    return stage.lm_head.weight if stage.spec.is_tail else None


def build_stages(manifest: Manifest) -> list[Stage]:
    return [Stage(manifest, s) for s in range(manifest.n_stages)]


class PipelineModel(nn.Module):
    """All stages in one process: the centralized baseline and the reference for split-equivalence tests.

    Runs the stages back to back on the raw residual stream (no compression), i.e. the unsplit model. With
    ``wire_boundaries`` each boundary goes through what a swarm does there instead (``wire.compress`` and ``decompress``: the
    projection onto the subspace, the wire dtype's rounding both ways, the rebuild): the same function in exact
    arithmetic, rounded as a one-replica swarm rounds it.
    """

    def __init__(self, manifest: Manifest, wire_boundaries: bool = False):
        super().__init__()
        self.manifest = manifest
        self.wire_boundaries = wire_boundaries
        self.stages = nn.ModuleList(build_stages(manifest))
        head, tail = self.stages[0], self.stages[-1]
        if manifest.model.tie_embeddings and head is not tail:
            # In one process a tied model is truly tied: the tail's copy is dropped for the head's matrix, so
            # both ends' gradients land in one tensor (in a swarm each end keeps its own copy, ARCHITECTURE.md).
            tail.lm_head.weight = head.embed_tokens.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.stages[-1].logits(self._residual(tokens))

    def loss(self, tokens: Tensor, targets: Tensor) -> Tensor:
        return self.stages[-1].loss(self._residual(tokens), targets)

    def _residual(self, tokens: Tensor) -> Tensor:
        """The residual stream after the last stage's blocks."""
        x = tokens
        for i, stage in enumerate(self.stages):
            if self.wire_boundaries and i > 0:
                # compress/decompress are differentiable: the casts to and from the wire dtype round the gradient
                # on its way back as a stage sending it would
                basis = stage.basis if self.manifest.residual.mode == "subspace" else None
                sent = compress(x.float(), tokens, basis, self.manifest.residual.wire_dtype)
                x = decompress(sent, basis, stage.frozen_embed)
            x = stage(x)
        return x

    def grow_for_step(self, step: int) -> list[str]:
        """Architecture warm-up: activate the blocks due after ``step`` optimizer steps and move the joined blocks'
        write ramps on (``Stage.grow_for_step``)."""
        return [name for stage in self.stages for name in stage.grow_for_step(step)]


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
        if tail and not (shape.tie_embeddings and s == 0):
            n += d + shape.vocab_size * d
        elif tail:
            n += d
        per_stage.append(n)
    total = sum(per_stage)
    if shape.tie_embeddings and manifest.n_stages > 1:
        total -= shape.vocab_size * d  # the tail's copy of the embedding is the same parameter, counted once
    return {"per_stage": per_stage, "total": total}


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


def flops_per_token(manifest: Manifest, stage: Optional[int] = None) -> float:
    """Training FLOPs per token of the whole model (or of one ``stage``): 6 x (non-embedding-lookup parameters) +
    attention scores (Kaplan et al.)."""
    shape = manifest.model
    counts = count_parameters(manifest)
    params = counts["total"] if stage is None else counts["per_stage"][stage]
    lookup = shape.vocab_size * (manifest.residual.k if manifest.residual.mode == "subspace" else shape.d_model)
    if stage is None and shape.tie_embeddings:
        lookup = 0  # the one shared matrix is counted once, and as the LM head it does multiply
    elif stage not in (None, 0):
        lookup = 0  # only the head looks tokens up
    layers = shape.n_layers if stage is None else manifest.stages[stage]
    attention = 6 * layers * shape.seq_len * shape.d_model  # QK^T and AV, forward + backward, causal avg
    return 6.0 * (params - lookup) + attention
