"""Hugging Face interop for dense mode: ``LlamaForCausalLM`` state dicts and safetensors files.

Our parameter names are HF's without the ``model.`` prefix, and each stage holds a slice of the layers under
their global indices, so conversion is a rename plus a merge/split across stages. transformers is not imported
here: a peer never needs it, only the interop tests use it as the reference implementation.
"""

from __future__ import annotations

from pathlib import Path

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
            out[_to_hf(name)] = tensor.detach().clone()
    return out


def import_state_dict(stages: list[Stage] | PipelineModel, state: dict[str, Tensor]) -> None:
    """Load an HF Llama state dict into stages; each stage takes only its own tensors. Strict about coverage."""
    stages = list(stages.stages) if isinstance(stages, PipelineModel) else stages
    _require_dense_stages(stages)
    ours = {_from_hf(k): v for k, v in state.items() if not k.endswith("rotary_emb.inv_freq")}
    used: set[str] = set()
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
    if extra:
        raise KeyError(f"checkpoint has tensors the model does not: {extra[:5]}")


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
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )

