import re, sys, statistics
for tag in sys.argv[1:]:
    L = {}; G = {}
    for line in open(f"/tmp/exp/{tag}.log"):
        m = re.search(r"^step (\d+) loss ([\d.]+) .*grad_norm ([\d.]+)", line)
        if m: L[int(m.group(1))] = float(m.group(2)); G[int(m.group(1))] = float(m.group(3))
    done = [l for l in open(f"/tmp/exp/{tag}.log") if l.startswith("done")]
    jumps = []
    for n in range(100, max(L), 100):
        base = statistics.fmean(L[s] for s in range(n - 9, n + 1))
        after = max(L[s] for s in range(n + 1, n + 11))
        jumps.append(round(after - base, 3))
    print(tag, "max loss jump in 10 steps after each update:", jumps)
    print("   grad_norm > 5 at", [(s, round(g)) for s, g in G.items() if g > 5], "|", done[0].strip() if done else "running")
