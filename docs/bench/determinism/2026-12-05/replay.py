"""Diagnostic replay (not a test): the plain 3 x 2 `tiny` swarm of tests/test_upm_swarm.py, 12 times, printing each
run's final loss, the steps each node took (step, samples, group) and every stage's squared gradient norm per step.
Run from the repository root: python docs/bench/determinism/2026-12-05/replay.py. It wraps GlobalClip.scale and
TiedExchange.offer_and_fetch to record what they saw (a measurement, not a harness)."""
import asyncio, sys, logging, collections
sys.path.insert(0, "tests")
from agora.server.averaging import clip as clipmod
from agora.server.averaging.tied import TiedExchange
REC = collections.defaultdict(list)
orig = clipmod.GlobalClip.scale
async def scale(self, step, grads):
    s = await orig(self, step, grads)
    REC["scale"].append((self.ctx.stage_index, step, round(clipmod.squared_norm(grads), 9)))
    return s
clipmod.GlobalClip.scale = scale
origt = TiedExchange.offer_and_fetch
async def oaf(self, step, averaged):
    out = await origt(self, step, averaged)
    REC["tied"].append((self.ctx.stage_index, step, float(out[self.index].double().norm())))
    return out
TiedExchange.offer_and_fetch = oaf
from test_upm_swarm import _train, _manifest
for i in range(12):
    REC.clear()
    r = asyncio.run(_train(_manifest(False, signed=True)))
    print("RESULT", i, repr(r["after"]), flush=True)
    for n in r["nodes"]:
        print("  node", n.stage_index, n.peer_id[-6:], [(e["step"], e["samples"], e["group"]) for e in n.events if e["kind"] == "step"], flush=True)
    print("  norm", sorted(set(REC["scale"])), flush=True)
    print("  tied", sorted(REC["tied"]), flush=True)
