"""Read a Hugging Face model folder (``config.json`` + safetensors, sharded or not) holding a Llama."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import torch
from safetensors import safe_open
from torch import Tensor

from agora.interop.base import LoadedCheckpoint, UnsupportedCheckpoint, check_state, make_shape

_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}


def load_hf_folder(path: str | Path) -> LoadedCheckpoint:
    """Load a ``LlamaForCausalLM`` (or sliding-window-free Mistral) folder as float32 HF-named tensors."""
    folder = Path(path)
    source = f"hf:{folder}"
    config_file = folder / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{source}: no config.json in this folder; is it a Hugging Face model folder?")
    try:
        config = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: expected a JSON object")

    shape = _shape_from_config(config, source)
    state = _read_weights(folder, source)
    state = {k: v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}  # a buffer, recomputed
    if shape["tie_embeddings"] and "lm_head.weight" in state:
        head = state.pop("lm_head.weight")
        embed = state.get("model.embed_tokens.weight")
        if embed is not None and not torch.equal(head, embed):
            raise UnsupportedCheckpoint(
                "tie_word_embeddings", True, "lm_head.weight is stored and differs from embed_tokens.weight", source
            )
    check_state(state, shape, source)

    tokenizer_file = folder / "tokenizer.json"
    generation = _read_optional_json(folder / "generation_config.json")
    return LoadedCheckpoint(
        shape=shape,
        state=state,
        tokenizer_json=tokenizer_file.read_text(encoding="utf-8") if tokenizer_file.is_file() else None,
        source=source,
        eos_token_id=_token_id(config, generation, "eos_token_id"),
        bos_token_id=_token_id(config, generation, "bos_token_id"),
    )


def _shape_from_config(config: dict[str, Any], source: str) -> dict:
    model_type = config.get("model_type")
    if model_type not in _ARCHITECTURES:
        raise UnsupportedCheckpoint("model_type", model_type, "only llama (and mistral) models load", source)
    for arch in config.get("architectures") or []:
        if arch not in _ARCHITECTURES.values():
            raise UnsupportedCheckpoint("architectures", arch, "only LlamaForCausalLM-style models load", source)
    if model_type == "mistral" and config.get("sliding_window") is not None:
        raise UnsupportedCheckpoint(
            "sliding_window", config["sliding_window"], "agora attends over the whole context", source
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise UnsupportedCheckpoint(flag, config[flag], "agora's Llama has no biases", source)
    act = config.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedCheckpoint("hidden_act", act, "agora's MLP is SwiGLU (silu)", source)

    hidden, heads = _int(config, "hidden_size", source), _int(config, "num_attention_heads", source)
    head_dim = config.get("head_dim")
    if head_dim is not None and heads and head_dim * heads != hidden:
        raise UnsupportedCheckpoint(
            "head_dim", head_dim, f"agora requires head_dim = hidden_size / num_attention_heads = {hidden // heads}",
            source,
        )
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedCheckpoint(
            "partial_rotary_factor", config["partial_rotary_factor"], "agora rotates the whole head", source
        )
    rope_theta = _rope_theta(config, source)
    return make_shape(
        vocab_size=_int(config, "vocab_size", source),
        d_model=hidden,
        n_layers=_int(config, "num_hidden_layers", source),
        n_heads=heads,
        n_kv_heads=int(config.get("num_key_value_heads") or heads),
        ffn_dim=_int(config, "intermediate_size", source),
        seq_len=int(config.get("max_position_embeddings", 2048)),
        rope_theta=rope_theta,
        norm_eps=float(config.get("rms_norm_eps", 1e-6)),  # LlamaConfig's own defaults for absent keys
        tie_embeddings=bool(config.get("tie_word_embeddings", False)),
        source=source,
    )


def _rope_theta(config: dict[str, Any], source: str) -> float:
    # transformers 4.x writes rope_theta + rope_scaling; 5.x folds both into rope_parameters.
    scaling = config.get("rope_scaling")
    if scaling is not None and not _is_default_rope(scaling):
        raise UnsupportedCheckpoint("rope_scaling", scaling, "agora implements plain RoPE only", source)
    params = config.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or not _is_default_rope(params):
            raise UnsupportedCheckpoint("rope_parameters", params, "agora implements plain RoPE only", source)
        if "rope_theta" in params:
            return float(params["rope_theta"])
    return float(config.get("rope_theta", 10000.0))


def _is_default_rope(spec: Any) -> bool:
    return isinstance(spec, dict) and spec.get("rope_type", spec.get("type", "default")) == "default"


def _int(config: dict[str, Any], key: str, source: str) -> int:
    value = config.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{source}: config.json needs an integer {key}, got {value!r}")
    return value


def _read_weights(folder: Path, source: str) -> dict[str, Tensor]:
    index_file = folder / "model.safetensors.index.json"
    if index_file.is_file():
        weight_map = json.loads(index_file.read_text()).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index_file}: no weight_map")
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        state: dict[str, Tensor] = {}
        for shard, names in by_shard.items():
            shard_path = folder / shard
            if not shard_path.is_file():
                raise FileNotFoundError(f"{source}: shard {shard} named by {index_file.name} is missing")
            state.update(_read_safetensors(shard_path, names))
        return state
    single = folder / "model.safetensors"
    if not single.is_file():
        candidates = sorted(folder.glob("*.safetensors"))
        if len(candidates) > 1:
            raise ValueError(
                f"{source}: {len(candidates)} .safetensors files but no model.safetensors.index.json to say "
                "which tensor lives where"
            )
        if not candidates:
            if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
                raise UnsupportedCheckpoint(
                    "weights format", "pickle (.bin/.pt)",
                    "only safetensors are read, since unpickling can run arbitrary code; convert it first", source,
                )
            raise FileNotFoundError(f"{source}: no model.safetensors (or other .safetensors file) in the folder")
        single = candidates[0]
    return _read_safetensors(single, None)


def _read_safetensors(path: Path, names: Optional[list[str]]) -> dict[str, Tensor]:
    # safe_open maps the file and materialises one tensor at a time, so peak memory is about one float32 copy.
    out: dict[str, Tensor] = {}
    with safe_open(str(path), framework="pt") as handle:
        keys = set(handle.keys())
        for name in names if names is not None else sorted(keys):
            if name not in keys:
                raise ValueError(f"{path}: the index says {name} is here, but the file lacks it")
            out[name] = handle.get_tensor(name).to(torch.float32)
    return out


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}  # generation_config is only a fallback for token ids; a broken one should not block loading
    return data if isinstance(data, dict) else {}


def _token_id(config: dict[str, Any], generation: dict[str, Any], key: str) -> Optional[int]:
    value = config.get(key)
    if value is None:
        value = generation.get(key)
    if isinstance(value, list):  # several end tokens (e.g. Llama 3 instruct): the first is the canonical one
        value = value[0] if value else None
    return int(value) if value is not None else None
