"The fused smooth SVM head's loss and gradient errors against float64 on the CPU (gpucheck.fused_head_errors): on CUDA through chapter 05c's kernels (head_kernels_on_cuda) and through the chunked path, at n = 3000 and 300, and on the CPU (the chunked path). Run from the repository root with PYTHONPATH=. on a CUDA machine."
from topk_nb.ops.fused import head_kernels_on_cuda
from topk_nb.perf.gpucheck import fused_head_errors

for device, n, kernels in (("cuda", 3000, True), ("cuda", 3000, False), ("cpu", 3000, False), ("cuda", 300, True),
                           ("cuda", 300, False)):
    with head_kernels_on_cuda(kernels):
        errs = fused_head_errors("smooth_svm", (32, 64, n), k=5, device=device)
    print(" | ".join([device, "kernels" if kernels else "chunked", f"(32, 64, {n})", f"loss {errs['loss_err']:.1e}",
                      *(f"{leaf} {e:.1e}" for leaf, e in errs["grad_err"].items())]))
