"""Read a llama.cpp GGUF file holding a Llama: dequantize every tensor and put it back in Hugging Face layout.

Two things differ from HF besides names. GGUF lists dimensions fastest-first, so a ``[576, 1536]`` tensor there
is HF's ``(1536, 576)`` (the reader's numpy arrays already come in that row-major order). And llama.cpp's
converter reorders the rows of ``attn_q``/``attn_k`` inside each head, because ggml rotates adjacent pairs
while HF rotates the two halves of the head; we undo that so the tensors work with half-split RoPE again.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize
from torch import Tensor

from agora.interop.base import LoadedCheckpoint, UnsupportedCheckpoint, check_state, make_shape
from agora.interop.gguf_tokenizer import build_tokenizer_json

_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_UNQUANTIZED = {GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16}


def load_gguf(path: str | Path) -> LoadedCheckpoint:
    """Load a ``general.architecture = llama`` GGUF file as float32 HF ``LlamaForCausalLM`` tensors."""
    file = Path(path)
    source = f"gguf:{file}"
    if not file.is_file():
        raise FileNotFoundError(f"{source}: no such file")
    try:
        reader = GGUFReader(str(file))
    except (ValueError, OSError) as exc:  # bad magic, truncated file, ...
        raise ValueError(f"{source}: not a readable GGUF file ({exc})") from None
    meta = {key: _value(reader, key) for key in reader.fields if not key.startswith("tokenizer.")}

    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedCheckpoint("general.architecture", arch, "only llama GGUF files load", source)
    shape = _shape(reader, meta, source)
    state, quant_types = _tensors(reader, shape, source)
    check_state(state, shape, source)

    tokenizer_meta = {key: _value(reader, key) for key in reader.fields if key.startswith("tokenizer.ggml.")}
    kinds = ", ".join(sorted(quant_types)) or "F32"
    return LoadedCheckpoint(
        shape=shape,
        state=state,
        tokenizer_json=build_tokenizer_json(tokenizer_meta, source),
        source=f"{source} ({kinds} dequantized)" if quant_types - {"F32"} else source,
        eos_token_id=_opt_int(tokenizer_meta.get("tokenizer.ggml.eos_token_id")),
        bos_token_id=_opt_int(tokenizer_meta.get("tokenizer.ggml.bos_token_id")),
    )


def _shape(reader: GGUFReader, meta: dict[str, Any], source: str) -> dict:
    def need(key: str) -> Any:
        value = meta.get(f"llama.{key}")
        if value is None:
            raise ValueError(f"{source}: metadata key llama.{key} is missing")
        return value

    heads = need("attention.head_count")
    kv_heads = meta.get("llama.attention.head_count_kv", heads)
    for key, value in (("attention.head_count", heads), ("attention.head_count_kv", kv_heads)):
        if isinstance(value, list):
            raise UnsupportedCheckpoint(f"llama.{key}", value, "a different head count per layer", source)
    d_model = int(need("embedding_length"))
    head_dim = d_model // int(heads)

    # Features of llama.cpp's llama architecture that agora's Llama does not have.
    scaling = meta.get("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedCheckpoint("llama.rope.scaling.type", scaling, "agora implements plain RoPE only", source)
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise UnsupportedCheckpoint("tensor", "rope_freqs.weight", "per-frequency RoPE scaling (Llama 3.1+)", source)
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = meta.get(f"llama.{key}")
        if value is not None and int(value) != head_dim:
            raise UnsupportedCheckpoint(f"llama.{key}", value, f"agora requires it to equal {head_dim}", source)
    experts = meta.get("llama.expert_count")
    if experts:
        raise UnsupportedCheckpoint("llama.expert_count", experts, "mixture-of-experts is not supported", source)

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = len(tokens.data) if tokens is not None else meta.get("llama.vocab_size")
    if vocab is None:
        raise ValueError(f"{source}: neither tokenizer.ggml.tokens nor llama.vocab_size gives the vocabulary size")
    return make_shape(
        vocab_size=int(vocab),
        d_model=d_model,
        n_layers=int(need("block_count")),
        n_heads=int(heads),
        n_kv_heads=int(kv_heads),
        ffn_dim=int(need("feed_forward_length")),
        seq_len=int(need("context_length")),
        rope_theta=float(meta.get("llama.rope.freq_base", 10000.0)),  # llama.cpp's default when absent
        norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        # No separate output matrix means llama.cpp reuses token_embd for the logits.
        tie_embeddings=not any(t.name == "output.weight" for t in reader.tensors),
        source=source,
    )


def _tensors(reader: GGUFReader, shape: dict, source: str) -> tuple[dict[str, Tensor], set[str]]:
    state: dict[str, Tensor] = {}
    kinds: set[str] = set()
    for tensor in reader.tensors:
        name = _hf_name(tensor.name, source)
        qtype = GGMLQuantizationType(tensor.tensor_type)
        if qtype not in _UNQUANTIZED or len(tensor.shape) > 1:
            kinds.add(qtype.name)  # norms are always F32; the matrices say what the file really is
        dims = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists the fastest dimension first
        try:
            values = dequantize(tensor.data, qtype)
        except NotImplementedError:
            raise UnsupportedCheckpoint(
                "tensor type", qtype.name, f"gguf {_gguf_version()} cannot dequantize it ({tensor.name})", source
            ) from None
        values = values.reshape(dims).astype(np.float32, copy=False)
        if not values.flags.writeable:  # an F32 tensor is a view into the memory-mapped file
            values = values.copy()
        weight = torch.from_numpy(values)
        if name.endswith("q_proj.weight"):
            weight = unpermute_rotary(weight, shape["n_heads"])
        elif name.endswith("k_proj.weight"):
            weight = unpermute_rotary(weight, shape["n_kv_heads"])
        if name in state:
            raise ValueError(f"{source}: tensor {tensor.name} appears twice")
        state[name] = weight.contiguous()
    return state, kinds


def unpermute_rotary(weight: Tensor, n_heads: int) -> Tensor:
    """Undo llama.cpp's reordering of q/k projection rows within each head.

    For RoPE ggml pairs row 2j with row 2j+1 of a head, HF pairs row j with row j + head_dim/2, so the converter
    stored HF row j at position 2j and HF row j + head_dim/2 at 2j+1. Reading each head's rows as (j, s) pairs and
    swapping the two axes gives HF's order (s, j) back.
    """
    rows = weight.shape[0]
    if rows % n_heads or (rows // n_heads) % 2:
        raise ValueError(f"cannot split {rows} rows into {n_heads} heads of even size")
    half = rows // n_heads // 2
    return weight.reshape(n_heads, half, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def _hf_name(name: str, source: str) -> str:
    if name in _TOP_NAMES:
        return _TOP_NAMES[name]
    match = _BLOCK.fullmatch(name)
    if match and match.group(2) in _BLOCK_NAMES:
        return f"model.layers.{int(match.group(1))}.{_BLOCK_NAMES[match.group(2)]}.weight"
    raise UnsupportedCheckpoint("tensor", name, "not part of a bias-free Llama", source)


def _value(reader: GGUFReader, key: str) -> Any:
    """A metadata value as plain Python (str, int, float, bool, or a list of those)."""
    field = reader.fields[key]
    kinds = field.types

    def scalar(kind: GGUFValueType, part: np.ndarray) -> Any:
        if kind == GGUFValueType.STRING:
            return bytes(part).decode("utf-8")
        if kind == GGUFValueType.FLOAT32:
            # The shortest decimal that is the same float32: 1e-5 rather than 9.999999747378752e-06, which is
            # what the converter was given and what a config written from it should say.
            return float(str(part[0]))
        return part.tolist()[0]

    if kinds[0] == GGUFValueType.ARRAY:
        if len(kinds) < 2:
            return []
        if kinds[1] == GGUFValueType.ARRAY:
            raise ValueError(f"metadata key {key}: nested arrays are not read")
        return [scalar(kinds[1], field.parts[i]) for i in field.data]
    return scalar(kinds[0], field.parts[field.data[0]])


def _opt_int(value: Any) -> Optional[int]:
    return int(value) if value is not None else None


def _gguf_version() -> str:
    from importlib.metadata import version

    return version("gguf")
