"""Device time of each loss's forward+backward on CUDA, per kernel, from torch.profiler: `python tools/kernel_times.py OUT.json`.

The cases of the committed record `results/gpu/*-kernel-times.json`: standard normal scores (scale 1), k = 5, B = 256 at
n = 1000, 10^5 and 10^6, B = 4096 at n = 1000. It runs `kernel_times` of the GPU check (chapter 15), whose `kernels`
section records the same at the speed section's shapes; each row's ratio is to F.cross_entropy's device time in the
same run."""
import json
import sys

from topk_nb.gpucheck import kernel_times

out, rows = sys.argv[1], []
for batch, ns in [(256, (1000, 100_000, 1_000_000)), (4096, (1000,))]:
    for n in ns:
        names = ["noised_bal", "noised_imbal"] + (["smooth_svm"] if n <= 100_000 else [])
        res = kernel_times("cuda", (n,), batch, k=5, repeats=10 if n < 1_000_000 else 5, names=names, scale=1.0)
        for r in res["rows"]:
            rows.append({"B": batch, **r})
            print(json.dumps(rows[-1]), flush=True)
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)
