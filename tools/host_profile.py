"Where an eager call's host time goes on a CUDA machine (run from the repository root with PYTHONPATH=.): host time per call, cProfile, torch.profiler's CPU operators, the host cost of allocations, views and autograd, and of each Triton launch of a smooth_svm step through the package's launcher against the compiled kernel called directly."
import cProfile, gc, inspect, io, pstats, sys, time
import torch, torch.nn.functional as F
from topk_nb.loss.registry import get_loss
from topk_nb.ops import launch as K

dev = torch.device("cuda")
B, n = 256, 1000
g = torch.Generator().manual_seed(0)
s = torch.randn(B, n, generator=g).to(dev)
y = torch.randint(0, n, (B,), generator=g).to(dev)
crits = {"F.cross_entropy": F.cross_entropy, "topk_hinge": get_loss("topk_hinge"), "smooth_svm": get_loss("smooth_svm"),
         "noised_bal": get_loss("noised_bal")}


def stepper(crit):
    x = s.clone().requires_grad_()
    def step():
        x.grad = None
        crit(x, y).backward()
    return step


def per_call_us(fn, calls=200, rounds=5):
    for _ in range(10): fn()
    torch.cuda.synchronize()
    best = 1e9
    gc.disable()
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls): fn()
        best = min(best, (time.perf_counter() - t0) / calls)
        torch.cuda.synchronize()
    gc.enable()
    return best * 1e6


print("== host us per call (best of 5 rounds of 200, gc off)")
steps = {name: stepper(c) for name, c in crits.items()}
for name, st in steps.items(): print(f"{name:18s} {per_call_us(st):8.1f}")

for name in ("smooth_svm", "topk_hinge"):
    st = steps[name]
    pr = cProfile.Profile(); pr.enable()
    for _ in range(300): st()
    pr.disable(); torch.cuda.synchronize()
    out = io.StringIO(); pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(28)
    print(f"== cProfile {name} (300 calls; us per call = tottime / 300 * 1e6)"); print(out.getvalue()[-6000:])

from torch.profiler import profile, ProfilerActivity
for name in ("smooth_svm",):
    st = steps[name]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(50): st()
    torch.cuda.synchronize()
    print(f"== torch.profiler CPU {name} (50 calls)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))

print("== micro costs, us per call")
buf = torch.empty(1 << 16, dtype=torch.uint8, device=dev)
micro = {
    "torch.empty((256,6) f32 cuda)": lambda: torch.empty(B, 6, dtype=torch.float32, device=dev),
    "torch.empty((256,) f64 cuda)": lambda: torch.empty(B, dtype=torch.float64, device=dev),
    "s.new_empty(256)": lambda: s.new_empty(B),
    "torch.empty_like(s)": lambda: torch.empty_like(s),
    "buf[a:b].view(int32).view(256,6)": lambda: buf[1024:1024 + 6144].view(torch.int32).view(B, 6),
    "torch.add (8,)": lambda: torch.add(buf[:8], buf[:8]),
    "torch.cuda.current_stream().cuda_stream": lambda: torch.cuda.current_stream().cuda_stream,
    "torch._C._cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
    "x.data_ptr() % 16": lambda: s.data_ptr() % 16,
}
class _Sum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x): return x.new_empty(())
    @staticmethod
    def backward(ctx, g): return g.new_empty(B, n)
xs = s.clone().requires_grad_()
def fn_bwd():
    xs.grad = None
    _Sum.apply(xs).backward()
def ce_fwd(): return F.cross_entropy(s, y)
micro["F.cross_entropy forward, no grad"] = ce_fwd
micro["autograd.Function (empty fwd, empty bwd) + backward()"] = fn_bwd
for label, fn in micro.items(): print(f"{label:45s} {per_call_us(fn, 2000, 3):7.2f}")

print("== Triton launches: the package's _launch against a bound compiled kernel")
try:
    from triton import knobs
except ImportError:
    knobs = None
recorded = []
K._LAUNCHES.record = lambda kernel, grid, *a, **kw: recorded.append((kernel, grid, a, kw))
try:
    steps["smooth_svm"]()
finally:
    K._LAUNCHES.record = None
torch.cuda.synchronize()
out1 = torch.empty(1, device=dev)
recorded.append((K.store_one_kernel, (1,), (out1,), {}))
for kernel, grid, a, kw in recorded:
    opts = K._compile_options(kernel)
    plain = lambda: K._launch(kernel, grid, *a, **kw)
    compiled = kernel[grid](*a, **kw, **opts)
    names = list(inspect.signature(kernel.fn).parameters)
    bound = inspect.signature(kernel.fn).bind(*a, **{k: v for k, v in kw.items() if k in names})
    bound.apply_defaults()
    allargs = tuple(bound.arguments.values())
    g3 = tuple(grid) + (1,) * (3 - len(grid))
    stream = torch._C._cuda_getCurrentRawStream(dev.index or 0)
    enter = knobs.runtime.launch_enter_hook if knobs else None
    exitf = knobs.runtime.launch_exit_hook if knobs else None
    compiled._init_handles()
    run, fnh, meta = compiled.run, compiled.function, compiled.packed_metadata
    direct = lambda: run(g3[0], g3[1], g3[2], stream, fnh, meta, None, enter, exitf, *allargs)
    runner = compiled[g3]
    viarunner = lambda: runner(*allargs, stream=stream)
    try:
        print(f"{kernel.fn.__name__:28s} args {len(allargs):2d}  _launch {per_call_us(plain, 1000, 3):6.1f}  "
              f"runner {per_call_us(viarunner, 1000, 3):6.1f}  direct run {per_call_us(direct, 1000, 3):6.1f}")
    except Exception as e:
        print(kernel.fn.__name__, "bound launch failed:", type(e).__name__, str(e)[:300])
torch.cuda.synchronize()
print("done")
