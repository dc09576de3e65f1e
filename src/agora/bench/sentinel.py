"""``agora bench sentinel``: how well SENTINEL finds corrupted inter-stage messages, with no oracle anywhere.

Detection (``agora.bench.sentinel_audits``): the ``small`` preset (``--size tiny`` for a quick run) trains for real
on its corpus; four replicas per stage send one microbatch each per step, one attacker among them (two colluding
ones in one row), into a receiver's monitor set up as a node's, with audits (recomputations by the other replicas,
which may be a step off, absent, or lying) or on statistics alone. Rows: the kinds SENTINEL has features for at two
strengths, held-out attacks apart, clean streams.

Damage (``agora.bench.loss_impact``, with ``loss_steps``): ``tiny`` trained on its corpus with one attacking
replica per kind, behind SENTINEL with audits, on statistics alone, and undefended; the final validation loss
against a clean run's, and the corrupted messages that reached the optimizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from agora.bench.common import environment, markdown_table, write_result
from agora.bench.loss_impact import loss_impact
from agora.bench.sentinel_audits import evaluate_audited


def _summary_table(summary: dict) -> str:
    def share(x):
        return "-" if x is None else f"{x:.2f}"

    return markdown_table(
        ["rows, setting", "attackers banned", "honest bans", "precision", "recall", "F1", "median delay",
         "max delay", "clean flags", "audits answered", "audits usable"],
        [[k, f"{s['attackers_banned']}/{s['attackers']}", s["honest_banned"], round(s["precision"], 3),
          round(s["recall"], 3), round(s["f1"], 3), s["median_delay"], s["max_delay"],
          f"{s['clean_flags']}/{s['clean_messages']}" if s["clean_messages"] else "-", share(s["audit_answered"]),
          share(s["audit_usable"])] for k, s in summary.items()])


def _rows_table(rows: list) -> str:
    return markdown_table(
        ["rows", "setting", "attack", "direction", "banned", "delay (corrupt msgs)", "honest banned",
         "corrupt msgs", "msg recall", "honest flags", "audits: usable / attempted", "corrupt audited / cleared",
         "honest convicted", "first reasons"],
        [[r["group"], r["setting"], r["label"], r["direction"], f"{r['attackers_banned']}/{r['attackers']}",
          r["delay"], r["honest_banned"], r["corrupt_sent"], round(r["recall"], 3),
          f"{r['honest_flags']}/{r['honest_messages']}",
          f"{r['audits']['usable']}/{r['audits']['attempted']}" if r["audits"]["attempted"] else "-",
          f"{r['audits']['on_corrupt']} / {r['audits']['cleared_corrupt']}" if r["audits"]["attempted"] else "-",
          r["audits"]["convicted_honest"] if r["audits"]["attempted"] else "-",
          "; ".join(r["first_reasons"])] for r in rows])


def _loss_table(li: dict) -> str:
    def num(x):
        return "-" if x is None else round(x, 4)

    return markdown_table(
        ["attack", "strength", "direction", "defence", "val loss", "ratio to clean", "same run as clean",
         "banned at step", "corrupt msgs used", "corrupt msgs dropped", "honest bans", "ratio (no defence)"],
        [[r["kind"], r["strength"], r["direction"], "audits" if r["audits"] else "statistics only",
          round(r["val_loss"], 4), round(r["ratio"], 4), "yes" if r["same_as_clean"] else "no",
          r["attacker_banned_at_step"], r["corrupt_used"], r["corrupt_dropped"], r["honest_banned"],
          num(r["undefended_ratio"])] for r in li["rows"]])


def run(out: Path, size: str = "small", loss_steps: int = 60, log: Callable[[str], None] = print) -> dict:
    command = f"agora bench sentinel --out {out} --size {size} --loss-steps {loss_steps}"
    report = evaluate_audited(size, log=log)
    t = report["traffic"]
    md = (f"Measured {environment()['date']}. Command: `{command}`\n\n"
          f"Traffic: `{t['preset']}` trained {t['steps']} steps on `{t['corpus']}` with its optimizer (loss "
          f"{t['loss_first']:.2f} -> {t['loss_last']:.2f}), {t['seats']} replicas per stage, messages "
          f"{t['message_shape']} in {t['wire_dtype']}. Replicas: absent {t['replicas']['absent']}, a step behind "
          f"{t['replicas']['behind']}, a step ahead {t['replicas']['ahead']} (each per step). Recomputations at the "
          f"message's version: {t['same_version_recomputations']}, {t['same_version_nonbitwise']} not bit-identical, "
          f"largest relative difference {t['same_version_max_diff']:.3g} (audit tolerance {t['audit_tolerance']:g}); "
          f"at a version one step off: smallest {t['other_version_min_diff']:.3g}, median "
          f"{t['other_version_median_diff']:.3g}. {report['seconds']:.0f} s.\n\n")
    md += _summary_table(report["summary"]) + "\n\n" + _rows_table(report["rows"])
    if loss_steps:
        report["loss_impact"] = li = loss_impact("tiny", steps=loss_steps)
        md += (f"\n\nValidation loss of `tiny` after {loss_steps} steps with one attacking replica (attack from step "
               f"{loss_steps // 3}), against the clean run's {li['clean']['val_loss']:.4f}. \"Same run as clean\": no "
               f"corrupted message was used, so the run is the clean run (ratio 1 by construction).\n\n")
        md += _loss_table(li)
        md += "\n\nWorst ratio with SENTINEL: " + ", ".join(f"{k} {v:.4f}" for k, v in li["worst_ratio"].items())
        md += ".\n"
    write_result(out, "sentinel", {"command": command, "size": size, "loss_steps": loss_steps, **report}, md)
    log(md)
    return report
