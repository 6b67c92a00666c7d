"""The fused Triton kernels (topk_nb.ops: launch, svm, noised) on small shapes against PyTorch references. On a CUDA machine they run
compiled, on tensors on the GPU; without one, in Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1). The references are computed on the CPU either way."""
import pytest
import torch
import torch.nn.functional as F

kernels = pytest.importorskip("topk_nb.ops.launch")
if not kernels.HAS_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

from topk_nb.ops import noised as noised_kernels, svm as svm_kernels  # noqa: E402

from topk_nb.loss.noised import noised_bal, noised_imbal, margins_from_counts  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")   # where the kernels run: compiled, or interpreted


@pytest.mark.parametrize("n, k, samples", [(2, 1, 3), (13, 2, 2), (64, 5, 3), (257, 9, 2)])
def test_kernel_is_topk_of_the_given_noise(n, k, samples):
    g = torch.Generator().manual_seed(n)
    s, z = 3 * torch.randn(4, n, generator=g), torch.randn(samples, 4, n, generator=g)
    mean, idx = (t.cpu() for t in noised_kernels.perturbed_kth_triton(s.to(DEV), k, 0.7, samples, noise=z.to(DEV)))
    ref = (s + 0.7 * z).topk(k, dim=-1)
    torch.testing.assert_close(mean, ref.values[..., -1].mean(0), rtol=1e-6, atol=1e-6)
    assert torch.equal(idx, ref.indices[..., -1])


@pytest.mark.parametrize("n, k, samples, block", [(40, 1, 2, 16), (100, 5, 3, 16), (257, 9, 2, 64), (48, 48, 2, 16)])
def test_long_rows_by_chunks_are_topk_of_the_given_noise(n, k, samples, block):
    "Rows longer than a block: each chunk's K largest, then the merge; exactly PyTorch's topk of s + eps z."
    g = torch.Generator().manual_seed(n + k)
    s, z = 3 * torch.randn(3, n, generator=g), torch.randn(samples, 3, n, generator=g)
    mean, idx = (t.cpu() for t in noised_kernels.perturbed_kth_triton(s.to(DEV), k, 0.7, samples, noise=z.to(DEV), block=block))
    ref = (s + 0.7 * z).topk(k, dim=-1)
    torch.testing.assert_close(mean, ref.values[..., -1].mean(0), rtol=1e-6, atol=1e-6)
    assert torch.equal(idx, ref.indices[..., -1])


def test_chunks_draw_the_same_noise_as_one_block():
    s = torch.randn(4, 150, device=DEV)
    one = noised_kernels.perturbed_kth_triton(s, 4, 0.5, 3, generator=torch.Generator().manual_seed(9))
    chunked = noised_kernels.perturbed_kth_triton(s, 4, 0.5, 3, generator=torch.Generator().manual_seed(9), block=32)
    assert torch.equal(one[0], chunked[0]) and torch.equal(one[1], chunked[1])


def test_kernel_draws_follow_the_seed():
    s = torch.randn(3, 20, device=DEV)
    a = noised_kernels.perturbed_kth_triton(s, 3, 0.5, 4, generator=torch.Generator().manual_seed(7))
    b = noised_kernels.perturbed_kth_triton(s, 3, 0.5, 4, generator=torch.Generator().manual_seed(7))
    c = noised_kernels.perturbed_kth_triton(s, 3, 0.5, 4, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a[1], b[1]) and not torch.equal(a[1], c[1])


@pytest.mark.parametrize("n, k, block, cap, spread", [(100, 6, None, 16, 4.0), (100, 6, None, 16, 0.5), (300, 4, 64, 16, 4.0),
                                                     (300, 4, 64, 8, 4.0), (64, 5, None, 8, 4.0)])
def test_pruned_selection_is_topk_of_the_given_noise(n, k, block, cap, spread):
    "Pruning (classes that cannot be among a chunk's K largest draw no noise) changes nothing: exactly PyTorch's topk."
    _pruned_case(n, k, block, cap, spread)


def _live(s, z, k, eps):
    "Each row's live classes as the pruned kernel counts them for a row of one chunk with the noise given: within eps max|z| (1.001) above the least noised value, over the draws, of the row's k largest scores."
    reach = eps * z.abs().amax(0).amax(1, keepdim=True) * 1.001
    top = s.topk(k, dim=-1).indices                                    # (rows, k)
    floor = (s.gather(-1, top) + eps * z.gather(-1, top.expand(z.shape[0], -1, -1))).amin(0).amin(1, keepdim=True)
    return (s + reach >= floor).sum(1)


def _pruned_case(n, k, block, cap, spread):
    "Run one case against topk; return each row's live classes, about as the kernel counts them."
    g = torch.Generator().manual_seed(n + k)
    s, z = spread * torch.randn(3, n, generator=g), torch.randn(4, 3, n, generator=g)
    mean, idx = (t.cpu() for t in noised_kernels.perturbed_kth_triton(s.to(DEV), k, 0.3, 4, noise=z.to(DEV), block=block, cap=cap))
    ref = (s + 0.3 * z).topk(k, dim=-1)
    torch.testing.assert_close(mean, ref.values[..., -1].mean(0), rtol=1e-6, atol=1e-5)
    assert torch.equal(idx, ref.indices[..., -1])
    return _live(s, z, k, 0.3)                                      # about the kernel's (exactly for one chunk)


@pytest.mark.parametrize("block", [None, 64])
def test_pruned_threshold_of_tied_scores(block):
    "Scores on a few levels (the K-th largest score tied many times): the threshold of one chunk (the last of its top list) and of several (the K-th of all lists) keeps every class that a draw can select."
    g = torch.Generator().manual_seed(7)
    s = 0.7 * torch.randint(-3, 1, (3, 300), generator=g).float()   # levels -2.1 .. 0, each about 75 times
    s[:, 10:12] = 3.0                                                  # two above them: the 4th largest is a tied 0
    z = torch.randn(4, 3, 300, generator=g)
    mean, idx = (t.cpu() for t in noised_kernels.perturbed_kth_triton(s.to(DEV), 4, 0.3, 4, noise=z.to(DEV), block=block, cap=16))
    x = s + 0.3 * z
    ref = x.topk(4, dim=-1).values[..., -1]
    torch.testing.assert_close(mean, ref.mean(0), rtol=1e-6, atol=1e-5)
    assert torch.equal(x.gather(-1, idx.unsqueeze(-1)).squeeze(-1), ref)


def test_pruned_cases_take_both_paths():
    "The cases above: rows of spread scores fit the tile of live classes (the pruned path), rows of close ones do not (the whole chunk)."
    fits, spills = _pruned_case(100, 6, None, 16, 4.0), _pruned_case(100, 6, None, 16, 0.5)
    assert (fits <= 16).any() and (spills > 16).all(), (fits, spills)


def test_pruned_selection_takes_each_tile():
    "One chunk of 64 with a tile of 32 (a quarter tile of 8, a sixteenth of 2): rows whose live classes fit the sixteenth, the quarter tile, the whole tile, or none (the whole chunk) all give PyTorch's topk of the given noise."
    g = torch.Generator().manual_seed(5)
    s = torch.full((4, 64), -50.0)
    s[0, :2] = 10.0                                                   # 2 live classes: the sixteenth tile
    s[1, :5] = 10.0 + 0.01 * torch.arange(5.0)                        # 5: the quarter tile
    s[2, :20] = 10.0 + 0.01 * torch.arange(20.0)                      # 20: the whole tile
    s[3] = 0.01 * torch.arange(64.0)                                  # 64: none
    s = s + 1e-3 * torch.rand(4, 64, generator=g)                     # no ties
    z = torch.randn(5, 4, 64, generator=g)
    live = _live(s, z, 2, 0.3)                                        # as the kernel counts them
    assert live[0] <= 2 < live[1] <= 8 < live[2] <= 32 < live[3], live
    mean, idx = (t.cpu() for t in noised_kernels.perturbed_kth_triton(s.to(DEV), 2, 0.3, 5, noise=z.to(DEV), cap=32))
    ref = (s + 0.3 * z).topk(2, dim=-1)
    torch.testing.assert_close(mean, ref.values[..., -1].mean(0), rtol=1e-6, atol=1e-5)
    assert torch.equal(idx, ref.indices[..., -1])


@pytest.mark.parametrize("block, cap", [(None, 0), (None, 32), (16, 0), (16, 8)])
@pytest.mark.parametrize("k", [2, 5])
def test_ties_and_signed_zeros_select_in_class_order(block, cap, k):
    "Rows of tied entries, -0 among +0 (the noise given as signed zeros): every path (one chunk or four, the whole chunk or each pruned tile) takes the K-th largest and the first class that holds it, as a stable sort does."
    g = torch.Generator().manual_seed(3)
    s = torch.full((4, 64), -1.0)
    s[0, [3, 5]], s[0, 40] = 0.0, 2.0                                  # 2 live classes (a tile's sixteenth, cap 32)
    s[1, 0], s[1, 10:16] = 1.0, 0.0                                    # 7: its quarter
    s[2, 4:24] = 0.0                                                   # 20: the whole tile
    s[3, 2:60] = 0.0                                                   # 58: none, the whole chunk
    neg = torch.rand(4, 64, generator=g) < 0.5
    s = torch.where(neg & (s == 0), -0.0, s)                           # signed zeros, equal as numbers
    z = torch.where(torch.rand(3, 4, 64, generator=g) < 0.5, -0.0, 0.0)   # s + 0.3 z keeps the sign of a zero
    mean, idx = (t.cpu() for t in noised_kernels.perturbed_kth_triton(s.to(DEV), k, 0.3, 3, noise=z.to(DEV), block=block, cap=cap))
    x = s + 0.3 * z
    ref = torch.sort(x, dim=-1, descending=True, stable=True)          # ties in class order
    torch.testing.assert_close(mean, ref.values[..., k - 1].mean(0), rtol=0, atol=0)
    assert torch.equal(idx, ref.indices[..., k - 1]), (idx, ref.indices[..., k - 1])


@pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")   # the interpreter's min over NaN alone (k = 1)
@pytest.mark.parametrize("k", [1, 3])
def test_a_nan_score_ranks_first_as_in_topk(k):
    "A NaN among the scores of a pruned row is live (no comparison rules it out) and ranks above every number, as in torch.topk: with K = 1 the row's value is NaN, with K = 3 the third entry of topk."
    g = torch.Generator().manual_seed(8)
    s, z = 4 * torch.randn(3, 3000, generator=g), torch.randn(4, 3, 3000, generator=g)
    s[1, 1234] = float("nan")
    assert noised_kernels._selection_plan(3, 3000, 4, 0, 0)["CAP"] > 0      # the row is pruned
    mean, idx = (t.cpu() for t in noised_kernels.perturbed_kth_triton(s.to(DEV), k, 0.2, 4, noise=z.to(DEV)))
    ref = (s + 0.2 * z).topk(k, dim=-1)
    torch.testing.assert_close(mean, ref.values[..., -1].mean(0), rtol=1e-6, atol=1e-5, equal_nan=True)
    assert torch.equal(idx, ref.indices[..., -1])
    assert torch.isnan(mean[1]) == (k == 1)


def test_pruned_selection_draws_the_same_noise():
    "With the kernels' own noise: pruned or not, chunked or not, the same draws select the same entries, bit for bit."
    s = 4 * torch.randn(3, 600, generator=torch.Generator().manual_seed(4)).to(DEV)
    runs = [noised_kernels.perturbed_kth_triton(s, 4, 0.1, 3, generator=torch.Generator().manual_seed(9), block=b, cap=c)
            for b, c in [(None, 0), (None, 32), (128, 0), (128, 16)]]
    for other in runs[1:]:
        assert torch.equal(other[0], runs[0][0]) and torch.equal(other[1], runs[0][1])


def test_randn_bound_holds_and_is_near_tight():
    "Every normal the kernels draw is within RANDN_BOUND, which exceeds the Box-Muller extreme sqrt(-2 ln 1e-7) by < 0.05 %; the draws are standard normal."
    import math
    extreme = math.sqrt(-2 * math.log(1e-7))
    assert extreme <= noised_kernels.RANDN_BOUND < extreme * 1.0005
    edge = torch.empty(32, device=DEV)
    kernels_extreme_normals[(1,)](edge)                              # the largest radius at sixteen angles
    angles = torch.arange(16, dtype=torch.float64) * math.pi / 8
    torch.testing.assert_close(edge.cpu().double(), extreme * torch.cat([angles.cos(), angles.sin()]), rtol=0, atol=1e-5)
    out = torch.empty(2**20, device=DEV)
    kernels_normals[(2**20 // 2**14,)](out, 77, G=2**12)
    assert out.abs().max().item() <= noised_kernels.RANDN_BOUND
    q = torch.tensor([0.01, 0.1, 0.5, 0.9, 0.99])
    torch.testing.assert_close(torch.quantile(out.cpu(), q), torch.distributions.Normal(0.0, 1.0).icdf(q), rtol=0, atol=0.02)


if kernels.HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def kernels_normals(out_ptr, seed, G: tl.constexpr):
        quads = tl.program_id(0) * G + tl.arange(0, G)
        tl.store(out_ptr + 4 * tl.program_id(0) * G + tl.arange(0, 4 * G), noised_kernels._normals(seed, quads.to(tl.int64)))

    @triton.jit
    def kernels_extreme_normals(out_ptr):
        lanes = tl.arange(0, 16)
        c, s = noised_kernels._box_muller(tl.zeros([16], dtype=tl.uint32), lanes.to(tl.uint32) * 0x10000000)
        tl.store(out_ptr + lanes, c)
        tl.store(out_ptr + 16 + lanes, s)


@pytest.mark.parametrize("dtype, n", [(torch.float64, 40), (torch.float32, 2500)])
def test_noised_hinge_kernel_loss_and_gradient(dtype, n):
    "The fused hinge against the float64 hinge and eq. (12) on the same draws; inactive rows have zero loss and gradient."
    g = torch.Generator().manual_seed(n)
    s = 2 * torch.randn(5, n, generator=g, dtype=dtype)
    y = torch.cat([s[:2].argmax(1), s[2:].argmin(1)])
    s[[0, 1], y[:2]] += 5
    margin = torch.rand(5, generator=g, dtype=dtype)
    x = s.to(DEV).requires_grad_()
    loss = noised_kernels.noised_hinge_triton(x, y.to(DEV), 4, 0.5, 6, margin.to(DEV), 2.5, generator=torch.Generator().manual_seed(2))
    (grad,) = torch.autograd.grad(loss.sum(), x)
    mean, idx = (t.cpu() for t in noised_kernels.perturbed_kth_triton(s.to(DEV), 4, 0.5, 6, generator=torch.Generator().manual_seed(2)))
    hinge = margin.double() + mean.double() - s.double().gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(loss.cpu().double(), 2.5 * hinge.clamp(min=0), rtol=1e-6, atol=1e-5)
    expected = 2.5 * (hinge > 0).double()[:, None] * (F.one_hot(idx, n).double().mean(0) - F.one_hot(y, n).double())
    torch.testing.assert_close(grad.cpu().double(), expected, rtol=1e-6, atol=1e-7)
    assert (loss[:2] == 0).all() and (loss[2:] > 0).all()
    with pytest.raises(ValueError, match="epsilon"):
        noised_kernels.noised_hinge_triton(x, y.to(DEV), 4, 0.0, 6)
    with pytest.raises(ValueError, match="margin must be"):
        noised_kernels.noised_hinge_triton(x, y.to(DEV), 4, 0.5, 6, torch.ones(3, device=DEV))


@pytest.mark.parametrize("imbalanced", [False, True])
def test_noised_losses_use_the_kernel_and_its_gradient(imbalanced):
    g = torch.Generator().manual_seed(3)
    s, y = torch.randn(8, 30, generator=g, dtype=torch.float64), torch.randint(0, 30, (8,), generator=g)
    counts = torch.randint(1, 50, (30,), generator=g)
    s, y, counts = s.to(DEV), y.to(DEV), counts.to(DEV)
    x = s.clone().requires_grad_()
    with kernels.force_triton():
        if imbalanced:
            loss = noised_imbal(x, y, counts, k=3, epsilon=0.4, n_samples=5, scale=2.0, reduction="sum",
                                     generator=torch.Generator().manual_seed(1))
        else:
            loss = noised_bal(x, y, k=3, epsilon=0.4, n_samples=5, reduction="sum",
                                   generator=torch.Generator().manual_seed(1))
    loss.backward()
    mean, idx = noised_kernels.perturbed_kth_triton(s, 4, 0.4, 5, generator=torch.Generator().manual_seed(1))
    margin, scale = (margins_from_counts(counts)[y], 2.0) if imbalanced else (1.0, 1.0)
    hinge = margin + mean.double() - s.gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(loss, scale * F.relu(hinge).sum())
    expected = F.one_hot(idx, 30).double().mean(0) - F.one_hot(y, 30).double()     # eq. (12), on the same draws
    torch.testing.assert_close(x.grad, scale * (hinge > 0).double()[:, None] * expected)


def test_rows_too_long_or_k_too_large_take_the_pytorch_path():
    with kernels.force_triton():
        assert kernels.triton_ok(torch.zeros(2, kernels.MAX_ROW, device=DEV), kernels.MAX_KTH)
        assert kernels.triton_ok(torch.zeros(1, device=DEV).expand(2, 10**6), kernels.MAX_KTH)   # long rows: chunks
        assert not kernels.triton_ok(torch.zeros(1, device=DEV).expand(2, kernels.kth_max_row(1) + 1), 1)
        assert not kernels.triton_ok(torch.zeros(2, 10, device=DEV), kernels.MAX_KTH + 1)
    assert not kernels.triton_ok(torch.zeros(2, 10), 1)           # CPU tensors outside force_triton


# --- the smooth top-k SVM kernels ---------------------------------------------------------------------------

from topk_nb.perf.bench import aten_ops, syncing_ops  # noqa: E402
from topk_nb.base.core import force_sync_free  # noqa: E402
from topk_nb.loss.svm import smooth_svm, smooth_topk_svm_bruteforce, svm_route  # noqa: E402
from topk_nb.math.esp_backward import tree_svm_loss  # noqa: E402


@pytest.mark.parametrize("n, k, tau, block", [(5, 1, 1.0, None), (8, 3, 0.2, 4), (11, 4, 5.0, 4), (9, 8, 1.0, 4),
                                              (10, 2, 1e-4, 8)])
def test_svm_kernels_equal_subset_enumeration(n, k, tau, block):
    g = torch.Generator().manual_seed(n + k)
    s = (4 * torch.randn(3, n, generator=g, dtype=torch.float64)).requires_grad_()
    y = torch.randint(0, n, (3,), generator=g)
    loss = svm_kernels.smooth_svm_triton(s.to(DEV), y.to(DEV), k, tau, alpha=0.5, block_n=block)
    grad, = (t.cpu() for t in torch.autograd.grad(loss.sum(), s))
    loss = loss.detach().cpu()
    s_ref = s.detach().clone().requires_grad_()
    ref = smooth_topk_svm_bruteforce(s_ref, y, k, tau, alpha=0.5)
    grad_ref, = torch.autograd.grad(ref.sum(), s_ref)
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-10, atol=1e-12)


@pytest.mark.chapter("03a")
@pytest.mark.parametrize("n, k, tau, scale", [(120, 5, 1.0, 3.0), (100, 10, 1e-4, 1.0), (41, 40, 1.0, 1.0),
                                              (90, 20, 100.0, 1.0), (150, 3, 0.05, 100.0)])
def test_svm_kernels_float32_within_targets_of_float64(n, k, tau, scale):
    "Float32 scores through the log-space scans (block_n given): spread scores, tau from 1e-4 to 100, k = n - 1 (every other class in the top k; n = 41, two blocks: the scans cost k x n in the interpreter)."
    g = torch.Generator().manual_seed(n)
    s = (scale * torch.randn(2, n, generator=g)).requires_grad_()
    y = torch.randint(0, n, (2,), generator=g)
    loss = svm_kernels.smooth_svm_triton(s.to(DEV), y.to(DEV), k, tau, block_n=32)
    grad, = (t.cpu() for t in torch.autograd.grad(loss.sum(), s))
    loss = loss.detach().cpu()
    ref_in = s.detach().double().requires_grad_()
    ref = smooth_svm(ref_in, y, k, tau, reduction="none", hard_switch=False)
    ref_grad, = torch.autograd.grad(ref.sum(), ref_in)
    assert loss.dtype == torch.float32 and torch.isfinite(grad).all()
    assert ((loss.double() - ref).abs() <= 1e-4 * ref.abs() + 1e-30).all()
    assert (grad.double() - ref_grad).abs().max() <= 1e-4 * ref_grad.abs().max()


@pytest.mark.chapter("03a")
@pytest.mark.parametrize("n, k, tau, scale, tile, equal", [
    (60, 1, 1.0, 3.0, None, False), (700, 5, 0.5, 3.0, 256, False), (300, 3, 1e-4, 1.0, None, False),
    (80, 5, 100.0, 1.0, None, False), (7, 5, 1.0, 3.0, None, False), (12, 5, 1.0, 0.0, None, True),
    (300, 20, 1e-2, 10.0, 256, False),
    (300, 40, 1.0, 3.0, 64, False), (400, 100, 1.0, 1.0, None, False), (60, 40, 1.0, 1.0, None, False),   # above
    (120, 40, 1e-2, 1.0, None, False), (200, 40, 0.1, 0.0, None, True)])   # SVM32_MAX_K: k = 40 and 100 only, so that
                                                                           # a GPU compiles few variants
def test_svm32_kernels_within_targets_of_float64(n, k, tau, scale, tile, equal):
    "The extended-float kernels of float32 scores: several tiles, all-head rows (n near k), equal scores, tau from 1e-4 to 100; above SVM32_MAX_K a polynomial a warp (k = 100; all-head rows: the scans take the backward)."
    rows = 3 if k <= svm_kernels.SVM32_MAX_K else 2                      # the interpreter runs a warp's lanes one by one
    g = torch.Generator().manual_seed(n + k)
    s = torch.zeros(rows, n) if equal else scale * torch.randn(rows, n, generator=g)
    y = torch.randint(0, n, (rows,), generator=g)
    go = torch.rand(rows, generator=g) + 0.5
    x = s.to(DEV).requires_grad_()
    loss = svm_kernels.smooth_svm_triton(x, y.to(DEV), k, tau, tile=tile)
    grad, = torch.autograd.grad((loss * go.to(DEV)).sum(), x)
    loss, grad = loss.detach().cpu(), grad.cpu()
    ref_in = s.double().requires_grad_()
    ref = tree_svm_loss(ref_in, y, k, tau, 1.0)
    ref_grad, = torch.autograd.grad((ref * go.double()).sum(), ref_in)
    assert loss.dtype == torch.float32 and torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert ((loss.double() - ref).abs() <= 1e-4 * ref.abs()).all()
    assert ((grad.double() - ref_grad).abs().amax(1) <= 1e-4 * ref_grad.abs().amax(1)).all()


def test_svm32_kernels_give_nan_past_their_range():
    "A score gap past the exponents' range (2^23 in log2 e) makes that row's loss and gradient NaN, not a wrong number."
    s = torch.randn(3, 30)
    s[1, 7] = 1e7
    x = s.to(DEV).requires_grad_()
    loss = svm_kernels.smooth_svm_triton(x, torch.tensor([0, 0, 5], device=DEV), 2, 0.5)
    loss.sum().backward()
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2]]).all()
    assert torch.isnan(x.grad[1]).all() and torch.isfinite(x.grad[[0, 2]]).all()


@pytest.mark.chapter("03a")
def test_large_k_backward_takes_the_scans_on_rows_with_a_head_only():
    "One row with a class far above the rest (t_i > 1/2) among rows without: the grad kernel marks that row alone, the scans give its gradient, Horner the others'; all match float64. Rows of 126 classes: the forward's tile checks two chunks pass by pass and two once, the scans take one block (their cost in the interpreter grows with the blocks)."
    s = torch.randn(3, 126, generator=torch.Generator().manual_seed(3))
    s[1, 5] += 300.0
    y = torch.tensor([0, 0, 7])
    x = s.to(DEV).requires_grad_()
    loss = svm_kernels.smooth_svm_triton(x, y.to(DEV), 40, 1.0)
    grad, = torch.autograd.grad(loss.sum(), x)
    loss, grad = loss.detach().cpu(), grad.cpu()
    ref_in = s.double().requires_grad_()
    ref = tree_svm_loss(ref_in, y, 40, 1.0, 1.0)
    ref_grad, = torch.autograd.grad(ref.sum(), ref_in)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-5, atol=0)
    assert ((grad.double() - ref_grad).abs().amax(1) <= 1e-4 * ref_grad.abs().amax(1)).all()
    st = svm_kernels._svm32_forward_op(s.to(DEV), y.to(DEV), None, 40, 1.0, 1.0, 0, -1, kernels.ROWS)[2]
    *_, rho, sc, se, dm, _ = (t.cpu() for t in svm_kernels.svm32_state_views(st, 3, 40))
    lrho = (se[:, 39] - se[:, 40]).double() + torch.log2(sc[:, 39].double() / sc[:, 40].double())
    assert (dm.double() + lrho > -1.0).tolist() == [False, True, False]


@pytest.mark.parametrize("k, tile", [(5, 0), (5, 256), (40, 0), (40, 64)])
def test_forward_stores_the_backward_constants(k, tile):
    "The forward's constants for the Horner backward, a polynomial a thread (k = 5) and a warp (k = 40), rows of one tile and of several: log2 rho_k and r_j = rho_j / rho_k as float64 computes them from the stored sigma."
    s = torch.randn(2, 300, generator=torch.Generator().manual_seed(k + tile))
    y = torch.tensor([3, 200])
    st = svm_kernels._svm32_forward_op(s.to(DEV), y.to(DEV), None, k, 1.0, 1.0, tile, -1, kernels.ROWS)[2]
    *_, rho, sc, se, dm, rr = (t.cpu() for t in svm_kernels.svm32_state_views(st, 2, k))
    log2_sigma = torch.log2(sc.double()) + se.double()                # (2, k + 1)
    log2_rho = log2_sigma[:, :-1] - log2_sigma[:, 1:]                 # log2 sigma_{j-1} / sigma_j, j = 1..k
    torch.testing.assert_close(rr[:, 0].double(), log2_rho[:, -1], rtol=0, atol=1e-5)
    torch.testing.assert_close(rr[:, 1:].double(), torch.exp2(log2_rho - log2_rho[:, -1:]), rtol=1e-5, atol=0)


@pytest.mark.chapter("03a")
def test_large_k_kernels_give_nan_past_their_range():
    s = torch.randn(2, 60)
    s[1, 7] = 1e9
    loss = svm_kernels.smooth_svm_triton(s.to(DEV), torch.tensor([0, 5], device=DEV), 40, 0.5).cpu()
    assert torch.isnan(loss[1]) and torch.isfinite(loss[0])


def test_large_k_fixed_exponent_passes_and_tiles():
    "Normal scores at tau = 1: every pass of a tile takes the fixed exponents (four a chunk of 32), and the loss of a row cut into tiles is the loss of the row in one. Rows of 200 classes: four tiles of 64 (the last one short), one tile of 224 against three of 96."
    s = torch.randn(2, 200, generator=torch.Generator().manual_seed(4))
    y = torch.tensor([3, 150])
    passes = svm_kernels.svm32_tiles(s.to(DEV), y.to(DEV), 100, 1.0, tile=64)[3].cpu()
    assert passes.shape == (2, 4) and (passes == 4 * 64 // 32).all()
    one = svm_kernels.smooth_svm_triton(s.to(DEV), y.to(DEV), 100, 1.0, tile=224).cpu()
    cut = svm_kernels.smooth_svm_triton(s.to(DEV), y.to(DEV), 100, 1.0, tile=96).cpu()
    torch.testing.assert_close(cut, one, rtol=1e-6, atol=0)
    assert svm_kernels.svmw_plan(256, 1000) == (256, 4) and svm_kernels.svmw_plan(256, 100_000)[1] == 16


def test_svm_kernels_differentiate_twice():
    g = torch.Generator().manual_seed(2)
    s = torch.randn(2, 7, generator=g, dtype=torch.float64).to(DEV).requires_grad_()
    y = torch.randint(0, 7, (2,), generator=g).to(DEV)
    assert torch.autograd.gradgradcheck(lambda x: svm_kernels.smooth_svm_triton(x, y, 3, 0.5, block_n=4), (s,))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_smooth_svm_takes_the_kernels_without_syncs(reduction):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 40, generator=g).to(DEV).requires_grad_()
    y = torch.randint(0, 40, (4,), generator=g).to(DEV)
    ref = smooth_svm(x.detach().double().cpu(), y.cpu(), 5, 0.5, reduction=reduction)
    step = lambda: smooth_svm(x, y, 5, 0.5, reduction=reduction).sum().backward()
    with force_sync_free(), kernels.force_triton():
        assert svm_route(x, 5) == "kernels"
        out = smooth_svm(x, y, 5, 0.5, reduction=reduction).cpu()
        launches = kernels.count_launches(step)
        ops = aten_ops(step)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-7)
    assert launches == 3 and not syncing_ops(ops)                 # float32, a row of one tile: one kernel forward, two backward
    from topk_nb.perf.bench import _METADATA, _NO_LAUNCH
    kernels_run = sum(v for op, v in ops.items() if op not in _NO_LAUNCH | _METADATA)   # allocations and views launch nothing
    assert kernels_run + launches <= 30                           # the CUDA path's launch budget per forward+backward


def test_svm_kernels_refuse_what_they_cannot_take():
    x = torch.randn(2, 10, device=DEV)
    with kernels.force_triton():
        assert svm_kernels.svm_triton_ok(x, 9) and not svm_kernels.svm_triton_ok(x, 10)
        assert not svm_kernels.svm_triton_ok(torch.randn(2, 500, device=DEV), svm_kernels.SVM_MAX_K + 1)
        assert not svm_kernels.svm_triton_ok(torch.randn(10, device=DEV), 3)
    assert not svm_kernels.svm_triton_ok(x.cpu(), 3)                    # CPU tensors outside force_triton
    with pytest.raises(ValueError, match="k"):
        svm_kernels.smooth_svm_triton(x, torch.zeros(2, dtype=torch.long, device=DEV), 10, 1.0)


_COMPILE = """
import sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from topk_nb.ops import launch as K, noised as noised_kernels, svm as svm_kernels
ptrs = lambda names, kinds: dict(zip(names, kinds))
fwd = ptrs(["s_ptr", "y_ptr", "loss_ptr", "lsig_ptr", "rho_ptr", "ckpt_ptr"], ["*fp32", "*i64"] + ["*fp64"] * 4)
fwd.update(n="i32", n_blocks="i32", inv_ktau_bits="i64", alpha_tau_bits="i64", tau_bits="i64")
bwd = ptrs(["s_ptr", "y_ptr", "go_ptr", "w_ptr", "den_ptr", "lsig_ptr", "rho_ptr", "ckpt_ptr", "scratch_ptr", "g_ptr"],
           ["*fp32", "*i64", "*fp32", "*fp32", "*fp32"] + ["*fp64"] * 4 + ["*fp32"])
bwd.update(n="i32", n_blocks="i32", inv_ktau_bits="i64", ignore_index="i32")
conv = {"REDUCTION": 1, "HAS_WEIGHT": True}        # a module's weighted mean: the conventions in the gradient kernels
for k, fast in ((1, True), (3, True), (3, False)):
    for fn, sig, extra in ((svm_kernels._svm_forward_kernel, fwd, {}), (svm_kernels._svm_backward_kernel, bwd, conv)):
        sig = {**sig, "K": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "FAST": "constexpr",
               **{name: "constexpr" for name in extra}}
        if not fast:
            sig = {name: ("*fp64" if name in ("s_ptr", "go_ptr", "g_ptr", "den_ptr") else kind) for name, kind in sig.items()}
        const = {"K": k, "BLOCK_N": 64, "BLOCK_K": triton.next_power_of_2(k + 1), "FAST": fast, **extra}
        assert triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32)).asm["cubin"]
tile = ptrs(["s_ptr", "y_ptr", "tw_ptr", "st_ptr"], ["*fp32", "*i64", "*fp32", "*fp32"])
tile.update(n_rows="i32", n="i32", n_tiles="i32", tile="i32", d_scale="fp32", alpha_tau_bits="i64", tau_bits="i64")
row = ptrs(["tw_ptr", "st_ptr"], ["*fp32", "*fp32"])
row.update(n_rows="i32", n_tiles="i32", alpha_tau_bits="i64", tau_bits="i64")
gtile = ptrs(["s_ptr", "y_ptr", "go_ptr", "w_ptr", "den_ptr", "st_ptr", "g_ptr", "ws_ptr"],
             ["*fp32", "*i64", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32"])
gtile.update(n_rows="i32", n="i32", n_tiles="i32", tile="i32", d_scale="fp32", ignore_index="i32")
grow = ptrs(["st_ptr", "y_ptr", "go_ptr", "w_ptr", "den_ptr", "g_ptr", "ws_ptr"],
            ["*fp32", "*i64", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32"])
grow.update(n_rows="i32", n="i32", n_tiles="i32", ignore_index="i32")
for k in (1, 3, 9):                                # 9: the forward's class loop is a loop above k = 8
    lanes, hmax = {"K": k, "L": 32, "LOG_L": 5, "R": 8}, triton.next_power_of_2(3 * k + 2)
    for fn, sig, const in ((svm_kernels._svm32_tile_kernel, tile, {**lanes, "ONE_TILE": False}),
                           (svm_kernels._svm32_tile_kernel, tile, {**lanes, "ONE_TILE": True}), (svm_kernels._svm32_row_kernel, row, {"K": k}),
                           *((svm_kernels._svm32_grad_tile_kernel, gtile, {**lanes, "HMAX": hmax, **conv, "HEAD": head,
                                                                           "WS_IN_ST": ws})
                             for head in ((0, 1, 2) if k == 3 else (0,))   # both paths; rows without a head; with one
                             for ws in (True, False)),                     # lists in the forward's buffer (a module's
                           *((svm_kernels._svm32_grad_row_kernel, grow, {"K": k, "HMAX": hmax, **conv, "WS_IN_ST": ws})
                             for ws in (True, False))):                    # call) or their own (the operator's)
        sig = {**sig, **{name: "constexpr" for name in const}}
        assert triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32)).asm["cubin"]
head = ptrs(["s_ptr", "y_ptr", "go_ptr", "w_ptr", "den_ptr", "loss_ptr", "lsig_ptr", "st_ptr", "rho2_ptr", "ckpt_ptr",
             "scratch_ptr", "g_ptr", "ws_ptr"], ["*fp32", "*i64", "*fp32", "*fp32", "*fp32", "*fp32", "*fp64", "*fp32"]
            + ["*fp64"] * 3 + ["*fp32", "*fp32"])
head.update(n_rows="i32", n="i32", n_blocks="i32", n_tiles="i32", inv_ktau_bits="i64", tau_bits="i64", ignore_index="i32")
for k in (33, 100):                                # a polynomial a warp: M = 2, 4 degrees a lane; Horner at k = 100
    m = {"K": k, "M": -(-(k + 1) // 32)}
    for fn, sig, const in ((svm_kernels._svmw_tile_kernel, tile, {**m, "ONE_TILE": False}), (svm_kernels._svmw_tile_kernel, tile, {**m, "ONE_TILE": True}),
                           (svm_kernels._svmw_row_kernel, row, m),
                           (svm_kernels._svm32_grad_tile_kernel, gtile, {"K": k, "L": 32, "LOG_L": 5, "R": 8, "HMAX": 1, **conv, "HEAD": 1,
                                                                         "WS_IN_ST": k == 33}),
                           (svm_kernels._svm_head_rows_kernel, head, {**conv, "K": k, "BLOCK_N": 64, "BLOCK_K": 128,
                                                                      "WS_IN_ST": k == 33})):
        sig = {**sig, **{name: "constexpr" for name in const}}
        assert triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32)).asm["cubin"]
cand = ptrs(["s_ptr", "noise_ptr", "seed_ptr", "top_ptr", "scratch_ptr", "count_ptr", "cw_ptr"],
           ["*fp32", "*fp32", "*i64", "*fp32", "*i16", "*i32", "*fp32"])
cand.update(n_rows="i32", n="i32", n_chunks="i32", epsilon="fp32", bound="fp32")
merge = ptrs(["cw_ptr", "s_ptr", "y_ptr", "margin_ptr", "idx_ptr", "loss_ptr"],
             ["*fp32", "*fp64", "*i64", "*fp64", "*i64", "*fp64"])
merge.update(n_rows="i32", n="i32", n_cand="i32", alpha_bits="i64", scale_bits="i64")
grad = ptrs(["idx_ptr", "go_ptr", "loss_ptr", "y_ptr", "w_ptr", "den_ptr", "g_ptr"],
            ["*i64", "*fp64", "*fp64", "*i64", "*fp32", "*fp64", "*fp64"])
grad.update(n_rows="i32", n="i32", scale_bits="i64", ignore_index="i32")
finish = ptrs(["loss_ptr", "mean_ptr", "s_ptr", "margin_ptr", "y_ptr", "w_ptr", "out_ptr", "aux_ptr"],
              ["*fp32", "*fp32", "*fp32", "*fp64", "*i64", "*fp32", "*fp32", "*fp32"])
finish.update(n_rows="i32", n="i32", ignore_index="i32", alpha_bits="i64", scale_bits="i64")
kernels_and_constants = [(noised_kernels._perturbed_merge_kernel, merge, {"KTH": 5, "N_SAMPLES": 3, "S_PAD": 4, "SORTED": sorted_,
                                                             "HINGE": True, "HAS_MARGIN": True, "BLOCK": 1024})
                         for sorted_ in (True, False)]
kernels_and_constants += [(noised_kernels._perturbed_candidates_kernel, cand, {"KTH": 5, "N_SAMPLES": 10, "DRAWS": 3, "DS": 16, "DC": 4,
                                                                  "GIVEN_NOISE": given, "PRUNE": prune, "OVERFLOW": over,
                                                                  "BLOCK": 1024, "CAP": 256, "SMALL": 64, "TINY": 16,
                                                                  "DQ": 16})
                          for given in (False, True) for prune, over in ((False, False), (True, False), (False, True))]
floor = ptrs(["s_ptr", "noise_ptr", "seed_ptr", "top_ptr", "cls_ptr", "floor_ptr"],
             ["*fp32", "*fp32", "*i64", "*fp32", "*i32", "*fp32"]) | dict(n="i32", n_rows="i32", epsilon="fp32")
kernels_and_constants += [(noised_kernels._chunk_top_kernel, floor | dict(n_chunks="i32"),
                           {"KTH": kth, "N_SAMPLES": 10, "KPAD": kpad, "DT": 16, "GIVEN_NOISE": given, "FLOOR": one,
                            "BLOCK": 1024})
                          for kth, kpad in ((5, 8), (21, 32)) for given in (False, True) for one in (True, False)]
kernels_and_constants += [(noised_kernels._row_top_kernel, floor | dict(n_cand="i32"),
                           {"KTH": 5, "N_SAMPLES": 10, "KPAD": 8, "DT": 16, "GIVEN_NOISE": given, "BLOCK": 64})
                          for given in (False, True)]
kernels_and_constants += [(noised_kernels._perturbed_grad_kernel, grad, {"N_SAMPLES": 3, "HINGE": hinge, "REDUCTION": reduction,
                                                            "HAS_WEIGHT": reduction == 1, "BLOCK": 1024})
                          for hinge, reduction in ((False, -1), (True, -1), (True, 1))]
kernels_and_constants += [(K._finish_kernel, finish, {"REDUCTION": reduction, "HAS_WEIGHT": reduction == 1, "HINGE": hinge,
                                                      "HAS_MARGIN": hinge, "ASSERT": check, "WEIGHTED_ROWS": hinge,
                                                      "LOSS_AT": 0 if hinge else 2, "BLOCK": 256})
                          for reduction in (0, 1, 2) for hinge in (False, True) for check in (False, True)]
messages = {}
for fn, sig, const in kernels_and_constants:
    sig = {**sig, **{name: "constexpr" for name in const}}
    out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                         options=K._compile_options(fn))                # as `_launch` compiles it
    assert out.asm["cubin"]
    if fn is K._finish_kernel:                                         # the assert messages the PTX carries
        import re
        messages[const["ASSERT"]] = {bytes(int(b) for b in m.group(1).split(",")).rstrip(bytes(1)).decode()
                                     for m in re.finditer(r"\\.b8 assertMessage_\\d+\\[\\d+\\] = \\{([\\d, ]+)\\}", out.asm["ptx"])}
label = "target must hold class indices in [0, n - 1] (n classes) or ignore_index"
assert label in messages[True] and label not in messages[False], messages     # the labels' device assert, where asked
print("compiled")
"""


def test_svm_kernels_compile_for_a_gpu():
    "The interpreter is lenient; the real compiler (PTX, then an sm_90 cubin) must accept the kernels too."
    import os, subprocess, sys
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-2000:]



_ROW_COMPILE = """
import itertools, sys
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import triton
from topk_nb.ops import launch as K, rows as R
ptrs = lambda names, kinds: dict(zip(names, kinds))
fwd = ptrs(["s_ptr", "y_ptr", "m_ptr", "state_ptr"], ["*fp32", "*i64", "*fp32", "*fp32"])
fwd.update(n_rows="i32", n="i32", alpha="fp32", gamma="fp32", scale="fp32")
bwd = ptrs(["s_ptr", "y_ptr", "m_ptr", "go_ptr", "w_ptr", "den_ptr", "state_ptr", "g_ptr"],
           ["*fp32", "*i64", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32", "*fp32"])
bwd.update(n_rows="i32", n="i32", ignore_index="i32", scale="fp32")
variants = []
for name in R.ROW_LOSSES:                                 # each loss's K as `row_plan` sets it, at k = 5
    loss = R.ROW_LOSSES.index(name)
    k = {"focal": 0, "ldam": 0, "topk_hinge": 5, "cvx_hinge": 5}.get(name, 6)
    kpad = triton.next_power_of_2(max(k, 1))
    for detach, block in itertools.product((False, True) if name == "focal" else (False,), (64, R.ROW_BLOCK)):
        variants.append((R._row_loss_kernel, fwd, dict(LOSS=loss, K=k, KPAD=kpad, DETACH=detach, BLOCK=block)))
    for reduction, weighted in ((0, False), (1, True), (2, False)):
        variants.append((R._row_grad_kernel, bwd, dict(LOSS=loss, K=k, KPAD=kpad, REDUCTION=reduction, HAS_WEIGHT=weighted,
                                                       BLOCK=1024)))
for fn, sig, const in variants:
    sig = {**sig, **{name: "constexpr" for name in const}}
    out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                         options=K._compile_options(fn))                # as `_launch` compiles it
    assert out.asm["cubin"], const
print("compiled", len(variants))
"""


def test_row_kernels_compile_for_a_gpu():
    "The row losses' kernels (chapter 06a) for every loss and variant `row_plan` launches: the real compiler (PTX, then an sm_90 cubin) accepts what the interpreter runs."
    import os, subprocess, sys
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _ROW_COMPILE], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and "compiled 37" in out.stdout, out.stderr[-2000:]



# --- traced outside torch.compile: the operators, not their functions ----------------------------------------------

@pytest.mark.parametrize("name, dtype", [("smooth_svm", torch.float32), ("smooth_svm", torch.float64),
                                         ("noised_bal", torch.float32), ("noised_imbal", torch.float32)])
def test_a_trace_keeps_the_operators(name, dtype):
    """make_fx on fake tensors, as AOTAutograd traces a compiled loss's forward and backward (some torch versions run that
    trace with torch.compiler.is_compiling() false): each kernel call is its registered operator, whose fake
    implementation the tracer reads; the eager shortcut would launch a kernel on tensors that have no data."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from topk_nb.base.core import force_sync_free
    n = 20
    kw = {"class_counts": torch.arange(1, n + 1)} if name == "noised_imbal" else {}
    crit = get_loss(name, k=3, **kw)
    s = torch.randn(8, n, dtype=dtype, device=DEV, requires_grad=True)
    y = torch.randint(0, n, (8,), device=DEV)

    def step(s, y):
        loss = crit(s, y)
        return loss, torch.autograd.grad(loss, s)[0]

    with kernels.force_triton(), force_sync_free():
        graph = make_fx(step, tracing_mode="fake", _allow_non_fake_inputs=True)(s, y)   # the margins: a real buffer
    ops = [str(node.target) for node in graph.graph.nodes if str(node.target).startswith("topk_nb.")]
    assert len(ops) == 2, ops                                       # the forward's operator and the backward's
    assert "backward" in ops[1] or "grad" in ops[1], ops


_COMPILED = {                                                       # each operator's outputs as compiled code reads them
    "smooth_svm module": lambda: get_loss("smooth_svm", k=3),      # the forward's buffer, `_finish` reading its rows
    "smooth_svm rows": lambda: lambda s, y: svm_kernels.smooth_svm_triton(s, y, 3, 1.0),   # ROWS: the rows copied out
    "noised_bal module": lambda: get_loss("noised_bal", k=3),      # the means in the selection's work buffer
    "perturbed K-th": lambda: lambda s, y: noised_kernels.perturbed_kth_triton(s, 3, 0.5, 4)[0],   # a view of it
}


@pytest.mark.parametrize("case", list(_COMPILED))
def test_compiled_operators_equal_the_eager_call(case):
    "torch.compile(fullgraph=True) runs the registered operators (their buffers, aux and outputs laid out as the operators, not a module's kept plan, lay them): the same value and gradient as the eager call, the random draws included."
    from topk_nb.base.core import force_sync_free
    fn = _COMPILED[case]()
    g = torch.Generator().manual_seed(3)
    s, y = torch.randn(5, 24, generator=g).to(DEV), torch.randint(0, 24, (5,), generator=g).to(DEV)

    def run(f):
        torch.manual_seed(0)
        x = s.clone().requires_grad_()
        out = f(x, y)
        out.sum().backward()
        return out.detach(), x.grad

    torch._dynamo.reset()
    with force_sync_free(), kernels.force_triton(), torch._inductor.config.patch(fallback_random=True):
        compiled, eager = run(torch.compile(fn, fullgraph=True)), run(fn)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)


# --- the loss modules' conventions inside the kernels ------------------------------------------------------------

from topk_nb.loss.registry import get_loss  # noqa: E402


def _by_hand(rows, y, weight, ignore_index, reduction):
    "nn.CrossEntropyLoss's conventions applied to each row's loss (float64): weighted, 0 where ignored, weighted mean."
    keep = y != ignore_index
    w = (torch.ones(rows.shape[0], dtype=torch.float64) if weight is None
         else weight.double()[torch.where(keep, y, 0)])
    w = torch.where(keep, w, 0.0)
    wl = torch.where(keep, rows * w, 0.0)
    return {"none": wl, "sum": wl.sum(), "mean": wl.sum() / w.sum()}[reduction]


_CONVENTIONS = {"plain": {}, "weight, ignored rows": {"weight": True, "ignore": -100}, "ignore_index a class": {"ignore": 5}}


def _labels_and_kwargs(case, n, g):
    y = torch.randint(0, n, (6,), generator=g)
    kw, spec = {}, _CONVENTIONS[case]
    if spec.get("weight"):
        kw["weight"] = torch.rand(n, generator=g) + 0.5
    if "ignore" in spec:
        y[[1, 4]] = spec["ignore"]
        kw["ignore_index"] = spec["ignore"]
    return y, kw


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", list(_CONVENTIONS))
def test_smooth_svm_module_applies_the_conventions_in_the_kernels(dtype, reduction, case):
    "The module on the kernels' path (float32: the extended-float kernels; float64: the scans) equals the float64 tree loss with the conventions applied by hand, value and gradient."
    g = torch.Generator().manual_seed(7)
    s = 2 * torch.randn(6, 30, generator=g, dtype=dtype)
    y, kw = _labels_and_kwargs(case, 30, g)
    crit = get_loss("smooth_svm", k=3, tau=0.5, reduction=reduction, check_finite=False, **kw)
    x = s.clone().to(DEV).requires_grad_()
    with force_sync_free(), kernels.force_triton():
        assert crit.kernel_loss(x.detach(), y.to(DEV), None) is not None          # the kernels' path
        out = crit(x, y.to(DEV))
        out.sum().backward()
    x64 = s.double().clone().requires_grad_()
    rows = tree_svm_loss(x64, torch.where(y == kw.get("ignore_index", -100), 0, y), 3, 0.5, 1.0)
    ref = _by_hand(rows, y, kw.get("weight"), kw.get("ignore_index", -100), reduction)
    ref.sum().backward()
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    assert out.dtype == dtype and out.shape == ref.shape
    torch.testing.assert_close(out.cpu().double(), ref.detach(), **tol)
    torch.testing.assert_close(x.grad.cpu().double(), x64.grad, **tol)


@pytest.mark.parametrize("name", ["noised_bal", "noised_imbal"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("case", list(_CONVENTIONS))
def test_noised_modules_apply_the_conventions_in_the_kernels(name, reduction, case):
    "The noised modules on the kernels' path: the hinge of the same draws with the conventions applied by hand, and eq. (12) scaled by each row's weight (over the mean's denominator)."
    g = torch.Generator().manual_seed(11)
    s = torch.randn(6, 30, generator=g, dtype=torch.float64)
    y, kw = _labels_and_kwargs(case, 30, g)
    counts = torch.randint(1, 50, (30,), generator=g)
    extra = dict(class_counts=counts, scale=2.0) if name == "noised_imbal" else {}
    crit = get_loss(name, k=3, epsilon=0.4, n_samples=5, reduction=reduction, check_finite=False,
                    generator=torch.Generator().manual_seed(1), **extra, **kw)
    x = s.clone().to(DEV).requires_grad_()
    with force_sync_free(), kernels.force_triton():
        out = crit(x, y.to(DEV))
        out.sum().backward()
    mean, idx = (t.cpu() for t in noised_kernels.perturbed_kth_triton(s.to(DEV), 4, 0.4, 5, generator=torch.Generator().manual_seed(1)))
    yc = torch.where(y == kw.get("ignore_index", -100), 0, y)
    margin, scale = (margins_from_counts(counts)[yc], 2.0) if name == "noised_imbal" else (1.0, 1.0)
    x64 = s.clone().requires_grad_()
    hinge = margin + mean.double() - x64.gather(1, yc[:, None])[:, 0]      # the draws held: a function of s_y alone
    ref = _by_hand(scale * F.relu(hinge), y, kw.get("weight"), kw.get("ignore_index", -100), reduction)
    ref.sum().backward()
    torch.testing.assert_close(out.cpu(), ref.detach(), rtol=1e-10, atol=1e-12)
    go = -x64.grad.gather(1, yc[:, None])                                   # dL/d(row's hinge) per row, from s_y's gradient
    expected = go * (F.one_hot(idx, 30).double().mean(0) - F.one_hot(yc, 30).double())   # eq. (12) and -s_y, per row
    torch.testing.assert_close(x.grad.cpu(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["smooth_svm", "noised_bal"])
def test_module_kernels_refuse_labels_that_are_no_class(name):
    "A label neither a class nor ignore_index: a one-line error on the host path; on the sync-free path the kernels assert the labels themselves and leave no flag for the module (here the interpreter's stand-in raises at once; a GPU's device assert is tests/test_cuda.py's, in a process of its own)."
    crit = get_loss(name, k=3, check_finite=False)
    s, y = torch.randn(4, 20, device=DEV), torch.tensor([0, 20, 3, -100], device=DEV)
    if DEV.type == "cpu":
        with kernels.force_triton(), pytest.raises(ValueError, match=r"class indices in \[0, 19\], got values in \[0, 20\]"):
            crit(s, y)
        with kernels.force_triton():
            assert crit.kernel_loss(s, y, None)[2] is not None          # the host path: the flag, read back by the module
    with force_sync_free(), kernels.force_triton():
        loss, den, ok = crit.kernel_loss(s, y.clamp(max=19), None)
        assert ok is None and torch.isfinite(loss)                     # asserted in the kernels: nothing for the module
        if DEV.type == "cpu":
            with pytest.raises(RuntimeError, match=r"class indices in \[0, 19\]"):
                crit.kernel_loss(s, y, None)
            with pytest.raises(RuntimeError, match=r"class indices in \[0, 19\]"):
                crit(s, y)


@pytest.mark.chapter("03a")
@pytest.mark.parametrize("k, tau, late", [(5, 1.0, None), (12, 1.0, None), (5, 1.0, 40.0), (5, 1e-2, None)])
def test_svm32_fast_passes_within_targets_of_float64(k, tau, late):
    "Rows of 8 passes of 8 classes per thread, on fixed exponents or class by class: typical rows (all passes fixed), a class far above the rest in a late pass (that pass exact), rows of small tau whose spread refuses most passes; the loss and gradient against the float64 tree either way."
    n, tile = 2000, 2048                                               # one warp (n <= 2048): 32 threads x 8 x 8 passes
    g = torch.Generator().manual_seed(k)
    s = 3 * torch.randn(2, n, generator=g)
    y = torch.tensor([3, 1500])
    if late is not None:
        s[:, 1800] = s.amax(1) + late                                  # pass 8 of thread 8: e far above its ratios
    x = s.to(DEV).requires_grad_()
    with kernels.force_triton():
        *_, fast = svm_kernels.svm32_tiles(x.detach(), y.to(DEV), k, tau, tile)
        loss = svm_kernels.smooth_svm_triton(x, y.to(DEV), k, tau, tile=tile)
        grad, = torch.autograd.grad(loss.sum(), x)
    fast, loss, grad = fast.cpu(), loss.detach().cpu(), grad.cpu()
    passes = tile // (32 * 8)
    if tau == 1.0 and late is None:
        assert (fast == passes).all(), fast                            # every pass, the first ones (some sigma_j = 0) too
    elif late is not None:
        assert (fast == passes - 1).all(), fast                        # the late class's pass alone is exact
    else:
        assert (fast <= passes // 2).all(), fast                       # spread rows: mostly exact
    ref_in = s.double().requires_grad_()
    ref = tree_svm_loss(ref_in, y, k, tau, 1.0)
    ref_grad, = torch.autograd.grad(ref.sum(), ref_in)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert ((loss.double() - ref).abs() <= 1e-4 * ref.abs()).all()
    assert ((grad.double() - ref_grad).abs().amax(1) <= 1e-4 * ref_grad.abs().amax(1)).all()


import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from topk_nb.ops.svm import _load_poly, _poly_fixed_ok, _poly_mul, _poly_mul_fixed   # noqa: E402


@triton.jit
def _both_products(ac, ae, bc, be, fc, fe, xc, xe, ok_ptr, K: tl.constexpr):
    "The plain and the aligned product of two stored polynomials, and whether the plain one may be taken."
    AC, AE = _load_poly(ac, ae, 0, K)
    BC, BE = _load_poly(bc, be, 0, K)
    g, ok = _poly_fixed_ok(AC, AE, BC, BE, K)
    FC, FE = _poly_mul_fixed(AC, AE, BC, BE, g, K)
    XC, XE = _poly_mul(AC, AE, BC, BE, K)
    for j in tl.static_range(K + 1):
        tl.store(fc + j, FC[j])
        tl.store(fe + j, FE[j])
        tl.store(xc + j, XC[j])
        tl.store(xe + j, XE[j])
    tl.store(ok_ptr, ok.to(tl.int32))


def _poly64(x, K):
    "sigma_0..sigma_K of exp(x) in float64."
    sig = torch.zeros(K + 1, dtype=torch.float64)
    sig[0] = 1.0
    for e in x.double().exp():
        sig[1:] = sig[1:] + e * sig[:-1].clone()
    return sig


@pytest.mark.parametrize("far", [False, True])
def test_plain_polynomial_product_matches_float64_or_refuses(far):
    "The lanes' and tiles' product by plain multiply-adds: taken for polynomials of the usual spread and equal to the float64 product to float32 rounding; refused where three classes stand 150 above the rest (the aligned product stays exact)."
    K, g = 8, torch.Generator().manual_seed(11)
    x1 = torch.randn(40, generator=g)
    if far:
        x1[:3] = 150.0
    A, B = _poly64(x1, K), _poly64(torch.randn(40, generator=g), K)
    exact = torch.stack([sum(A[a] * B[j - a] for a in range(j + 1)) for j in range(K + 1)])
    ext = lambda sig: (lambda m, e: ((2 * m).float().to(DEV), (e - 1).int().to(DEV)))(*torch.frexp(sig))
    out = [torch.empty(K + 1, device=DEV), torch.empty(K + 1, dtype=torch.int32, device=DEV),
           torch.empty(K + 1, device=DEV), torch.empty(K + 1, dtype=torch.int32, device=DEV)]
    ok = torch.empty(1, dtype=torch.int32, device=DEV)
    _both_products[(1,)](*ext(A), *ext(B), *out, ok, K=K)
    value = lambda c, e: c.cpu().double() * torch.pow(2.0, e.cpu().double())
    assert bool(ok.item()) is not far
    assert ((value(*out[2:]) - exact).abs() / exact).max() < 1e-6       # the aligned product: always
    if not far:
        assert ((value(*out[:2]) - exact).abs() / exact).max() < 1e-6


@pytest.mark.parametrize("name, dtype, n, k", [("smooth_svm", torch.float32, 30, 3), ("smooth_svm", torch.float64, 30, 3),
                                               ("smooth_svm", torch.float32, 70, 33), ("smooth_svm", torch.float32, 30, 1),
                                               ("noised_bal", torch.float32, 30, 3), ("noised_imbal", torch.float64, 30, 2)])
def test_kernels_take_masked_classes_at_minus_inf(name, dtype, n, k):
    "-inf scores (masked classes) through the kernels: the value and gradient with those scores far below the rest (no NaN)."
    from topk_nb.base.core import force_sync_free
    from topk_nb.loss.registry import get_loss
    g = torch.Generator().manual_seed(n + k)
    rows = 2 if k > svm_kernels.SVM32_MAX_K else 3                     # the interpreter runs a warp's lanes one by one
    s = 2 * torch.randn(rows, n, generator=g, dtype=dtype)
    y = torch.randint(0, n // 2, (rows,), generator=g)
    mask = torch.zeros_like(s, dtype=torch.bool); mask[:, n // 2:] = True; mask[0, 0] = y[0] != 0
    extra = {"class_counts": torch.arange(1, n + 1)} if name == "noised_imbal" else {}
    outs = []
    build = lambda: get_loss(name, k=k, check_finite=False, **extra,
                             **({"generator": torch.Generator().manual_seed(2)} if name.startswith("noised") else {}))
    with force_sync_free(), kernels.force_triton():                    # the kernels' path, asked once
        assert build().kernel_loss(s.masked_fill(mask, float("-inf")).to(DEV), y.to(DEV), None) is not None
    for fill in (float("-inf"), -1e4):
        crit = build()                                                 # the same noise draws for both
        x = s.masked_fill(mask, fill).to(DEV).requires_grad_()
        with force_sync_free(), kernels.force_triton():
            loss = crit(x, y.to(DEV))
            loss.backward()
        outs.append((loss.detach().cpu(), x.grad.cpu()))
    assert torch.isfinite(outs[0][0]) and torch.isfinite(outs[0][1]).all()
    torch.testing.assert_close(outs[0][0], outs[1][0]); torch.testing.assert_close(outs[0][1], outs[1][1])
