"The fused smooth SVM head's loss and gradient errors against float64 on the CPU: on CUDA through chapter 05c's kernels (head_kernels_on_cuda) and through the chunked path, at n = 3000 and 300, and on the CPU (the chunked path). Run from the repository root with PYTHONPATH=. on a CUDA machine."
import torch, torch.nn.functional as F
from topk_nb.fused_kernels import head_kernels_on_cuda
from topk_nb.gpucheck import _fused_leaves, _fused_modules
from topk_nb.losses import get_loss

for dev, shape, kernels in (("cuda", (32, 64, 3000), True), ("cuda", (32, 64, 3000), False), ("cpu", (32, 64, 3000), False),
                            ("cuda", (32, 64, 300), True), ("cuda", (32, 64, 300), False)):
    x, W, b, y = _fused_leaves(*shape, torch.float32, torch.device(dev), seed=1)
    crit = _fused_modules(5)["smooth_svm"]()
    with head_kernels_on_cuda(kernels):
        loss = crit(x, W, y, b)
        grads = torch.autograd.grad(loss, (x, W, b))
    ref_in = [t.detach().double().cpu().requires_grad_() for t in (x, W, b)]
    ref = get_loss("smooth_svm", k=5)(F.linear(*ref_in), y.cpu())
    rg = torch.autograd.grad(ref, ref_in)
    out = [dev, "kernels" if kernels else "chunked", shape, f"loss {abs(loss.item() - ref.item()) / abs(ref.item()):.1e}"]
    for nm, a, r in zip("xWb", grads, rg):
        e = (a.double().cpu() - r).abs()
        i = e.argmax().item()
        out.append(f"{nm} {(e.max() / r.abs().max()).item():.1e} at {i} (got {a.flatten()[i].item():.4e}, want {r.flatten()[i].item():.4e})")
    print(" | ".join(map(str, out)))
