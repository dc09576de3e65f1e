"""Capped-link runs alone (subspace vs dense boundaries), as quoted in the README:
``python capped_runs.py MBPS OUT [auto|netns|transport]``.

The link backend is chosen like ``agora demo --link-mbps`` (network namespaces + tc tbf when root, else the
in-transport throttle) unless given, and recorded with its reason, because the two backends cap different traffic.
The runs are ``agora.bench.efficiency.capped_runs`` (``small``, 3 stages x 2 replicas, 4 steps, 4 in flight).
"""
import json
import sys
from pathlib import Path

from agora.bench.efficiency import EfficiencyOptions, capped_runs
from agora.lab.demo import plan_links

mbps, out = float(sys.argv[1]), Path(sys.argv[2])
plan = plan_links(mbps, 0.0, sys.argv[3] if len(sys.argv) > 3 else "auto")
res = {"link_backend": plan.backend, "link_backend_reason": plan.reason,
       **capped_runs(out, EfficiencyOptions(link_mbps=mbps, steps=4, in_flight=4), plan.backend)}
print(json.dumps(res, indent=1), flush=True)
(out / "capped.json").write_text(json.dumps({"link_mbps": mbps, **res}, indent=1))
