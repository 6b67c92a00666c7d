"""Checks that need a CUDA GPU (`make gpu-test` runs them with the kernel tests): every registry loss on the GPU in
float32 against float64 on the CPU, no host synchronisation on the default path (CUDA's sync debug mode), the fused
kernels compiled (not interpreted) on the route the losses take, and a compiled training step. Without a GPU the
module is skipped with one line; CI has none, and the same checks run there on the CPU through the interpreter
(tests/test_kernels.py) and the sync-free path (tests/test_sync_free.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("no CUDA device: these checks run on a GPU (make gpu-test)", allow_module_level=True)

from topk_nb.perf import gpucheck; from topk_nb.ops import launch as kernels, svm as svm_kernels  # noqa: E402
from topk_nb.loss.svm import svm_route  # noqa: E402


def test_every_loss_within_the_targets_of_float64():
    out = gpucheck.check_correctness("cuda", cases=((64, 100, 5), (32, 1000, 20)))
    bad = {name: entry for name, entry in out["losses"].items() if not entry["ok"]}
    assert out["status"] == "ok", bad


def test_no_loss_synchronises_with_the_host():
    out = gpucheck.check_syncs("cuda", batch=64, n=1000, k=5)
    found = {(name, variant): entry for name, variants in out["losses"].items() for variant, entry in variants.items()
             if variant == "check_finite=False" and (entry.get("aten") or entry.get("debug_mode", "none") != "none"
                                                     or "error" in entry)}
    assert not found, found


def test_the_kernels_run_compiled_on_the_losses_route():
    x = torch.randn(8, 300, device="cuda")
    assert os.environ.get("TRITON_INTERPRET") != "1"                 # compiled for this GPU, not interpreted
    assert kernels.HAS_TRITON and svm_route(x, 5) == "kernels" and kernels.triton_ok(x, 5)
    assert kernels.count_launches(lambda: svm_kernels.smooth_svm_triton(x, torch.zeros(8, dtype=torch.long, device="cuda"),
                                                                   5, 1.0).sum()) == 2   # the forward: tiles, then rows


@pytest.mark.parametrize("name", ["smooth_svm", "noised_bal"])
def test_a_label_that_is_no_class_stops_at_the_device_assert(name):
    "The finishing kernel asserts the labels on the device (no separate assert launched): a label out of range stops the step with its message, as F.cross_entropy's device assert does. In a process of its own: a device assert leaves the CUDA context unusable."
    code = (f"import torch; from topk_nb.loss.registry import get_loss; crit = get_loss({name!r}, k=3)\n"
            "s, y = torch.randn(4, 20, device='cuda'), torch.tensor([0, 20, 3, -100], device='cuda')\n"
            "loss = crit(s, y); torch.cuda.synchronize(); print('no assert:', loss.item())")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "no assert" not in out, out[-2000:]
    assert "device-side assert" in out and "class indices in [0, n - 1]" in out, out[-2000:]


@pytest.mark.parametrize("name", ["smooth_svm", "noised_bal", "topk_grouping"])
def test_a_training_step_compiles_whole(name):
    out = gpucheck.check_compile("cuda", batch=32, features=16, n=200, k=5, names=[name])
    assert out["status"] == "ok", out["losses"][name]


from topk_nb.loss.registry import LOSSES  # noqa: E402


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_is_captured_in_a_cuda_graph_with_its_module_on_the_cpu(name):
    "A loss module left on the CPU (class counts, margins and weights there) with scores on the GPU: after one warm-up call nothing is copied from the host, so a CUDA graph captures the step and its replay gives the eager value."
    from topk_nb.loss.registry import LOSSES, get_loss
    kw = {"weight": torch.linspace(0.5, 2.0, 100)}
    if LOSSES[name].needs_class_counts: kw["class_counts"] = torch.arange(1, 101)
    if LOSSES[name].stochastic: kw["epsilon"] = 0.0 if name == "noised_imbal" else 0.2
    crit = get_loss(name, **kw)
    s, y = torch.randn(32, 100, device="cuda"), torch.randint(0, 100, (32,), device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2): eager = crit(s, y)                            # warm-up: the device copies made once
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = crit(s, y)
    graph.replay(); torch.cuda.synchronize()
    if not LOSSES[name].stochastic or kw.get("epsilon") == 0.0:
        torch.testing.assert_close(out, eager)
    assert torch.isfinite(out)


@pytest.mark.parametrize("name", list(LOSSES))
def test_every_loss_forward_and_backward_replays_from_a_cuda_graph(name):
    "The eager step through the module's kept plan, forward and backward, captured whole: its replay gives the eager gradient."
    from topk_nb.loss.registry import get_loss
    kw = {"class_counts": torch.arange(1, 101)} if LOSSES[name].needs_class_counts else {}
    if LOSSES[name].stochastic: kw["epsilon"] = 0.0 if name == "noised_imbal" else 0.2
    crit = get_loss(name, **kw)
    s, y = torch.randn(32, 100, device="cuda"), torch.randint(0, 100, (32,), device="cuda")
    x = s.clone().requires_grad_()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):                                               # warm-up: the plan made, the copies kept
            x.grad = None
            crit(x, y).backward()
    torch.cuda.current_stream().wait_stream(stream)
    eager = x.grad.clone()
    assert crit.__dict__.get("_plans"), "the eager call took no plan"
    x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        crit(x, y).backward()
    x.grad.zero_()
    graph.replay(); torch.cuda.synchronize()
    if not LOSSES[name].stochastic or kw.get("epsilon") == 0.0:
        torch.testing.assert_close(x.grad, eager)
    assert torch.isfinite(x.grad).all()


@pytest.mark.parametrize("name", ["smooth_svm", "noised_imbal", "ldam"])
def test_reduce_overhead_compiles_and_replays(name):
    "torch.compile(mode='reduce-overhead'): the loss's graph captured by CUDA graphs (class counts and margins on the device once), the same value as eager."
    from topk_nb.loss.registry import get_loss
    kw = {"class_counts": torch.arange(1, 101)} if LOSSES[name].needs_class_counts else {}
    if name == "noised_imbal": kw["epsilon"] = 0.0
    crit = get_loss(name, **kw).cuda()
    s, y = torch.randn(32, 100, device="cuda"), torch.randint(0, 100, (32,), device="cuda")
    compiled = torch.compile(crit, mode="reduce-overhead", fullgraph=True)
    for _ in range(3): out = compiled(s, y)                             # recorded, then replayed
    torch.testing.assert_close(out.clone(), crit(s, y), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["smooth_svm", "noised_bal", "topk_hinge", "focal"])
@pytest.mark.parametrize("misaligned", [False, True])
def test_bound_launches_give_the_float64_values(name, misaligned):
    "Launches bound to their compiled kernels (`kernels._bound_launch`: the second call of a signature on) give the loss and gradient of float64 on the CPU, on scores at an address 16 bytes divide and at one they do not (another specialisation, bound apart); the bindings were made and used."
    from topk_nb.loss.registry import LOSSES, get_loss
    torch.manual_seed(0)
    B, n = 64, 1000
    s64 = torch.randn(B, n, dtype=torch.float64)
    y = torch.randint(0, n, (B,))
    extra = {"epsilon": 0.0} if name.startswith("noised") else {}         # no draws to match across devices
    ref_in = s64.clone().requires_grad_()
    ref = get_loss(name, **extra)(ref_in, y)
    ref.backward()
    crit = get_loss(name, **extra)
    for call in range(3):                                                   # the first through Triton, then bound
        store = torch.empty(B * n + 1, device="cuda")
        x = (store[1:] if misaligned else store[:-1]).view(B, n)             # 4 bytes past an aligned address, or on it
        x.copy_(s64.float()).requires_grad_()
        before = len(kernels._BIND.table)
        loss = crit(x, y.cuda())
        loss.backward()
        assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item()), (call, loss.item(), ref.item())
        err = (x.grad.double().cpu() - ref_in.grad).abs().max() / ref_in.grad.abs().max()
        assert err <= 1e-4, (call, err.item())
        if call > 0: assert len(kernels._BIND.table) == before              # nothing new to bind: every launch bound
    assert any(k[0] is not None and v is not None for k, v in kernels._BIND.table.items()), "no launch was bound"


def _fused_svm_errors(kernels: bool, n: int) -> tuple[float, float]:
    "The fused smooth SVM head's loss error and largest gradient error against float64 (`gpucheck.fused_head_errors`), (B, d) = (32, 64), n classes, through chapter 05c's kernels or the chunked path."
    from topk_nb.ops.fused import head_kernels_on_cuda
    with head_kernels_on_cuda(kernels):
        errs = gpucheck.fused_head_errors("smooth_svm", (32, 64, n), k=5, device="cuda")
    return errs["loss_err"], max(errs["grad_err"].values())


@pytest.mark.parametrize("n", [300, 3000])
def test_the_fused_smooth_svm_head_gives_the_float64_gradients(n):
    "The fused head as a user calls it on CUDA (the chunked path, chapter 05c's kernels being off there by default)."
    loss_err, grad_err = _fused_svm_errors(kernels=False, n=n)
    assert loss_err <= 1e-5 and grad_err <= 1e-4, (loss_err, grad_err)


@pytest.mark.xfail(strict=True, reason="compiled for an H200 (Triton 3.6) the fused head's kernels gave gradients beyond "
                   "the tolerance (results/gpu/nvidia-h200-2026-11-28-fused-svm-gradients.log); in the interpreter they pass")
@pytest.mark.parametrize("n", [300, 3000])
def test_the_fused_head_kernels_give_the_float64_gradients(n):
    "Chapter 05c's kernels compiled for this GPU: once they pass, the xfail fails, and they can be taken by default."
    loss_err, grad_err = _fused_svm_errors(kernels=True, n=n)
    assert loss_err <= 1e-5 and grad_err <= 1e-4, (loss_err, grad_err)
