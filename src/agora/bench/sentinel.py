"""``agora bench sentinel``: how well SENTINEL finds corrupted inter-stage messages.

Real boundary activations and gradients of the ``tiny`` model (optionally after some training) stream from two
honest replicas and one attacker into one monitor, for every attack kind at two strengths and both directions,
plus clean streams. Reported: sender-level precision/recall/F1, detection delay in attacker messages, and the
false-positive rate and false bans on clean streams (see ``agora.security.evaluate``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from agora.bench.common import markdown_table, write_result
from agora.security.evaluate import evaluate


def run(out: Path, train_steps: int = 50, log: Callable[[str], None] = print) -> dict:
    report = evaluate("tiny", train_steps=train_steps)
    rows = [[r.get("kind"), r.get("strength"), r.get("direction"), "yes" if r.get("attacker_banned") else "no",
             r.get("delay"), r.get("honest_banned"), r.get("f1")] for r in report["attacks"]]
    md = markdown_table(["attack", "strength", "direction", "attacker banned", "delay (msgs)", "honest banned",
                         "message F1"], rows)
    md += "\n\n" + markdown_table(["clean stream", "messages", "flags", "false-positive rate", "bans"],
                                  [[c["direction"], c["messages"], c["flags"], c["false_positive_rate"], c["bans"]]
                                   for c in report["clean"]])
    s = report["senders"]
    md += (f"\n\nSender level: {s['attackers_banned']}/{s['attackers']} attackers banned, {s['honest_banned']} honest "
           f"bans; precision {s['precision']:.3f}, recall {s['recall']:.3f}, F1 **{s['f1']:.3f}**.\n")
    write_result(out, "sentinel", {"train_steps": train_steps, **report}, md)
    log(md)
    return report
