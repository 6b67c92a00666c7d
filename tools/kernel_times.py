"""Device time of each loss's forward+backward on CUDA, per kernel, from torch.profiler: `python tools/kernel_times.py OUT.json [LOSSES]`.

The wall column is CUDA-event time per step (launch gaps included); device_us sums the kernels' own time.
The speed section of `make gpu-check` times whole steps from the host; this script says which kernel the time goes to."""
import json, os, sys, time, torch, torch.nn.functional as F
from torch.profiler import profile, ProfilerActivity
from topk_nb import smooth_svm, noised_bal
from topk_nb import kernels
dev = "cuda"
out = sys.argv[1]
only = set(sys.argv[2].split(",")) if len(sys.argv) > 2 else None   # e.g. ce,smooth_svm: those losses only
rows = []
def devtime(step, reps):
    for _ in range(2): step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        for _ in range(reps): step()
        torch.cuda.synchronize()
    per = {}
    for e in p.key_averages():
        t = getattr(e, "self_device_time_total", 0) or 0
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            per[e.key[:60]] = per.get(e.key[:60], 0) + t / reps
    # wall per step with events
    s, f = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): step()
    f.record(); torch.cuda.synchronize()
    return sum(per.values()), s.elapsed_time(f) * 1000 / reps, per
def case(name, B, n, k, fn, reps):
    if only is not None and name not in only: return
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(B, n, device=dev, generator=g).requires_grad_()
    y = torch.randint(0, n, (B,), device=dev, generator=g)
    step = lambda: fn(x, y, k).backward()
    try:
        t0 = time.time()
        dt, wt, per = devtime(step, reps)
        top = sorted(per.items(), key=lambda kv: -kv[1])[:4]
        r = dict(loss=name, B=B, n=n, k=k, device_us=round(dt, 1), wall_us=round(wt, 1), kernels={a: round(b, 1) for a, b in top}, s=round(time.time()-t0, 1))
    except Exception as e:
        r = dict(loss=name, B=B, n=n, k=k, error=repr(e)[:300])
    rows.append(r); print(json.dumps(r), flush=True)
    json.dump(rows, open(out, "w"), indent=1)
ce = lambda x, y, k: F.cross_entropy(x, y)
svm = lambda x, y, k: smooth_svm(x, y, k, 1.0)
nb = lambda x, y, k: noised_bal(x, y, k)
for B, n in [(256, 1000), (256, 100000), (4096, 1000)]:
    case("ce", B, n, 0, ce, 20)
    for k in (5, 20, 100):
        if B == 4096 and k == 100: continue
        case("smooth_svm", B, n, k, svm, 5 if n >= 100000 else 10)
    case("noised_bal", B, n, 5, nb, 10)
case("ce", 256, 1000000, 0, ce, 10)
case("noised_bal", 256, 1000000, 5, nb, 5)
