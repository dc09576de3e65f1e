"""The neutral form every checkpoint reader produces, and the Llama tensor layout it must match."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


class UnsupportedCheckpoint(ValueError):
    """The checkpoint describes a network agora's dense Llama cannot reproduce; the message names the field."""

    def __init__(self, field_name: str, value: object, why: str, source: str = "") -> None:
        self.field = field_name
        self.value = value
        where = f"{source}: " if source else ""
        super().__init__(f"{where}unsupported {field_name}={value!r}: {why}")


@dataclass
class LoadedCheckpoint:
    """A pretrained Llama read from disk, independent of the file format it came in.

    ``shape`` holds keyword arguments for ``agora.config.ModelShape``. ``state`` uses Hugging Face
    ``LlamaForCausalLM`` names and layout (rotary rows in HF's half-split order), float32, and has no
    ``lm_head.weight`` when the embeddings are tied.
    """

    shape: dict
    state: dict[str, Tensor]
    tokenizer_json: Optional[str]
    source: str
    eos_token_id: Optional[int] = None
    bos_token_id: Optional[int] = None

    @property
    def tied(self) -> bool:
        return bool(self.shape["tie_embeddings"])

    def n_parameters(self) -> int:
        return sum(t.numel() for t in self.state.values())


def make_shape(
    *,
    vocab_size: int,
    d_model: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    ffn_dim: int,
    seq_len: int,
    rope_theta: float,
    norm_eps: float,
    tie_embeddings: bool,
    source: str,
) -> dict:
    """The ``ModelShape`` kwargs, after the checks a reader can make before touching any tensor."""
    for name, value in (("n_heads", n_heads), ("n_kv_heads", n_kv_heads), ("d_model", d_model)):
        if value <= 0:
            raise ValueError(f"{source}: {name} must be positive, got {value}")
    if d_model % n_heads:
        raise UnsupportedCheckpoint("n_heads", n_heads, f"does not divide the hidden size {d_model}", source)
    if n_heads % n_kv_heads:
        raise UnsupportedCheckpoint("n_kv_heads", n_kv_heads, f"does not divide n_heads={n_heads}", source)
    if (d_model // n_heads) % 2:
        raise UnsupportedCheckpoint("head_dim", d_model // n_heads, "RoPE needs an even head size", source)
    return dict(
        vocab_size=int(vocab_size),
        d_model=int(d_model),
        n_layers=int(n_layers),
        n_heads=int(n_heads),
        n_kv_heads=int(n_kv_heads),
        ffn_dim=int(ffn_dim),
        seq_len=int(seq_len),
        rope_theta=float(rope_theta),
        norm_eps=float(norm_eps),
        tie_embeddings=bool(tie_embeddings),
    )


def expected_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of an HF ``LlamaForCausalLM`` with this shape, by name (``lm_head`` only when untied)."""
    d, f, v = shape["d_model"], shape["ffn_dim"], shape["vocab_size"]
    head_dim = d // shape["n_heads"]
    kv = shape["n_kv_heads"] * head_dim
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, d)}
    for i in range(shape["n_layers"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (d,)
        out[p + "self_attn.q_proj.weight"] = (d, d)
        out[p + "self_attn.k_proj.weight"] = (kv, d)
        out[p + "self_attn.v_proj.weight"] = (kv, d)
        out[p + "self_attn.o_proj.weight"] = (d, d)
        out[p + "post_attention_layernorm.weight"] = (d,)
        out[p + "mlp.gate_proj.weight"] = (f, d)
        out[p + "mlp.up_proj.weight"] = (f, d)
        out[p + "mlp.down_proj.weight"] = (d, f)
    out["model.norm.weight"] = (d,)
    if not shape["tie_embeddings"]:
        out["lm_head.weight"] = (v, d)
    return out


def check_state(state: dict[str, Tensor], shape: dict, source: str) -> None:
    """Refuse a state dict that is not exactly the tensors (and sizes) of the Llama ``shape`` describes.

    Extra tensors are refused rather than dropped: a bias or an extra norm means a different network, and
    silently ignoring it would load a model that computes something else.
    """
    want = expected_shapes(shape)
    missing = [k for k in want if k not in state]
    if missing:
        raise ValueError(f"{source}: tensors missing from the checkpoint: {missing[:5]} ({len(missing)} in all)")
    extra = sorted(set(state) - set(want))
    if extra:
        raise UnsupportedCheckpoint(
            "tensor", extra[0], f"not part of a bias-free Llama ({len(extra)} such tensors: {extra[:5]})", source
        )
    for name, size in want.items():
        if tuple(state[name].shape) != size:
            raise ValueError(f"{source}: {name} has shape {tuple(state[name].shape)}, the config implies {size}")
        if state[name].dtype != torch.float32:
            raise AssertionError(f"{name} was not cast to float32")  # a reader bug, not bad input
