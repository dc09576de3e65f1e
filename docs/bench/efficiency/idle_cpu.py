"""Idle CPU of one stage node process (plus its hivemind children) over a window, no traffic."""
import subprocess, sys, time, os, signal, psutil, tempfile
out = tempfile.mkdtemp()
maddr = os.path.join(out, "boot")
py = sys.executable  # run with the project venv: .venv/bin/python docs/bench/efficiency/idle_cpu.py
boot = subprocess.Popen([py, "-m", "agora.cli", "bootstrap", "--manifest", "tiny", "--maddr-file", maddr], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
while not (os.path.exists(maddr) and open(maddr).read().strip()): time.sleep(0.2)
peer = open(maddr).read().split()[0]
nodes = [subprocess.Popen([py, "-m", "agora.cli", "node", "--manifest", "tiny", "--stage", str(s), "--initial-peers", peer], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for s in (0, 0, 1)]
time.sleep(25)
def cpu(pid):
    t = 0
    p = psutil.Process(pid)
    for q in [p, *p.children(recursive=True)]:
        try: c = q.cpu_times(); t += c.user + c.system
        except psutil.Error: pass
    return t
c0 = [cpu(n.pid) for n in nodes]; b0 = cpu(boot.pid)
time.sleep(20)
c1 = [cpu(n.pid) for n in nodes]; b1 = cpu(boot.pid)
print("idle node CPU share:", [round((b - a) / 20, 3) for a, b in zip(c0, c1)], "bootstrap:", round((b1 - b0) / 20, 3))
for p in nodes + [boot]:
    os.killpg(p.pid, signal.SIGKILL)
