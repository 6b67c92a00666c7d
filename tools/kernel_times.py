"""Device time of each loss's forward+backward on CUDA, per kernel, from torch.profiler: `python tools/kernel_times.py OUT.json [KS]`.

The cases of the committed record `results/gpu/*-kernel-times.json`: standard normal scores (scale 1), k = 5, B = 256 at
n = 1000, 10^5 and 10^6, B = 4096 at n = 1000. It runs `kernel_times` of the GPU check (chapter 15), whose `kernels`
section records the same at the speed section's shapes; each row's ratio is to F.cross_entropy's device time in the
same run. KS, a comma-separated list of k (say 5,20,100), times the smooth SVM alone at each other k too, at B = 256
and n = 1000 and 10^5 (k = 100 takes the kernels of a polynomial a warp)."""
import json
import sys

from topk_nb.perf.gpucheck import kernel_times

if len(sys.argv) not in (2, 3):
    sys.exit("usage: python tools/kernel_times.py OUT.json [KS, comma-separated k]")
out, rows = sys.argv[1], []
try:
    ks = [int(k) for k in sys.argv[2].split(",")] if len(sys.argv) == 3 else [5]
except ValueError:
    sys.exit(f"KS must be comma-separated integers, got {sys.argv[2]!r}")
cases = [(256, n, 5, ["noised_bal", "noised_imbal"] + (["smooth_svm"] if n <= 100_000 else []))
         for n in (1000, 100_000, 1_000_000)] + [(4096, 1000, 5, ["noised_bal", "noised_imbal", "smooth_svm"])]
cases += [(256, n, k, ["smooth_svm"]) for k in ks if k != 5 for n in (1000, 100_000)]
for batch, n, k, names in cases:
    res = kernel_times("cuda", (n,), batch, k=k, repeats=10 if n < 1_000_000 else 5, names=names, scale=1.0)
    for r in res["rows"]:
        rows.append({"B": batch, "k": k, **r})
        print(json.dumps(rows[-1]), flush=True)
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
