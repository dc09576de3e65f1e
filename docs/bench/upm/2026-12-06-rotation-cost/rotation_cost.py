"""CPU time of one signed-permutation transform of a `small` stage's input frame (coordinate basis), with AdamW moments:
rotate_input on the middle stage and on the tail. Run: PYTHONPATH=src python THIS_FILE"""
import time, torch
torch.set_num_threads(1)
from agora.config import load_manifest
from agora.model import Stage
from agora.frames import enable_frames, rotate_input, rotate_output, signed_permutation
man = load_manifest("small").with_overrides(**{"residual.basis": "coordinates", "security.upm": {"every_s": 30, "transforms": "signed_permutations"}})
x = torch.randn(8, 128, 512)
for idx in (1, 2):
    st = Stage(man, idx)
    enable_frames(st, fold=False)
    opt = torch.optim.AdamW(st.parameters())
    for p in st.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    moments = lambda p: opt.state[p]
    g = torch.Generator().manual_seed(1)
    t = time.process_time()
    for _ in range(5):
        rotate_input(st, signed_permutation(8, g), moments)
    ri = (time.process_time() - t) / 5
    t = time.process_time()
    if idx == 1:
        for _ in range(5):
            rotate_output(st, signed_permutation(8, g))
    ro = (time.process_time() - t) / 5
    print(f"stage {idx}: rotate_input {ri*1000:.0f} ms CPU, rotate_output {ro*1000:.0f} ms CPU, params {sum(p.numel() for p in st.parameters())/1e6:.1f}M")
