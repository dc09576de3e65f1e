"""Stage checkpoints: parameters + optimizer state as safetensors, step and manifest as JSON, written atomically.

One folder per stage (``DIR/stage{K}/``) so every replica of a stage can write to its own DIR and a restarted
swarm can hand each node the folder of its stage. A checkpoint of another manifest is refused, not loaded.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from agora.config import Manifest


def stage_dir(root: str | Path, stage: int) -> Path:
    return Path(root) / f"stage{stage}"


def save_stage_checkpoint(
    root: str | Path, manifest: Manifest, stage: int, step: int, names: list[str], tensors: list[torch.Tensor]
) -> Path:
    folder = stage_dir(root, stage)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"step": str(step), "stage": str(stage), "manifest_hash": manifest.hash,
            "weights_hash": manifest.weights_hash, "run_id": manifest.run_id}
    # The step lives inside the safetensors header, so weights and step are replaced in one atomic rename. The
    # temporary name is unique per writer: replicas of a stage sharing DIR may save at the same moment.
    tmp = folder / f"state.safetensors.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        save_file({n: t.contiguous() for n, t in zip(names, tensors)}, str(tmp), metadata=meta)
        os.replace(tmp, folder / "state.safetensors")
    finally:
        tmp.unlink(missing_ok=True)
    meta_tmp = folder / f"meta.json.{os.getpid()}.{threading.get_ident()}.tmp"
    meta_tmp.write_text(json.dumps(meta, indent=1))  # human-readable copy only
    os.replace(meta_tmp, folder / "meta.json")
    return folder


def load_stage_checkpoint(
    root: str | Path, manifest: Manifest, stage: int
) -> Optional[tuple[int, list[str], list[torch.Tensor]]]:
    """(step, names, tensors) of the stage's checkpoint under ``root``, or None if there is none."""
    path = stage_dir(root, stage) / "state.safetensors"
    if not path.exists():
        return None
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
    if meta.get("manifest_hash") != manifest.hash and meta.get("weights_hash") != manifest.weights_hash:
        raise ValueError(  # (a manifest differing in its security section only is the same model: weights_hash)
            f"checkpoint {path} was written for manifest {meta.get('manifest_hash')}, this run uses {manifest.hash}"
        )
    state = load_file(str(path))
    names = sorted(state)
    return int(meta["step"]), names, [state[n] for n in names]
