"""What an attacker costs the model, with and without SENTINEL: train two stages with one corrupting replica.

The offline evaluation (``agora.bench.sentinel_eval``) counts flags and bans; the question a run's owner asks is
different: *does the model end up as good as without the attacker?* Here the two stages around a boundary of a
preset train for real (the manifest's optimizer, schedule and clipping, as a stage node runs them), each step on
one microbatch per replica seat; the last seat is an attacker that corrupts what it sends once the attack starts
(its forward activations for ``fwd``, the activation gradients it returns for ``bwd``). Every message crosses the
boundary through a ``SentinelMonitor`` at its receiver, set up as a node's next to the first or last stage
(``node_config``: every flagged message and ``AUDIT_RATE`` of the others are audited, i.e. recomputed by honest
replicas):

* a flagged message is dropped and the receiver retries the microbatch on another replica of the sender's stage,
  which computes the honest message (replicas share the step's weights); that is what the swarm does;
* a banned attacker gets no more work: its seat's microbatches are served by honest replicas;
* an unflagged corrupted message is used: it reaches the optimizer, which is the damage being measured.

``defend=False`` is the same run without a monitor (every corrupted message used), and ``kind=None`` the clean
run. The three share the data order and initial weights (same seed), so their validation losses at equal tokens
compare directly.
"""

from __future__ import annotations

import math
import random
from typing import Optional

import torch

from agora.config import Manifest, load_manifest
from agora.optim import build_optimizer, set_lr
from agora.lab.attacks import AttackState, apply_attack
from agora.bench.sentinel_eval import _two_stages, simulated_audit, synthetic_batch
from agora.sentinel import AUDIT_RATE, SentinelConfig, SentinelMonitor, node_config
from agora.wire import Boundary, decompress


def train_under_attack(manifest: "Manifest | str" = "tiny", kind: Optional[str] = None, strength: float = 0.0,
                       direction: str = "fwd", steps: int = 120, senders: int = 3, seed: int = 0,
                       defend: bool = True, attack_start: Optional[int] = None, val_batches: int = 4,
                       config: Optional[SentinelConfig] = None) -> dict:
    """Train ``steps`` optimizer steps of ``senders`` microbatches each; the last seat attacks from
    ``attack_start`` (default: a third of the way in). Returns the final validation loss and what the monitor did.
    """
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    m = load_manifest(manifest) if isinstance(manifest, str) else manifest
    head, tail, gen, probs, table = _two_stages(m, 0, seed, "train_under_attack")
    V, T, B = m.model.vocab_size, m.model.seq_len, m.batch.microbatch_size
    # Validation data from its own stream, drawn before training so every variant sees the same batches.
    val_gen = torch.Generator().manual_seed(seed + 10_007)
    val = [synthetic_batch(val_gen, V, B, T, table, probs) for _ in range(val_batches)]
    opts = [build_optimizer(head, m.optimizer), build_optimizer(tail, m.optimizer)]
    monitor = SentinelMonitor(node_config(config or SentinelConfig(seed=m.seed))) if defend else None
    audit_rng = random.Random(seed + 2)
    names = [f"honest-{i}" for i in range(senders - 1)] + ["attacker"]
    start = steps // 3 if attack_start is None else attack_start
    rng, state = torch.Generator().manual_seed(seed + 1), AttackState()
    used_corrupt = flagged_corrupt = flagged_honest = 0
    banned_at: Optional[int] = None

    def judge(who: str, msg: torch.Tensor, step: int, tokens: torch.Tensor, paired=None, honest=None) -> bool:
        """True when the receiver drops ``msg`` (and retries the microbatch elsewhere). ``honest``: for gradients,
        what another tail recomputes when the message is audited."""
        if monitor is None:
            return False
        version = (step, 0.0)
        v = monitor.observe(who, 0, direction, msg, step=step, tokens=tokens, paired=paired, version=version)
        if honest is not None and (v.flagged or audit_rng.random() < AUDIT_RATE):
            simulated_audit(monitor, who, direction, msg, honest, version)
        return v.flagged

    for step in range(steps):
        tokens, targets = synthetic_batch(gen, V, senders * B, T, table, probs)
        for slot, who in enumerate(names):
            tok, tgt = tokens[slot * B:(slot + 1) * B], targets[slot * B:(slot + 1) * B]
            if monitor is not None and monitor.banned(who):
                who = names[slot % (senders - 1)]  # a banned seat's work goes to an honest replica
            attacker = who == "attacker" and kind is not None
            attacking = attacker and step >= start
            coords = head(tok) @ head.basis
            sent = coords.detach()
            if direction == "fwd" and attacker:
                if attacking:
                    bad = apply_attack(kind, strength, sent, rng, state)
                    if judge(who, bad, step, tok.int(), honest=sent):
                        flagged_corrupt += 1  # retried on an honest head: the honest coordinates are used
                    else:
                        used_corrupt += 1
                        sent = bad
                else:
                    state.remember(sent)
            if direction == "fwd" and (not attacker or not attacking) and judge(who, sent, step, tok.int(),
                                                                                honest=sent):
                flagged_honest += 1  # retried on another head, which computes the same coordinates
            leaf = sent.clone().requires_grad_(True)
            x = decompress(Boundary(leaf, tok.int(), "subspace"), tail.basis, tail.frozen_embed)
            # Each microbatch's mean loss / senders: the step's gradient is the batch mean, as averaging makes it.
            (tail.loss(tail(x), tgt) / senders).backward()
            grad = leaf.grad * senders  # what a tail returns for one microbatch's mean loss
            if direction == "bwd":
                if attacking:
                    bad = apply_attack(kind, strength, grad, rng, state)
                    if judge(who, bad, step, tok.int(), paired=sent, honest=grad):
                        flagged_corrupt += 1  # retried on an honest tail: its gradient is used
                    else:
                        used_corrupt += 1
                        grad = bad
                else:
                    if attacker:
                        state.remember(grad)
                    if judge(who, grad, step, tok.int(), paired=sent, honest=grad):
                        flagged_honest += 1
            coords.backward(grad / senders)
        if monitor is not None and banned_at is None and monitor.banned("attacker"):
            banned_at = step
        for stage, opt in zip((head, tail), opts):
            torch.nn.utils.clip_grad_norm_(list(stage.parameters()), m.optimizer.grad_clip)
            set_lr(opt, m.optimizer, step)
            opt.step()
            opt.zero_grad(set_to_none=True)

    with torch.no_grad():
        losses = []
        for tok, tgt in val:
            coords = head(tok) @ head.basis
            x = decompress(Boundary(coords, tok.int(), "subspace"), tail.basis, tail.frozen_embed)
            losses.append(float(tail.loss(tail(x), tgt)))
    # In the clean run the attacker's seat is honest too.
    honest = names if kind is None else names[:-1]
    honest_banned = sum(monitor.banned(n) for n in honest) if monitor is not None else 0
    return {"kind": kind or "clean", "strength": strength, "direction": direction, "defended": defend,
            "steps": steps, "val_loss": sum(losses) / len(losses), "attacker_banned_at_step": banned_at,
            "corrupt_used": used_corrupt, "corrupt_dropped": flagged_corrupt, "honest_dropped": flagged_honest,
            "honest_banned": int(honest_banned)}


def loss_impact(manifest: "Manifest | str" = "tiny", strengths: Optional[dict] = None, steps: int = 120,
                seed: int = 0, directions: tuple = ("fwd", "bwd"), undefended: bool = True) -> dict:
    """The clean run, then per (kind, strength) and direction the defended run (and the undefended one): final
    validation losses and their ratio to the clean run's."""
    from agora.bench.sentinel_eval import EVAL_STRENGTHS

    strengths = strengths or {k: (v[1],) for k, v in EVAL_STRENGTHS.items()}
    clean = train_under_attack(manifest, None, steps=steps, seed=seed, direction="fwd")
    rows = []
    for kind, values in strengths.items():
        for strength in values:
            for direction in directions:
                row = train_under_attack(manifest, kind, strength, direction, steps=steps, seed=seed)
                row["ratio"] = row["val_loss"] / clean["val_loss"]
                if undefended:
                    bare = train_under_attack(manifest, kind, strength, direction, steps=steps, seed=seed,
                                              defend=False)
                    row["undefended_val_loss"] = bare["val_loss"]
                    row["undefended_ratio"] = (bare["val_loss"] / clean["val_loss"]
                                               if math.isfinite(bare["val_loss"]) else None)
                rows.append(row)
    return {"steps": steps, "clean": clean, "rows": rows,
            "worst_ratio": max((r["ratio"] for r in rows), default=None)}
