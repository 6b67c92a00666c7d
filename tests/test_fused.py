"""The fused classifier head (chapter 05b): the smooth SVM and the noised losses of F.linear(x, W, b) without the (B, n)
scores. Values and gradients against the unfused losses and the enumeration of subsets, the noise drawn as chapter 04
draws it, the memory bound up to a million classes, and the errors for bad input."""
import math

import pytest
import torch
import torch.nn.functional as F

import topk_nb
from topk_nb.perf.bench import largest_tensor, peak_memory
from topk_nb.base.core import brute_log_esp, force_sync_free
from topk_nb.math.esp import log_zero
from topk_nb.math.esp_backward import tree_svm_loss
from topk_nb.loss.fused import (FusedLinearNoisedBal, FusedLinearNoisedImbal, FusedLinearSmoothSVM, LinearHead,
                           chunk_log_poly, chunked_top, fused_linear_noised_bal, fused_linear_noised_imbal,
                           fused_linear_smooth_svm, head_memory_bound, sample_topk, sample_topk_dense)
from topk_nb.loss.noised import NoisedBal, NoisedImbal
from topk_nb.loss.perturbed import dense_topk_draws, sample_perturbed_topk
from topk_nb.loss.svm import SmoothSVM, smooth_topk_svm_bruteforce


def normal(B, d, n, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, d, generator=g, dtype=dtype), torch.randn(n, d, generator=g, dtype=dtype) / 2,
            torch.randn(n, generator=g, dtype=dtype), torch.randint(0, n, (B,), generator=g))


def dyadic(B, d, n, dtype=torch.float64, seed=0, bias=True):
    "x, W, b (or None) whose scores are exact in float32 and float64, whatever the order of the sums, and distinct in a row."
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-4, 5, (B, d), generator=g).to(dtype) / 4
    W = torch.randint(-4, 5, (n, d), generator=g).to(dtype) / 4
    offset = torch.randperm(n, generator=g).to(dtype) * 2.0 ** -20
    y = torch.randint(0, n, (B,), generator=g)
    if bias:
        return x, W, offset, y
    x[:, 0], W[:, 0] = 1.0, offset
    return x, W, None, y


def value_and_grads(fn, tensors):
    ins = [t.clone().requires_grad_() for t in tensors if t is not None]
    out = fn(*ins)
    return out, torch.autograd.grad(out.sum(), ins)


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-300)).item()


# ---------------------------------------------------------------- the chunks and the top lists

def test_chunks_are_f_linear_and_picked_scores_touch_only_their_rows():
    x, W, b, _ = normal(5, 3, 23)
    head = LinearHead(x, W, b, chunk=7)
    assert head.bounds() == [(0, 7), (7, 14), (14, 21), (21, 23)]
    torch.testing.assert_close(torch.cat([head.scores(*c) for c in head.bounds()], 1), F.linear(x, W, b), rtol=0, atol=1e-14)
    rows, cls, w = torch.tensor([0, 4, 4, 2]), torch.tensor([3, 22, 3, 9]), torch.randn(4, dtype=torch.float64)
    _, fused = value_and_grads(lambda *t: LinearHead(*t).at(rows, cls) * w, (x, W, b))
    _, dense = value_and_grads(lambda *t: F.linear(*t)[rows, cls] * w, (x, W, b))
    for a, c in zip(fused, dense):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-14)
    assert fused[1].abs().sum(1).nonzero()[:, 0].tolist() == [3, 9, 22]


@pytest.mark.parametrize("chunk", [1, 3, 16, 50, 64])
def test_chunked_top_lists_are_torch_topk(chunk):
    x, W, b, y = normal(6, 4, 50, torch.float32, seed=1)
    s = F.linear(x, W, b)
    for m in (1, 5, 17):
        vals, idx = chunked_top(LinearHead(x, W, b, chunk), m)
        ref = s.topk(m, dim=1)
        assert torch.equal(idx, ref.indices)
        torch.testing.assert_close(vals, ref.values, rtol=0, atol=1e-6)    # F.linear on a chunk may round otherwise
        vals, idx = chunked_top(LinearHead(x, W, b, chunk), m, exclude=y)
        assert torch.equal(idx, s.scatter(1, y[:, None], -math.inf).topk(m, dim=1).indices)


# ---------------------------------------------------------------- the smooth SVM

@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("spread", [1.0, 30.0, 1e4])
def test_chunk_polynomial_is_the_enumeration_of_subsets(k, spread):
    neg = log_zero(torch.float64, k)
    x = spread * torch.randn(7, 9, generator=torch.Generator().manual_seed(k), dtype=torch.float64)
    x[0, 4] = neg
    x[1, :8] = neg
    x[2, :] = neg
    got = chunk_log_poly(x, k, neg)
    ref = brute_log_esp(x.clamp_min(-1e300), k)
    present = ref > -1e299
    torch.testing.assert_close(got[present], ref[present], rtol=1e-13, atol=1e-12)
    assert (got[~present] == neg).all()


def test_rows_that_would_underflow_take_the_log_space_scans():
    k, neg = 5, log_zero(torch.float64, 5)
    x = 1e4 * torch.randn(3, 30, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    e = (x - x.amax(1, keepdim=True)).exp()
    assert all(torch.combinations(row, k).prod(1).sum() == 0 for row in e)   # standard space loses sigma_5 whole
    torch.testing.assert_close(chunk_log_poly(x, k, neg), brute_log_esp(x, k), rtol=1e-13, atol=1e-9)


@pytest.mark.parametrize("n, k, tau, chunk, bias", [(7, 1, 1.0, 3, True), (8, 3, 0.5, 1, False), (9, 4, 0.01, 4, True),
                                                    (8, 7, 1.0, 5, True), (9, 2, 100.0, 20, False), (9, 3, 0.001, 2, True)])
def test_smooth_svm_is_the_enumeration_of_subsets(n, k, tau, chunk, bias):
    x, W, b, y = normal(6, 4, n, seed=n + k)
    b = b if bias else None
    loss, grads = value_and_grads(lambda *t: fused_linear_smooth_svm(t[0], t[1], y, t[2] if bias else None, k=k, tau=tau,
                                                                      reduction="none", chunk=chunk), (x, W, b))
    ref, ref_grads = value_and_grads(lambda *t: smooth_topk_svm_bruteforce(F.linear(*t), y, k, tau), (x, W, b))
    torch.testing.assert_close(loss, ref, rtol=1e-12, atol=1e-12)
    assert max(rel(a, c) for a, c in zip(grads, ref_grads)) < 1e-11


@pytest.mark.parametrize("n, k, tau, chunk", [(300, 5, 1.0, 64), (300, 5, 0.01, 37), (500, 20, 0.1, 128), (200, 199, 1.0, 50),
                                              (1000, 1, 0.001, 100), (400, 50, 10.0, 1000), (600, 10, 1e-4, 77)])
def test_smooth_svm_is_the_float64_tree(n, k, tau, chunk):
    x, W, b, y = normal(6, 4, n, seed=n)
    w = torch.rand(6, dtype=torch.float64)
    loss, grads = value_and_grads(lambda *t: fused_linear_smooth_svm(*t[:2], y, t[2], k=k, tau=tau, reduction="none",
                                                                      chunk=chunk) * w, (x, W, b))
    ref, ref_grads = value_and_grads(lambda *t: tree_svm_loss(F.linear(*t), y, k, tau, 1.0) * w, (x, W, b))
    torch.testing.assert_close(loss, ref, rtol=1e-11, atol=1e-11)
    assert max(rel(a, c) for a, c in zip(grads, ref_grads)) < 1e-9


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("k, tau", [(1, 1.0), (5, 0.05), (3, 0.0), (2, 10.0)])
def test_smooth_svm_module_is_the_unfused_module(reduction, bias, k, tau):
    x, W, b, y = dyadic(7, 8, 300, seed=k, bias=bias)
    y[1] = -100
    w = torch.rand(300, generator=torch.Generator().manual_seed(3)) + 0.5
    fused = FusedLinearSmoothSVM(k=k, tau=tau, weight=w, reduction=reduction, chunk=64)
    unfused = SmoothSVM(k=k, tau=tau, weight=w, reduction=reduction)
    out, grads = value_and_grads(lambda *t: fused(t[0], t[1], y, t[2] if bias else None), (x, W, b))
    ref, ref_grads = value_and_grads(lambda *t: unfused(F.linear(*t), y), (x, W, b))
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    assert max(rel(a, c) for a, c in zip(grads, ref_grads)) < 1e-10


@pytest.mark.parametrize("loss, kw", [(fused_linear_smooth_svm, dict(k=1, tau=1.0)), (fused_linear_smooth_svm, dict(k=5, tau=1.0)),
                                      (fused_linear_smooth_svm, dict(k=10, tau=0.01)), (fused_linear_smooth_svm, dict(k=30, tau=0.3)),
                                      (fused_linear_smooth_svm, dict(k=5, tau=0.0)), (fused_linear_noised_bal, dict(k=5, epsilon=0.0))])
def test_float32_is_within_1e_4_of_float64_on_the_same_rounded_inputs(loss, kw):
    x, W, b, y = normal(8, 16, 3000, torch.float32, seed=4)
    (v32, g32), (v64, g64) = (value_and_grads(lambda *t: loss(t[0], t[1], y, t[2], chunk=500, **kw), [t.to(dtype) for t in (x, W, b)])
                              for dtype in (torch.float32, torch.float64))
    assert v32.dtype == torch.float32
    assert abs(v32.item() - v64.item()) <= 1e-4 * abs(v64.item())
    assert max(rel(a, c) for a, c in zip(g32, g64)) < 1e-4


# ---------------------------------------------------------------- the noised losses

def draws_equal(B, n, K, eps, S, chunk, dtype, seed=0, dense=False):
    x, W, b, _ = dyadic(B, 8, n, dtype, seed)
    s = F.linear(x, W, b)
    g_ref, g_got = torch.Generator().manual_seed(seed + 7), torch.Generator().manual_seed(seed + 7)
    ref = (dense_topk_draws if dense else sample_perturbed_topk)(s, K, eps, S, g_ref)
    got = (sample_topk_dense if dense else sample_topk)(LinearHead(x, W, b, chunk), K, eps, S, g_got)
    assert torch.equal(ref.indices, got[1]) and torch.equal(ref.values, got[0])
    assert torch.equal(torch.rand(5, generator=g_ref), torch.rand(5, generator=g_got))    # the generator moved as far
    return ref.stats


CASES = [(4, 50, 2, 0.01, 3, 16), (4, 50, 2, 3.0, 3, 16), (5, 1000, 3, 0.5, 4, 100), (5, 1003, 3, 1.0, 4, 77),
         (6, 2000, 4, 0.2, 3, 256), (2, 7, 2, 1.0, 2, 3), (3, 40, 1, 50.0, 2, 6), (5, 3000, 3, 1.0, 6, 3), (3, 997, 2, 0.05, 5, 64),
         (3, 13, 1, 5.0, 2, 5)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_samplers_draw_chapter_04s_numbers(dtype):
    routes = set()
    for case in CASES:
        stats = draws_equal(*case, dtype)
        draws_equal(*case, dtype, dense=True)
        S, B = case[4], case[0]
        routes.add("all dense" if stats["dense_rows"] == S * B else "dense pairs" if stats["dense_rows"]
                   else "points" if stats["points"] else "none")
    assert routes == {"all dense", "dense pairs", "points", "none"}


def test_the_global_random_state_draws_the_same_numbers():
    x, W, b, _ = dyadic(5, 8, 1003)
    torch.manual_seed(3)
    ref = sample_perturbed_topk(F.linear(x, W, b), 3, 1.0, 4)
    after = torch.rand(4)
    torch.manual_seed(3)
    got = sample_topk(LinearHead(x, W, b, 77), 3, 1.0, 4)
    assert torch.equal(ref.indices, got[1]) and torch.equal(ref.values, got[0]) and torch.equal(torch.rand(4), after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_ordinary_inputs_give_the_same_classes_and_values_to_rounding(dtype):
    x, W, b, _ = normal(6, 16, 5000, dtype, seed=9)
    for eps in (0.05, 1.0):
        ref = sample_perturbed_topk(F.linear(x, W, b), 4, eps, 5, torch.Generator().manual_seed(1))
        got = sample_topk(LinearHead(x, W, b, 999), 4, eps, 5, torch.Generator().manual_seed(1))
        assert torch.equal(got[1], ref.indices)
        torch.testing.assert_close(got[0], ref.values, rtol=0, atol=2e-5 if dtype == torch.float32 else 1e-13)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("k, eps", [(2, 0.3), (4, 3.0), (2, 0.0), (1, 0.05)])
def test_noised_modules_are_the_unfused_modules_on_the_same_draws(reduction, bias, k, eps):
    x, W, b, y = dyadic(7, 8, 300, seed=k, bias=bias)
    y[1] = -100
    w = torch.rand(300, generator=torch.Generator().manual_seed(3)) + 0.5
    counts = torch.randint(1, 100, (300,), generator=torch.Generator().manual_seed(4))
    pairs = [(FusedLinearNoisedBal(k=k, epsilon=eps, weight=w, reduction=reduction, chunk=64, generator=torch.Generator().manual_seed(11)),
              NoisedBal(k=k, epsilon=eps, weight=w, reduction=reduction, generator=torch.Generator().manual_seed(11))),
             (FusedLinearNoisedImbal(class_counts=counts, k=k, epsilon=eps, reduction=reduction, chunk=64,
                                     generator=torch.Generator().manual_seed(11)),
              NoisedImbal(class_counts=counts, k=k, epsilon=eps, reduction=reduction, generator=torch.Generator().manual_seed(11)))]
    for fused, unfused in pairs:
        for _ in range(2):                                        # the second call draws on from where the first left
            out, grads = value_and_grads(lambda *t: fused(t[0], t[1], y, t[2] if bias else None), (x, W, b))
            ref, ref_grads = value_and_grads(lambda *t: unfused(F.linear(*t), y), (x, W, b))
            torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-12)
            assert max(rel(a, c) for a, c in zip(grads, ref_grads)) < 1e-13
            assert (grads[1].abs().sum(1) > 0).sum() <= (fused.n_samples + 1) * len(y)   # W's gradient: the rows read


@pytest.mark.parametrize("eps", [0.1, 1.0])
def test_noised_float32_is_the_unfused_float32_on_the_same_draws(eps):
    x, W, b, y = normal(8, 16, 3000, torch.float32, seed=5)
    out, grads = value_and_grads(lambda *t: fused_linear_noised_bal(t[0], t[1], y, t[2], k=5, epsilon=eps, chunk=500,
                                                                     generator=torch.Generator().manual_seed(2)), (x, W, b))
    ref, ref_grads = value_and_grads(lambda *t: NoisedBal(k=5, epsilon=eps, generator=torch.Generator().manual_seed(2))(F.linear(*t), y),
                                     (x, W, b))
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert max(rel(a, c) for a, c in zip(grads, ref_grads)) < 1e-5


def test_the_sync_free_path_draws_as_dense_topk_draws():
    x, W, b, y = dyadic(5, 8, 400, seed=2)
    with force_sync_free():
        out, grads = value_and_grads(lambda *t: FusedLinearNoisedBal(k=3, epsilon=0.5, chunk=50, generator=torch.Generator().manual_seed(6))(t[0], t[1], y, t[2]), (x, W, b))
        ref, ref_grads = value_and_grads(lambda *t: NoisedBal(k=3, epsilon=0.5, generator=torch.Generator().manual_seed(6))(F.linear(*t), y), (x, W, b))
    torch.testing.assert_close(out, ref, rtol=1e-13, atol=1e-13)
    assert max(rel(a, c) for a, c in zip(grads, ref_grads)) < 1e-13


# ---------------------------------------------------------------- memory

def memory(loss, B, d, n, chunk, **kw):
    g = torch.Generator().manual_seed(n)
    ins = [torch.randn(B, d, generator=g), torch.randn(n, d, generator=g) / 3, torch.zeros(n)]
    y = torch.randint(0, n, (B,), generator=g)
    for t in ins: t.requires_grad_()
    def step():
        for t in ins: t.grad = None
        loss(ins[0], ins[1], y, ins[2], chunk=chunk, **kw).backward()
    grads = sum(t.numel() * t.element_size() for t in ins)
    forward = peak_memory(lambda: loss(ins[0], ins[1], y, ins[2], chunk=chunk, **kw))
    return largest_tensor(step), forward, peak_memory(step) - grads


@pytest.mark.parametrize("n", [10**4, 10**6])
@pytest.mark.parametrize("name", ["smooth_svm", "noised_bal", "noised_bal_dense"])
def test_memory_stays_under_the_bound_up_to_a_million_classes(name, n):
    B, d, chunk = (64, 8, 2048) if name != "noised_bal_dense" else (32, 4, 4096)
    loss, S, kw = {"smooth_svm": (fused_linear_smooth_svm, 0, dict(k=5, tau=1.0)),
                   "noised_bal": (fused_linear_noised_bal, 2, dict(k=5, epsilon=0.1, n_samples=2, generator=torch.Generator().manual_seed(0))),
                   "noised_bal_dense": (fused_linear_noised_bal, 2, dict(k=3, epsilon=20.0, n_samples=2, generator=torch.Generator().manual_seed(0)))}[name]
    largest, forward, extra = memory(loss, B, d, n, chunk, **kw)
    bound = head_memory_bound(B, d, kw["k"], chunk, S)
    assert bound < B * n * 4 or n < 10**5                         # the bound is below one B x n array of scores
    assert largest <= max(n * d * 4, B * (min(n, chunk) + 32) * 8) < B * n * 4   # W's gradient or a chunk's array
    assert forward <= bound and extra <= bound, (forward, extra, bound)


def test_the_unfused_loss_makes_the_scores_the_fused_does_not():
    B, d, n = 64, 8, 10**5
    x, W, b, y = normal(B, d, n, torch.float32)
    W.requires_grad_()
    assert largest_tensor(lambda: SmoothSVM(k=5)(F.linear(x, W, b), y).backward()) >= B * n * 4
    assert largest_tensor(lambda: fused_linear_smooth_svm(x, W, y, b, k=5).backward()) == n * d * 4


# ---------------------------------------------------------------- conventions and errors

def test_top_level_names():
    for name in ("FusedLinearSmoothSVM", "FusedLinearNoisedBal", "FusedLinearNoisedImbal", "fused_linear_smooth_svm",
                 "fused_linear_noised_bal", "fused_linear_noised_imbal"):
        assert getattr(topk_nb, name) is getattr(topk_nb.loss.fused, name) and name in topk_nb.__all__


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch_and_every_row_ignored_as_in_cross_entropy(reduction):
    x, W, b, _ = normal(5, 4, 30)
    for fused, unfused in ((FusedLinearSmoothSVM(k=3, reduction=reduction), SmoothSVM(k=3, reduction=reduction)),
                           (FusedLinearNoisedBal(k=3, reduction=reduction), NoisedBal(k=3, reduction=reduction))):
        for xs, ys in ((x[:0], torch.zeros(0, dtype=torch.long)), (x, torch.full((5,), -100))):
            out, ref = fused(xs, W, ys, b), unfused(F.linear(xs, W, b), ys)
            assert out.shape == ref.shape
            torch.testing.assert_close(out, ref, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_are_computed_in_float32_and_returned_in_their_dtype(dtype):
    x, W, b, y = (t.to(dtype) if t.is_floating_point() else t for t in normal(6, 8, 100, torch.float32, seed=3))
    out = FusedLinearSmoothSVM(k=3)(x, W, y, b)
    ref = SmoothSVM(k=3)(F.linear(x, W, b), y)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_a_second_derivative_of_the_smooth_svm_stops_with_an_error():
    x, W, b, y = normal(4, 3, 10)
    W.requires_grad_()
    with pytest.raises(RuntimeError, match="differentiable once"):
        torch.autograd.grad(fused_linear_smooth_svm(x, W, y, b, k=3), W, create_graph=True)


def test_second_derivatives_of_the_noised_losses_are_the_unfused_ones():
    x, W, b, y = dyadic(5, 4, 60, seed=1)
    ins = [t.clone().requires_grad_() for t in (x, W, b)]
    ref_ins = [t.clone().requires_grad_() for t in (x, W, b)]
    out = fused_linear_noised_bal(*ins[:2], y, ins[2], k=3, epsilon=0.5, generator=torch.Generator().manual_seed(1), chunk=16)
    ref = NoisedBal(k=3, epsilon=0.5, generator=torch.Generator().manual_seed(1))(F.linear(*ref_ins), y)
    grads = torch.autograd.grad(out, ins, create_graph=True)
    ref_grads = torch.autograd.grad(ref, ref_ins, create_graph=True)
    second = torch.autograd.grad(sum((g * g).sum() for g in grads), ins)      # a gradient penalty's gradient
    ref_second = torch.autograd.grad(sum((g * g).sum() for g in ref_grads), ref_ins, allow_unused=True)
    for a, c in zip(second, ref_second):
        torch.testing.assert_close(a, torch.zeros_like(a) if c is None else c, rtol=1e-12, atol=1e-12)
    assert any(a.abs().sum() > 0 for a in second)


@pytest.mark.parametrize("make, message", [
    (lambda: FusedLinearSmoothSVM(3), r"takes keyword arguments only, e.g. FusedLinearSmoothSVM\(k=5, tau=1.0\)"),
    (lambda: FusedLinearNoisedBal(label_smoothing=0.1), "takes no label_smoothing: it takes class indices only"),
    (lambda: FusedLinearSmoothSVM(kk=3), "takes no argument 'kk'; it accepts: k, tau, alpha, weight"),
    (lambda: FusedLinearSmoothSVM(chunk=0), r"chunk must be an integer in \[1, inf\], got 0"),
    (lambda: FusedLinearSmoothSVM(reduction="avg"), r"reduction must be one of \('mean', 'sum', 'none'\)"),
    (lambda: FusedLinearSmoothSVM(tau=-1.0), r"tau must be a finite number in \[0.0, inf\]"),
    (lambda: FusedLinearNoisedBal(n_samples=0), r"n_samples must be an integer in \[1, inf\]"),
    (lambda: FusedLinearNoisedImbal(class_counts=[3, 0, 2]), "class_counts must be positive"),
])
def test_bad_settings_name_the_argument_and_the_allowed_values(make, message):
    with pytest.raises((TypeError, ValueError), match=message):
        make()


@pytest.mark.parametrize("call, message", [
    (lambda x, W, b, y: FusedLinearSmoothSVM(k=3)(x, W.T, y, b), r"head_weight must have shape \(n, 3\)"),
    (lambda x, W, b, y: FusedLinearSmoothSVM(k=3)(x, W.float(), y, b), "head_weight must have the features' dtype and device"),
    (lambda x, W, b, y: FusedLinearSmoothSVM(k=3)(x, W, y, b[:9]), r"head_bias must be None or a tensor of shape \(10,\)"),
    (lambda x, W, b, y: FusedLinearSmoothSVM(k=3)(x[0], W, y, b), r"features must have shape \(B, d\)"),
    (lambda x, W, b, y: FusedLinearSmoothSVM(k=3)(x, W, y.double(), b), "target must be a torch.Tensor of integer class indices"),
    (lambda x, W, b, y: FusedLinearSmoothSVM(k=3)(x, W, y[:2], b), r"target must have shape \(4,\)"),
    (lambda x, W, b, y: FusedLinearSmoothSVM(k=3)(x, W, y + 10, b), r"target must hold class indices in \[0, 9\]"),
    (lambda x, W, b, y: FusedLinearSmoothSVM(k=10)(x, W, y, b), r"k must be an integer in \[1, 9\]"),
    (lambda x, W, b, y: FusedLinearNoisedBal(k=3)(x, W.masked_fill(W > 0, math.nan), y, b), "head_weight must be finite"),
    (lambda x, W, b, y: fused_linear_smooth_svm(x, W, y, b, weight=torch.ones(3)), r"weight must be None or a tensor with one entry per class \(10\)"),
    (lambda x, W, b, y: fused_linear_noised_imbal(x, W, y, [1, 2, 3], b), "class_counts must have one entry per class: 10 expected"),
])
def test_bad_inputs_name_the_argument_and_the_allowed_values(call, message):
    x, W, b, y = normal(4, 3, 10)
    with pytest.raises((TypeError, ValueError), match=message):
        call(x, W, b, y)


# ---------------------------------------------------------------- the kernels (chapter 05c), in Triton's interpreter

from topk_nb.loss.fused import _head_rows, _log_poly_product, _svm_backward, _svm_forward   # noqa: E402
from topk_nb.ops.fused import HEAD_BLOCKS, head_svm_partials, head_svm_tail_grad, head_triton_ok   # noqa: E402
from topk_nb.ops.launch import HAS_TRITON, count_launches, force_triton   # noqa: E402

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")


@needs_triton
@pytest.mark.parametrize("B, d, n, k, tau, dtype, bias, splits", [
    (5, 40, 150, 3, 1.0, torch.float32, True, 1), (17, 20, 100, 2, 0.05, torch.float32, False, None),
    (6, 16, 70, 3, 0.3, torch.float16, True, None), (6, 16, 70, 2, 1.0, torch.bfloat16, True, 1)])
def test_the_kernels_are_the_chunked_path(B, d, n, k, tau, dtype, bias, splits):
    g = torch.Generator().manual_seed(B + n)
    x, W, b = torch.randn(B, d, generator=g).to(dtype), (torch.randn(n, d, generator=g) / 2).to(dtype), torch.randn(n, generator=g).to(dtype)
    b = b if bias else None
    y = torch.randint(0, n, (B,), generator=g)
    head = LinearHead(x, W, b, 32)
    poly, s_y, xmax = _svm_forward(head, y, k, tau)
    with force_triton():
        assert head_triton_ok(x, k)
        polys, s_y1, xmax1 = head_svm_partials(x, W, b, y, k, tau, splits)
    neg = log_zero(torch.float64, k)
    merged = polys[0, :, :k + 1].clamp_min(neg)
    for p in polys[1:, :, :k + 1]:
        merged = _log_poly_product(merged, p.clamp_min(neg), k, neg)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]   # bfloat16: the interpreter truncates
    assert ((merged - poly).abs() / poly.abs().clamp_min(1)).max() < tol
    assert rel(s_y1, s_y) < tol and rel(xmax1.amax(0), xmax) < tol
    go = torch.rand(B, generator=g, dtype=torch.float64)
    ref = _svm_backward(head, y, k, tau, poly, xmax, go)
    has_head = xmax + poly[:, k - 1] - poly[:, k] > math.log(0.5)
    with force_triton():
        *got, listed, count = head_svm_tail_grad(x, W, b, y, k, tau, poly, has_head, go)
    hr = has_head.nonzero()[:, 0]
    assert (count[~has_head] == 0).all() and (count < 3 * k).all()     # Proposition 3
    if len(hr):
        _head_rows(head, y, k, tau, poly, go, hr, *got, (listed[hr], count[hr]))
    for a, c in zip(got, ref):
        assert (a is None) == (c is None) and (c is None or rel(a, c) < tol)


@needs_triton
@pytest.mark.parametrize("tau", [1.0, 0.02])
def test_the_module_on_the_kernels_path_is_within_1e_4_of_float64(tau):
    x, W, b, y = normal(6, 24, 90, torch.float32, seed=3)
    crit = FusedLinearSmoothSVM(k=3, tau=tau)
    with force_triton():
        assert count_launches(lambda: crit(x, W.clone().requires_grad_(), y, b).backward()) == 2
        out, grads = value_and_grads(lambda *t: crit(t[0], t[1], y, t[2]), (x, W, b))
    ref, ref_grads = value_and_grads(lambda *t: tree_svm_loss(F.linear(*t), y, 3, tau, 1.0).mean(), [t.double() for t in (x, W, b)])
    assert abs(out.item() - ref.item()) <= 1e-4 * abs(ref.item())
    assert max(rel(a, c) for a, c in zip(grads, ref_grads)) < 1e-4


def test_the_kernels_take_half_and_float32_inputs_and_k_up_to_32_only():
    x = torch.randn(4, 8)
    with force_triton():
        assert head_triton_ok(x, 32) and head_triton_ok(x.half(), 1) and head_triton_ok(x.bfloat16(), 5)
        assert not head_triton_ok(x.double(), 5) and not head_triton_ok(x, 33) and not head_triton_ok(x[:0], 5)
    assert not head_triton_ok(x, 5)                                # a CPU tensor, not forced: the chunked path


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import topk_nb.ops.fused as K
for dt in ("fp32", "fp16", "bf16"):
    for k, bias in ((1, False), (32, True)):
        if True:
            common = dict(x_ptr=f"*{dt}", w_ptr=f"*{dt}", b_ptr=f"*{dt}", y_ptr="*i64")
            fwd = dict(common, poly_ptr="*fp64", xmax_ptr="*fp64", sy_ptr="*fp64", B="i32", n="i32", d="i32", tiles="i32",
                       inv_ktau_bits="i64")
            bwd = dict(common, ak_ptr="*fp64", r_ptr="*fp64", hh_ptr="*i8", g_ptr="*fp64", dx_ptr="*fp32", dw_ptr="*fp32",
                       db_ptr="*fp32", hd_ptr="*i64", hn_ptr="*i32", B="i32", n="i32", d="i32", inv_ktau_bits="i64")
            blocks = dict(K=k, HAS_BIAS=bias, IEEE=dt == "fp32", BLOCK_K=triton.next_power_of_2(k + 1), **K.HEAD_BLOCKS)
            for fn, sig, const in ((K._head_svm_forward_kernel, fwd, blocks),
                                   (K._head_svm_backward_kernel, bwd, dict(blocks, NEED_DB=bias, HMAX=K.head_list_size(k)))):
                out = triton.compile(ASTSource(fn=fn, signature={**sig, **{c: "constexpr" for c in const}}, constexprs=const),
                                     target=GPUTarget("cuda", 90, 32))
                assert out.asm["cubin"], (dt, k, bias, fn)
print("compiled")
"""


@needs_triton
def test_the_kernels_compile_for_sm_90():
    "The interpreter is lenient; the real compiler (PTX, then an sm_90 binary) must accept both kernels, every dtype and k."
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(topk_nb.__file__).parents[1]), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=1200)
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-2000:]


def test_half_inputs_give_gradients_as_accurate_as_the_unfused_loss_whatever_the_chunk():
    "bf16 features, weight and bias: the fused smooth SVM's gradients against float64 on the same rounded inputs are as close as F.linear + SmoothSVM's (dx summed over the chunks in float32, rounded once, as F.linear's backward sums it)."
    g = torch.Generator().manual_seed(0)
    B, d, n = 16, 32, 4000
    leaves = (torch.randn(B, d, generator=g), torch.randn(n, d, generator=g) / 6, torch.randn(n, generator=g) / 10)
    x, W, b = (t.bfloat16() for t in leaves)
    y = torch.randint(0, n, (B,), generator=g)

    def grads(loss_of, dtype):
        ins = [t.to(dtype).clone().requires_grad_() for t in (x, W, b)]
        loss_of(*ins).backward()
        return [t.grad.double() for t in ins]
    ref = grads(lambda x, W, b: SmoothSVM(k=5)(F.linear(x, W, b), y), torch.float64)
    err = lambda got: [((a - r).abs().max() / r.abs().max()).item() for a, r in zip(got, ref)]
    unfused = err(grads(lambda x, W, b: SmoothSVM(k=5)(F.linear(x, W, b).float(), y), torch.bfloat16))
    for chunk in (4096, 16):                                            # one chunk, and 250
        fused = err(grads(lambda x, W, b: FusedLinearSmoothSVM(k=5, chunk=chunk)(x, W, y, b), torch.bfloat16))
        assert all(f <= 1.5 * u + 1e-6 for f, u in zip(fused, unfused)), (chunk, fused, unfused)


def test_the_noised_head_sums_half_gradients_in_float32():
    "bf16 inputs whose scores are exact and distinct (the same picks in bf16 and float64): the fused noised loss's gradients for x, W and b are as close to float64 as F.linear + NoisedBal's (their sums in float32, rounded once)."
    g = torch.Generator().manual_seed(0)
    B, n = 32, 200
    x = torch.zeros(B, 2)
    x[:, 0] = 1                                                         # s = W[:, 0]: integers, exact in bf16
    W = torch.stack([torch.randperm(n, generator=g).float() - 100, torch.randn(n, generator=g)], 1)
    x, W, b = x.bfloat16(), W.bfloat16(), torch.zeros(n).bfloat16()
    y = torch.randint(0, n, (B,), generator=g)
    kw = dict(k=5, epsilon=3.0, n_samples=50)

    def grads(loss_of, dtype):
        ins = [t.to(dtype).clone().requires_grad_() for t in (x, W, b)]
        loss_of(*ins).backward()
        return [t.grad.double() for t in ins]
    gen = lambda: torch.Generator().manual_seed(1)
    ref = grads(lambda x, W, b: NoisedBal(**kw, generator=gen())(F.linear(x, W, b).float(), y), torch.float64)
    err = lambda got: [((a - r).abs().max() / r.abs().max()).item() for a, r in zip(got, ref)]
    unfused = err(grads(lambda x, W, b: NoisedBal(**kw, generator=gen())(F.linear(x, W, b).float(), y), torch.bfloat16))
    fused = err(grads(lambda x, W, b: FusedLinearNoisedBal(**kw, generator=gen(), chunk=16)(x, W, y, b), torch.bfloat16))
    assert max(unfused) < 1e-2 and all(f <= 1.5 * u + 1e-6 for f, u in zip(fused, unfused)), (fused, unfused)
