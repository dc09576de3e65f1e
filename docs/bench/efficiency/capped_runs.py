import json, sys
from pathlib import Path
from agora.swarm.demo import run_demo
mbps = float(sys.argv[1]); out = Path(sys.argv[2])
res = {}
for residual in ("subspace", "dense"):
    s = run_demo(preset="small", stages=3, replicas=2, steps=4, out=out / f"{residual}-{mbps:g}mbit", in_flight=4,
                 live=False, timeout=1200, residual=residual, link_mbps=mbps)
    res[residual] = {"tokens_per_s": s["tokens_per_s"], "tokens": s["tokens"], "wall_s": s["wall_s"], "finished": s["finished"],
                     "bytes_per_boundary": s["bytes_per_boundary"]}
    print(residual, res[residual], flush=True)
(out / "capped.json").write_text(json.dumps({"link_mbps": mbps, **res}, indent=1))
