import json, glob, statistics as st
res = {}
for f in sorted(glob.glob('/work/benchruns/s41/avg-*-s*/result.json')):
    code = f.split('/')[-2].split('-')[1]
    for a in json.load(open(f))['arms']:
        res.setdefault((code, a['seed']), {})[a['scheme']] = a
print("| scheme | code | train s per seed | median | full's time / this per seed | median | loss vs full, median | rounds failed |")
print("|---|---|---|---|---|---|---|---|")
for scheme in ['full', 'diloco+float16', 'gossip_q1', 'gossip_q1+float16']:
    for code in ['base', 'dev']:
        seeds = sorted(s for c, s in res if c == code)
        ts = [res[(code, s)][scheme]['train_s'] for s in seeds]
        rat = [res[(code, s)]['full']['train_s'] / res[(code, s)][scheme]['train_s'] for s in seeds]
        lv = [res[(code, s)][scheme]['val_loss'] / res[(code, s)]['full']['val_loss'] for s in seeds]
        fails = sum(res[(code, s)][scheme]['rounds_failed'] or 0 for s in seeds)
        oks = sum(res[(code, s)][scheme]['rounds_ok'] or 0 for s in seeds)
        print(f"| {scheme} | {'before' if code == 'base' else 'after'} | {', '.join(f'{t:.1f}' for t in ts)} | {st.median(ts):.1f} | "
              f"{', '.join(f'{r:.2f}' for r in rat)} | **{st.median(rat):.2f}** | {st.median(lv):.4f} | {fails}/{fails + oks} |")
