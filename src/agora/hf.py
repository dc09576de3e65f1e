"""Hugging Face interop for dense mode: ``LlamaForCausalLM`` state dicts and safetensors files.

Our parameter names are HF's without the ``model.`` prefix, and each stage holds a slice of the layers under
their global indices, so conversion is a rename plus a merge/split across stages. transformers is not imported
here: a peer never needs it, only the interop tests use it as the reference implementation.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from agora.config import Manifest
from agora.model import PipelineModel, Stage


def _to_hf(name: str) -> str:
    # Our stages store blocks in a ModuleDict keyed by global index: "layers.5.x" already matches HF's layout.
    return name if name.startswith("lm_head") else f"model.{name}"


def _from_hf(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _require_dense(manifest: Manifest) -> None:
    if manifest.residual.mode != "dense":
        raise ValueError(
            "Hugging Face Llama has no subspace residual; only residual.mode=dense models convert to/from it"
        )


def export_state_dict(stages: list[Stage] | PipelineModel) -> dict[str, Tensor]:
    """Merge stage state dicts into one ``LlamaForCausalLM`` state dict."""
    stages = list(stages.stages) if isinstance(stages, PipelineModel) else stages
    out: dict[str, Tensor] = {}
    for stage in stages:
        for name, tensor in stage.state_dict().items():
            if name == "lm_head.weight" and stage.shape.tie_embeddings:
                continue  # tied: HF stores the embedding only (the tail's copy is checked by the exporter)
            out[_to_hf(name)] = tensor.detach().clone()
    return out


def import_state_dict(stages: list[Stage] | PipelineModel, state: dict[str, Tensor], *, every_tensor: bool = True,
                      dense_only: bool = True) -> set[str]:
    """Load an HF Llama state dict into stages; each stage takes only its own tensors, all of them. Returns the
    names used (ours). ``every_tensor``: also refuse tensors no stage took (off when loading some of the stages);
    ``dense_only=False`` lets agora's own single-file format, which uses the same names, load subspace models."""
    stages = list(stages.stages) if isinstance(stages, PipelineModel) else stages
    if dense_only:
        _require_dense_stages(stages)
    ours = {_from_hf(k): v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    used: set[str] = set()
    if stages and stages[0].shape.tie_embeddings and "embed_tokens.weight" in ours:
        # Tied: the tail's LM head is the embedding. HF state dicts of tied models may list lm_head.weight too;
        # it must then be the same matrix.
        if "lm_head.weight" in ours and not torch.equal(ours["lm_head.weight"], ours["embed_tokens.weight"]):
            raise ValueError("the model is tied (tie_embeddings) but the checkpoint's lm_head.weight differs from "
                             "its embed_tokens.weight")
        ours["lm_head.weight"] = ours["embed_tokens.weight"]
        used.add("lm_head.weight")
    for stage in stages:
        own = stage.state_dict()
        missing = [k for k in own if k not in ours]
        if missing:
            raise KeyError(f"stage {stage.spec.index}: tensors missing from the checkpoint: {missing[:5]}")
        for k, v in own.items():
            if ours[k].shape != v.shape:
                raise ValueError(f"{k}: checkpoint shape {tuple(ours[k].shape)} != model shape {tuple(v.shape)}")
        stage.load_state_dict({k: ours[k] for k in own})
        used.update(own)
    extra = sorted(set(ours) - used)
    if extra and every_tensor:
        raise KeyError(f"checkpoint has tensors the model does not: {extra[:5]}")
    return used


def _require_dense_stages(stages: list[Stage]) -> None:
    if any(s.subspace for s in stages):
        raise ValueError("only residual.mode=dense models convert to/from Hugging Face Llama")


def save_hf_safetensors(stages: list[Stage] | PipelineModel, path: str | Path) -> None:
    save_file({k: v.contiguous() for k, v in export_state_dict(stages).items()}, str(path))


def load_hf_safetensors(stages: list[Stage] | PipelineModel, path: str | Path) -> None:
    import_state_dict(stages, load_file(str(path)))


def hf_config_kwargs(manifest: Manifest) -> dict:
    """Arguments for ``transformers.LlamaConfig`` describing the same network."""
    _require_dense(manifest)
    m = manifest.model
    return dict(
        vocab_size=m.vocab_size,
        hidden_size=m.d_model,
        intermediate_size=m.ffn_dim,
        num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads,
        num_key_value_heads=m.n_kv_heads,
        max_position_embeddings=m.seq_len,
        rope_theta=m.rope_theta,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )

