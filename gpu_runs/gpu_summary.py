"""Scratch: summarize an nsys cuda_gpu_trace csv: kernels per step, busy time, gaps."""
import csv, sys, collections
rows = list(csv.DictReader(open(sys.argv[1])))
steps = int(sys.argv[2])
ev = []
names = collections.Counter(); dur_by = collections.Counter()
for r in rows:
    try:
        s = float(r["Start (ns)"]); d = float(r["Duration (ns)"])
    except (KeyError, ValueError):
        continue
    n = r.get("Name", "?")
    ev.append((s, s + d, n))
    short = n[:70]
    names[short] += 1; dur_by[short] += d
ev.sort()
busy = 0; cur_s, cur_e = None, None
for s, e, _ in ev:
    if cur_e is None or s > cur_e:
        if cur_e is not None: busy += cur_e - cur_s
        cur_s, cur_e = s, e
    else:
        cur_e = max(cur_e, e)
busy += cur_e - cur_s
span = ev[-1][1] - ev[0][0]
print(f"{len(ev)} GPU ops ({len(ev)/steps:.0f}/step), span {span/1e6/steps:.2f} ms/step, busy {busy/1e6/steps:.2f} ms/step ({100*busy/span:.0f}%)")
for n, d in dur_by.most_common(40):
    print(f"{d/1e3/steps:9.1f} us/step {names[n]/steps:7.1f}/step  {n}")
