"""``agora bench averaging``: the averaging schemes side by side, at equal tokens, clean, over capped links and under
replica kills.

Per seed: centralized ``train-local`` once (the reference loss), then a local swarm (``agora demo``, separate OS
processes) per scheme and condition, every arm on exactly the centralized tokens (``StopRule.exact_tokens``) and
validated on the same held-out batches once the stages applied every sample. Schemes: ``full``, ``powersgd``,
``sparse``, ``diloco`` (``every`` inner steps per outer step) and factored gossip with ``q`` = 0, 1, 3. Conditions:
``clean``; ``capped`` (every peer's uplink at ``link_mbps``, network namespaces when root, else in the transport);
``kill`` (a random serving replica SIGKILLed every ``kill_every_s`` and replaced by a joiner).

Reported per arm: validation loss (and its ratio to centralized and to ``full`` under the same condition), training
wall time (trainers' start to the last completed microbatch), utilisation (median over stages of compute seconds
over the demo's whole wall time, start-up included: the demo summary's ``stage_utilisation``), averaging bytes sent per optimizer step, consensus distance (median over nodes of the
last sampled spread they saw, ``AVERAGING.md``), the longest stall without a completed microbatch, and kills.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

from agora.bench.chaos import longest_stall
from agora.bench.common import markdown_table, write_result
from agora.lab.demo import ChaosOptions, DemoOptions, LinkOptions, StopRule, SwarmShape, demo_manifest, run_demo
from agora.lab.train_local import train_local

SCHEMES = ("full", "powersgd", "sparse", "diloco", "gossip_q0", "gossip_q1", "gossip_q3")
CODECS = ("float16", "uint8")  # an arm "diloco+uint8", "gossip_q1+float16": that scheme with ``averaging.codec``
CONDITIONS = ("clean", "capped", "kill")
SWARM_TIMEOUT_S = 7200


def known_scheme(arm: str) -> bool:
    """Whether ``arm`` names a scheme of ``SCHEMES``, optionally ``+codec`` for diloco and gossip."""
    scheme, plus, codec = arm.partition("+")
    return scheme in SCHEMES and (not plus or (codec in CODECS and scheme.startswith(("diloco", "gossip"))))


@dataclass(frozen=True)
class AveragingOptions:
    preset: str = "small"
    stages: int = 3
    replicas: int = 4
    steps: int = 12
    seeds: tuple[int, ...] = (0,)
    schemes: tuple[str, ...] = SCHEMES
    conditions: tuple[str, ...] = CONDITIONS
    every: int = 4  # inner steps per outer round (diloco, gossip) and steps between sparse rounds
    link_mbps: float = 4.0
    kill_every_s: float = 30.0
    in_flight: int = 2
    arm_timeout_s: float = SWARM_TIMEOUT_S  # an arm still training after this stops, reported unfinished
    val_batches: int = 4

    def averaging_spec(self, arm: str) -> str:
        scheme, plus, codec = arm.partition("+")
        if plus:
            if not known_scheme(arm):
                raise ValueError(f"unknown arm {arm!r}: a codec ({', '.join(CODECS)}) only follows diloco or gossip")
            return f"{self.averaging_spec(scheme)},codec={codec}"
        if scheme == "full":
            return scheme
        if scheme == "powersgd":
            # Every round compressed: at this benchmark's ~12 steps the preset's dense first steps (a one-off of
            # ``dense_steps`` full rounds per run, docs/COMPRESSION.md) would be most of the bytes measured.
            return "powersgd,dense_steps=0"
        if scheme == "sparse":
            return f"sparse,every={self.every}"
        if scheme == "diloco":
            return f"diloco,every={self.every}"
        if scheme.startswith("gossip_q"):
            return f"gossip,every={self.every},q={int(scheme[len('gossip_q'):])}"
        raise ValueError(f"unknown scheme {scheme!r}; choose from {list(SCHEMES)}")


def run(out: Path, options: Optional[AveragingOptions] = None, log: Callable[[str], None] = print) -> dict:
    opts = options or AveragingOptions()
    bad = [s for s in opts.schemes if not known_scheme(s)] + [c for c in opts.conditions if c not in CONDITIONS]
    if bad or not opts.seeds or opts.steps < 1:
        raise ValueError(f"unknown {bad}" if bad else "give at least one seed and one step")
    out = Path(out)
    arms: list[dict] = []
    for seed in opts.seeds:
        manifest = demo_manifest(opts.preset, opts.stages, seed=seed)
        folder = out / f"seed{seed}"
        log(f"averaging: seed {seed}: centralized, {opts.preset}, {opts.steps} steps")
        central = train_local(manifest, opts.steps, folder / "centralized", val_batches=opts.val_batches,
                              shard=(0, 1))
        for condition in opts.conditions:
            for scheme in opts.schemes:
                log(f"averaging: seed {seed}: {scheme}, {condition}")
                arm = run_arm(folder / f"{scheme}-{condition}", opts, seed, scheme, condition, central)
                arms.append(arm)
                log(f"averaging:   val {arm['val_loss']}, train {arm['train_s']:.0f}s, utilisation "
                    f"{arm['utilisation']}, {arm['averaging_bytes_per_step']:.0f} B/step, consensus "
                    f"{arm['consensus_distance']}, longest stall {arm['longest_stall_s']:.1f}s")
                _write(out, opts, arms)
    result, md = _write(out, opts, arms)
    log(md)
    return result


def run_arm(folder: Path, opts: AveragingOptions, seed: int, scheme: str, condition: str, central: dict) -> dict:
    s = run_demo(DemoOptions(
        out=folder,
        shape=SwarmShape(preset=opts.preset, stages=opts.stages, replicas=opts.replicas, in_flight=opts.in_flight,
                         averaging=opts.averaging_spec(scheme), val_batches=opts.val_batches, seed=seed),
        stop=StopRule(steps=opts.steps, tokens=central["tokens"], exact_tokens=True, timeout=opts.arm_timeout_s),
        link=LinkOptions(mbps=opts.link_mbps) if condition == "capped" else LinkOptions(),
        chaos=ChaosOptions(every_s=opts.kill_every_s, seed=seed) if condition == "kill" else ChaosOptions(),
        live=False, sample_tokens=0))
    start = s.get("train_started_s") or 0.0
    done = [c[1] for c in s.get("completions", [])]
    end = max(done) if done else start
    nodes = s.get("nodes") or []
    consensus = [n["consensus_distance"] for n in nodes if n.get("consensus_distance") is not None]
    utilisation = list((s.get("stage_utilisation") or {}).values())
    steps = max(s["steps_per_stage"].values()) if s.get("steps_per_stage") else 0
    val = s["val_loss"]
    return {
        "seed": seed, "scheme": scheme, "condition": condition, "finished": s["finished"],
        "tokens": s["tokens"], "centralized_tokens": central["tokens"], "val_loss": val,
        "loss_ratio": (val / central["val_loss"]) if val is not None else None,
        # an arm stopped by ``arm_timeout_s`` has no training time, only a lower bound on it (its deadline)
        "train_s": end - start if s["finished"] else None,
        "train_s_at_least": None if s["finished"] else opts.arm_timeout_s - start, "steps_completed": steps,
        "wall_s": s["wall_s"],
        "utilisation": statistics.median(utilisation) if utilisation else None,
        "averaging_bytes_per_step": s.get("averaging_bytes_sent", 0) / max(1, steps),
        "consensus_distance": statistics.median(consensus) if consensus else None,
        "longest_stall_s": longest_stall(s.get("completions", []), start, end),
        "kills": len(s.get("chaos_kills") or []), "steps_per_stage": s.get("steps_per_stage"),
        "rounds_ok": s.get("rounds_ok"), "rounds_failed": s.get("rounds_failed"),
    }


def _median(arms: list[dict], key: str) -> Optional[float]:
    values = [a[key] for a in arms if a.get(key) is not None]
    return statistics.median(values) if values else None


def summarize(arms: list[dict]) -> dict[str, dict]:
    """Per (condition, scheme): medians over seeds, and the loss relative to ``full`` under the same condition."""
    rows: dict[str, dict] = {}
    for condition in dict.fromkeys(a["condition"] for a in arms):
        full = [a for a in arms if a["condition"] == condition and a["scheme"] == "full"]
        full_val, full_s = _median(full, "val_loss"), _median(full, "train_s")
        full_bound = None
        if any(not a.get("finished", True) for a in full):
            # An unfinished full arm's time is only bounded below. The median of every seed's time or bound is a
            # lower bound on the median time (a median of finished seeds alone would drop the slowest): "x times
            # sooner" becomes "at least x times".
            full_s, full_bound = None, statistics.median(
                [a["train_s"] if a.get("finished", True) else a["train_s_at_least"] for a in full])
        for scheme in dict.fromkeys(a["scheme"] for a in arms if a["condition"] == condition):
            mine = [a for a in arms if a["condition"] == condition and a["scheme"] == scheme]
            row = {k: _median(mine, k) for k in ("val_loss", "loss_ratio", "train_s", "utilisation",
                                                 "averaging_bytes_per_step", "consensus_distance",
                                                 "longest_stall_s", "kills")}
            row["vs_full_loss"] = row["val_loss"] / full_val if row["val_loss"] and full_val else None
            row["full_time_over_this"] = full_s / row["train_s"] if full_s and row["train_s"] else None
            row["full_time_over_this_at_least"] = (full_bound / row["train_s"] if full_bound and row["train_s"]
                                                   else None)
            late = [a for a in mine if not a.get("finished", True)]
            row["unfinished"] = len(late)
            row["train_s_at_least"] = min(a["train_s_at_least"] for a in late) if late else None
            row["steps_completed"] = [a.get("steps_completed") for a in late]
            row["seeds"] = [a["seed"] for a in mine]
            rows[f"{condition}/{scheme}"] = row
    return rows


def _write(out: Path, opts: AveragingOptions, arms: list[dict]) -> tuple[dict, str]:
    rows = summarize(arms)

    def f(v, spec):
        return "-" if v is None else format(v, spec)

    def train_s(r):
        if r.get("unfinished"):  # stopped at the arm timeout: a bound, and how far it got
            return f"> {r['train_s_at_least']:.0f} (unfinished: {', '.join(map(str, r['steps_completed']))} steps)"
        return f(r["train_s"], ".0f")

    def sooner(r):
        if r.get("full_time_over_this_at_least") is not None:
            return f"> {r['full_time_over_this_at_least']:.2f}"
        return f(r["full_time_over_this"], ".2f")

    table = [[key.split("/")[1], key.split("/")[0], f(r["val_loss"], ".4f"), f(r["loss_ratio"], ".4f"),
              f(r["vs_full_loss"], ".4f"), train_s(r), sooner(r),
              f(r["utilisation"], ".2f"), f(r["averaging_bytes_per_step"], ".3g"), f(r["consensus_distance"], ".2e"),
              f(r["longest_stall_s"], ".1f"), f(r["kills"], ".0f")] for key, r in rows.items()]
    md = (f"`{opts.preset}`, {opts.stages} stages x {opts.replicas} replicas, {opts.steps} steps' tokens per arm "
          f"(equal for every arm), seeds {list(opts.seeds)} (medians); every = {opts.every}; capped: "
          f"{opts.link_mbps:g} Mbit/s per peer; kill: a replica every {opts.kill_every_s:g} s.\n\n"
          + markdown_table(["scheme", "condition", "val loss", "vs centralized", "vs full", "train s",
                            "full's time / this", "utilisation", "averaging B/step", "consensus distance",
                            "longest stall s", "kills"], table))
    result = {"options": {**asdict(opts), "seeds": list(opts.seeds), "schemes": list(opts.schemes),
                          "conditions": list(opts.conditions)}, "rows": rows, "arms": arms}
    write_result(out, "averaging", result, md)
    return result, md
