import sys, asyncio, hashlib, torch
sys.path.insert(0, "tests")  # run from the repository root
from swarm_util import local_swarm, wait_until
from agora.client.trainer import Trainer
from agora.config import load_manifest
from agora.data import build_datasets
from agora.lab.train_local import train_local
from agora.server.node import NodeOptions

MAN = load_manifest(sys.argv[1]).with_overrides(**{"residual.wire_dtype": "fp32"})
steps = int(sys.argv[2])
def digest(params):
    return [hashlib.md5(p.detach().cpu().numpy().tobytes()).hexdigest()[:8] for p in params]
central = {}
import agora.lab.train_local as TL
import agora.server.averaging.clip as CL
captured = []
orig = torch.nn.utils.clip_grad_norm_
def spy(params, clip, *a, **k):
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    total = torch.nn.utils.get_total_norm(grads)
    captured.append(("central", float(total), float(torch.clamp(clip / (total + 1e-6), max=1.0)), [float(torch.linalg.vector_norm(g)) for g in grads]))
    return orig(params, clip, *a, **k)
torch.nn.utils.clip_grad_norm_ = spy
origscale = CL.GlobalClip.scale
async def scale_spy(self, step, grads, inactive=()):
    r = await origscale(self, step, grads, inactive)
    captured.append(("swarm", self.ctx.stage_index, step, r, CL.tensor_norms(grads)))
    return r
CL.GlobalClip.scale = scale_spy
def after(model, opt, step):
    central[step] = [(i, [p.detach().clone() for p in s.parameters()]) for i, s in enumerate(model.stages)]
local = train_local(MAN, steps, val_batches=1, after_step=after)["train_loss"]
names = {i: [n for n, _ in s.named_parameters()] for i, s in enumerate(__import__('agora.model', fromlist=['PipelineModel']).PipelineModel(MAN).stages)}
torch.manual_seed(MAN.seed)
train, _, _ = build_datasets(MAN)
accum = MAN.batch.target_batch_size // MAN.batch.microbatch_size
source = train.batches(MAN.batch.microbatch_size, seed=MAN.seed)
batches = [next(source) for _ in range(steps * accum)]
layout = list(range(len(MAN.stages)))
async def main():
    async with local_swarm(MAN, layout, NodeOptions(stall_step_s=1e9)) as (boot, peers, nodes):
        trainer = Trainer(MAN, boot, shard=None)
        await trainer.start()
        await wait_until(lambda: all(len(s) == 1 for s in trainer.swarm), 30, "stages")
        for i, batch in enumerate(batches):
            await trainer.send(batch)
            if (i + 1) % accum == 0:
                step = (i + 1) // accum
                await wait_until(lambda: all(n.step >= step for n in nodes), 60, "the step")
                for n in nodes:
                    mine = [p.detach() for p in n.runtime.stage.parameters()]
                    ref = central[step - 1][n.stage_index][1]
                    diff = [(names[n.stage_index][j], '%.1e' % float((a - b).abs().max() / b.abs().max()), int((a != b).sum()), a.numel()) for j, (a, b) in enumerate(zip(mine, ref)) if not torch.equal(a, b)]
                    if diff:
                        print("step", step - 1, "stage", n.stage_index, "differs:", diff[:6], len(diff), flush=True)
                if step >= steps: break
        trainer.close()
asyncio.run(main())
torch.nn.utils.clip_grad_norm_ = orig
for c in captured:
    print(c[:4] if c[0]=="swarm" else c[:3])
cn = [c for c in captured if c[0]=="central"][0][3]
sw = {c[1]: c[4] for c in captured if c[0]=="swarm" and c[2]==0}
allsw = sw[0]+sw[1]+sw[2]
print("norms equal:", cn == allsw, len(cn), len(allsw))
print([ (i, a, b) for i,(a,b) in enumerate(zip(cn, allsw)) if a != b][:10])
print("done")
