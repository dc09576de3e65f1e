"""``agora bench sentinel``: how well SENTINEL finds corrupted inter-stage messages.

Real boundary activations and gradients of the ``tiny`` model stream from honest replicas and one attacker into one
monitor, for every attack kind at two strengths and both directions, plus clean streams (see
``agora.bench.sentinel_eval``), in two settings:

* ``static``: a pool of messages of one model (optionally after ``train_steps`` of training), as before;
* ``drift``: messages recorded *while the model trains* for ``drift_steps`` optimizer steps, one message per step
  reaching the receiver (as on a live ``tiny`` swarm), the attack starting a third of the way in; clean streams
  with 2 or 3 senders. Honest statistics drift by many per-message spreads here (what banned honest peers live).

Reported: per attack kind, strength and direction whether the attacker was banned, the detection delay (corrupted
messages until the ban), honest bans and message-level precision / recall / F1; clean false-positive rates and
bans; sender-level precision / recall / F1 per setting and overall. With ``loss_steps``: the final validation loss
of ``tiny`` trained with one attacking replica behind SENTINEL (and without it) against a clean run at equal
tokens (``agora.bench.loss_impact``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from agora.bench.common import markdown_table, write_result
from agora.bench.sentinel_eval import evaluate
from agora.bench.loss_impact import loss_impact


def run(out: Path, train_steps: int = 50, drift_steps: int = 240, loss_steps: int = 120,
        log: Callable[[str], None] = print) -> dict:
    report = evaluate("tiny", train_steps=train_steps, drift_steps=drift_steps)
    if loss_steps:
        report["loss_impact"] = loss_impact("tiny", steps=loss_steps)
    rows = [[r.get("setting"), r.get("kind"), r.get("strength"), r.get("direction"),
             "yes" if r.get("attacker_banned") else "no", r.get("delay"), r.get("honest_banned"),
             round(r.get("precision"), 3), round(r.get("recall"), 3), round(r.get("f1"), 3)]
            for r in report["attacks"]]
    md = markdown_table(["setting", "attack", "strength", "direction", "attacker banned", "delay (msgs)",
                         "honest banned", "msg precision", "msg recall", "msg F1"], rows)
    md += "\n\n" + markdown_table(
        ["clean stream", "direction", "senders", "msgs/step", "messages", "flags", "false-positive rate", "bans"],
        [[c["setting"], c["direction"], c["senders"], c["messages_per_step"] or "-", c["messages"], c["flags"],
          round(c["false_positive_rate"], 4), c["bans"]] for c in report["clean"]])
    if report.get("drift"):
        d = report["drift"]
        md += (f"\n\nDrift trace: {d['steps']} optimizer steps of tiny, training loss {d['loss_first']:.2f} -> "
               f"{d['loss_last']:.2f}. Static pool: trained {train_steps} steps (loss {report['pool_loss']:.2f}).\n")
    md += "\n" + markdown_table(
        ["setting", "attackers banned", "honest bans", "precision", "recall", "F1", "median delay", "max delay",
         "clean flags"],
        [[k, f"{s['attackers_banned']}/{s['attackers']}", s["honest_banned"], round(s["precision"], 3),
          round(s["recall"], 3), round(s["f1"], 3), s["median_delay"], s["max_delay"],
          f"{s['clean_flags']}/{s['clean_messages']}"] for k, s in report["by_setting"].items()])
    if loss_steps:
        li = report["loss_impact"]
        md += (f"\n\nValidation loss after {loss_steps} training steps with one attacking replica (moderate strength, "
               f"attack from step {loss_steps // 3}), against the clean run's {li['clean']['val_loss']:.4f} "
               f"(goal: within 2 %):\n\n")
        md += markdown_table(
            ["attack", "strength", "direction", "val loss (SENTINEL)", "ratio to clean", "banned at step",
             "corrupt msgs used", "val loss (no defence)", "ratio (no defence)", "honest bans"],
            [[r["kind"], r["strength"], r["direction"], round(r["val_loss"], 4), round(r["ratio"], 4),
              r["attacker_banned_at_step"], r["corrupt_used"], round(r["undefended_val_loss"], 4),
              None if r["undefended_ratio"] is None else round(r["undefended_ratio"], 4), r["honest_banned"]]
             for r in li["rows"]])
        md += f"\nWorst ratio with SENTINEL: {li['worst_ratio']:.4f}.\n"
    write_result(out, "sentinel", {"train_steps": train_steps, "drift_steps": drift_steps, "loss_steps": loss_steps,
                                   **report}, md)
    log(md)
    return report
