"""Read pretrained Llama checkpoints (Hugging Face folders, llama.cpp GGUF files) into one neutral form.

Every reader returns a :class:`LoadedCheckpoint`: ``ModelShape`` kwargs, float32 tensors under HF
``LlamaForCausalLM`` names, and the tokenizer as ``tokenizer.json`` text. Anything agora's dense Llama cannot
reproduce exactly (RoPE scaling, biases, other architectures) is refused with :class:`UnsupportedCheckpoint`
instead of being loaded approximately.
"""

from __future__ import annotations

from pathlib import Path

from agora.interop.base import LoadedCheckpoint, UnsupportedCheckpoint, expected_shapes
from agora.interop.gguf_file import load_gguf, unpermute_rotary
from agora.interop.hf_folder import load_hf_folder

__all__ = [
    "LoadedCheckpoint",
    "UnsupportedCheckpoint",
    "expected_shapes",
    "load_checkpoint",
    "load_gguf",
    "load_hf_folder",
    "unpermute_rotary",
]


def load_checkpoint(path: str | Path) -> LoadedCheckpoint:
    """Load ``path``: a folder with ``config.json`` (Hugging Face) or a ``.gguf`` file (llama.cpp)."""
    target = Path(path)
    if target.is_dir():
        if (target / "config.json").is_file():
            return load_hf_folder(target)
        ggufs = sorted(target.glob("*.gguf"))
        hint = f"; to load a GGUF, pass the file itself (e.g. {ggufs[0]})" if ggufs else ""
        raise ValueError(f"{target}: a folder without config.json is not a Hugging Face model folder{hint}")
    if target.is_file():
        if target.suffix.lower() == ".gguf":
            return load_gguf(target)
        raise ValueError(
            f"{target}: not a checkpoint agora reads; pass a Hugging Face model folder (with config.json) "
            "or a .gguf file"
        )
    raise FileNotFoundError(f"{target}: no such file or folder")
