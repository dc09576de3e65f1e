"""Capped-link runs alone (subspace vs dense boundaries), as quoted in the README: ``python capped_runs.py MBPS OUT``.

The link backend is chosen like ``agora demo --link-mbps`` (network namespaces + tc tbf when root, else the
in-transport throttle) and recorded with its reason, because the two backends cap different traffic.
"""
import json, sys
from pathlib import Path
from agora.swarm.demo import plan_links, run_demo
mbps = float(sys.argv[1]); out = Path(sys.argv[2])
backend = sys.argv[3] if len(sys.argv) > 3 else "auto"
plan = plan_links(mbps, 0.0, backend)
res = {"link_backend": plan.backend, "link_backend_reason": plan.reason}
for residual in ("subspace", "dense"):
    # No validation pass: only throughput is compared, and at a few Mbit/s a dense trainer's last validation
    # microbatches outlast the demo's 90 s stop window (it is then killed and its token count lost).
    s = run_demo(preset="small", stages=3, replicas=2, steps=4, out=out / f"{residual}-{mbps:g}mbit", in_flight=4,
                 val_batches=0, live=False, timeout=1200, residual=residual, link_mbps=mbps,
                 link_backend=plan.backend)
    res[residual] = {"tokens_per_s": s["tokens_per_s"], "tokens": s["tokens"], "wall_s": s["wall_s"], "finished": s["finished"],
                     "bytes_per_boundary": s["bytes_per_boundary"], "link_backend": s["link"]["backend"],
                     "rounds_ok": s["rounds_ok"], "rounds_failed": s["rounds_failed"]}
    print(residual, res[residual], flush=True)
(out / "capped.json").write_text(json.dumps({"link_mbps": mbps, **res}, indent=1))
