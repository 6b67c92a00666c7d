"""The smooth top-k SVM loss and the top-k hinge against the k-subset definitions (Berrada 2018, eq. 9 and 20)."""
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from topk_nb.base.core import scores_without_target
from topk_nb.math.esp_backward import log_sigma
from topk_nb.loss.registry import get_loss
from topk_nb.loss.svm import (SmoothSVM, TopkHinge, _SmoothTopkSVMFunction, hard_enough, smooth_svm,
                         smooth_topk_svm_bruteforce, subset_sums_bruteforce, topk_hinge)


def random_scores(seed, batch, n, scale, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(batch, n, generator=g, dtype=torch.float64) * scale
    return s.to(dtype), torch.randint(0, n, (batch,), generator=g)


cases = dict(n=st.integers(2, 9), batch=st.integers(1, 6), seed=st.integers(0, 2**31 - 1),
             scale=st.sampled_from([0.01, 1.0, 5.0, 50.0]), tau=st.sampled_from([1e-3, 0.05, 1.0, 20.0]),
             alpha=st.sampled_from([0.0, 0.5, 1.0]), switch=st.booleans(), data=st.data())


@given(**cases)
def test_smooth_loss_equals_subset_enumeration(n, batch, seed, scale, tau, alpha, switch, data):
    k = data.draw(st.integers(1, n - 1))
    s, y = random_scores(seed, batch, n, scale)
    s.requires_grad_()
    ref = smooth_topk_svm_bruteforce(s, y, k, tau, alpha)
    ours = smooth_svm(s, y, k, tau, alpha, reduction="none", hard_switch=switch)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    (g,) = torch.autograd.grad(ours.sum(), s)
    (g_ref,) = torch.autograd.grad(ref.sum(), s)
    torch.testing.assert_close(g, g_ref, rtol=1e-8, atol=1e-10 * max(1.0, g_ref.abs().max().item()))


@given(**cases)
def test_hinge_equals_difference_of_maxima(n, batch, seed, scale, tau, alpha, switch, data):
    k = data.draw(st.integers(1, n - 1))
    s, y = random_scores(seed, batch, n, scale)
    sums, has_y = subset_sums_bruteforce(s, y, k)
    first = (alpha * (~has_y) + sums / k).amax(1)
    second = (sums / k).masked_fill(~has_y, -math.inf).amax(1)
    torch.testing.assert_close(topk_hinge(s, y, k, alpha, reduction="none"), first - second)


@pytest.mark.parametrize("n, k", [(2, 1), (5, 3), (7, 6)])
def test_gradcheck(n, k):
    s, y = random_scores(n, 3, n, 2.0)
    s.requires_grad_()
    assert torch.autograd.gradcheck(lambda t: smooth_svm(t, y, k, 0.5, hard_switch=False, reduction="none"), (s,))


def test_cross_entropy_is_the_special_case():
    s, y = random_scores(0, 32, 50, 5.0)
    torch.testing.assert_close(smooth_svm(s, y, k=1, tau=1.0, alpha=0.0, reduction="none"),
                               F.cross_entropy(s, y, reduction="none"))


@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 6), tau=st.sampled_from([0.05, 0.5, 2.0]))
def test_bound_on_top_k_error(seed, k, tau):
    s, y = random_scores(seed, 64, 8, 3.0)
    wrong = s.gather(1, y[:, None])[:, 0] < s.topk(k, dim=1).values[:, -1]
    L = smooth_svm(s, y, k, tau, reduction="none")
    assert (L >= -1e-12).all()
    assert (L[wrong] >= 1 - tau * math.log(k) - 1e-12).all()


def test_reductions_and_batch_of_one():
    s, y = random_scores(1, 5, 10, 2.0)
    per_sample = smooth_svm(s, y, 3, 0.5, reduction="none")
    assert per_sample.shape == (5,)
    torch.testing.assert_close(smooth_svm(s, y, 3, 0.5), per_sample.mean())
    torch.testing.assert_close(smooth_svm(s, y, 3, 0.5, reduction="sum"), per_sample.sum())
    torch.testing.assert_close(smooth_svm(s[:1], y[:1], 3, 0.5), per_sample[0])


def test_modules_match_functions():
    s, y = random_scores(2, 8, 20, 2.0, torch.float32)
    torch.testing.assert_close(SmoothSVM(k=5, tau=0.1)(s, y), smooth_svm(s, y, 5, 0.1))
    torch.testing.assert_close(TopkHinge(k=2, alpha=0.5)(s, y), topk_hinge(s, y, 2, 0.5))
    assert "k=5" in repr(SmoothSVM(k=5, tau=0.1))


def test_float32_close_to_float64_and_autocast():
    s, y = random_scores(3, 64, 100, 3.0, torch.float32)
    torch.testing.assert_close(smooth_svm(s, y, 5, 0.2).double(), smooth_svm(s.double(), y, 5, 0.2),
                               rtol=1e-5, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = smooth_svm(s.bfloat16(), y, 5, 0.2)
    assert out.dtype == torch.float32 and torch.isfinite(out)          # as F.cross_entropy under autocast


@pytest.mark.parametrize("tau", [1e-4, 1e-2, 1.0, 1e2])
@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_extreme_inputs_stay_finite(tau, scale):
    s, y = random_scores(4, 32, 500, scale, torch.float32)
    s = s.clamp(-1e3, 1e3).requires_grad_()
    loss = smooth_svm(s, y, 5, tau)
    (g,) = torch.autograd.grad(loss, s)
    assert torch.isfinite(loss) and torch.isfinite(g).all()


def test_hard_switch_only_where_equal_to_float_precision():
    s, y = random_scores(5, 400, 30, 20.0)
    for tau in (1e-3, 0.05, 0.5):
        hard = hard_enough(s, y, 5, tau, 1.0)
        smooth = smooth_svm(s, y, 5, tau, reduction="none", hard_switch=False)
        hinge = topk_hinge(s, y, 5, reduction="none")
        u = torch.finfo(torch.float64).eps / 2
        # the bound u * tau, plus the rounding of the smooth path itself, which works with sums of k x = s / (k tau)
        rounding = 32 * u * s.abs().amax(1)
        assert ((smooth - hinge).abs()[hard] <= (u * tau + rounding)[hard]).all()
    assert hard_enough(s, y, 5, 1e-3, 1.0).any() and not hard_enough(s, y, 5, 10.0, 1.0).any()


@pytest.mark.parametrize("kwargs, message", [
    (dict(k=0), "k must be an integer in [1, 5]"),
    (dict(k=6), "k must be an integer in [1, 5]"),
    (dict(k=2, tau=-1e-3), "tau must be a finite number in [0.0, inf]"),
    (dict(k=2, tau=float("inf")), "tau must be a finite number"),
    (dict(k=2, alpha=-0.1), "alpha must be a finite number in [0.0, inf]"),
    (dict(k=2, reduction="avg"), "reduction must be one of"),
])
def test_bad_arguments(kwargs, message):
    s, y = random_scores(6, 4, 6, 1.0, torch.float32)
    with pytest.raises((ValueError, TypeError)) as info:
        smooth_svm(s, y, **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("scores, target, message", [
    (torch.randn(4), torch.zeros(4, dtype=torch.long), "scores must have shape (B, n)"),
    (torch.randn(4, 6), torch.tensor([0, 1, 2, 6]), "target must hold class indices in [0, 5]"),
    (torch.randn(4, 6), torch.tensor([0.0, 1.0, 2.0, 3.0]), "target must hold integer class indices"),
    (torch.randn(4, 6), torch.tensor([0, 1, 2]), "target must have shape (4,)"),
    (torch.tensor([[0.0, float("nan"), 1.0]]), torch.tensor([0]), "scores must be finite"),
    (torch.randn(4, 1), torch.zeros(4, dtype=torch.long), "at least 2 entries"),
])
def test_bad_tensors(scores, target, message):
    for fn in (smooth_svm, topk_hinge):
        with pytest.raises((ValueError, TypeError)) as info:
            fn(scores, target, k=1)
        assert message in str(info.value)


@pytest.mark.parametrize("k,tau,scale", [(1, 1.0, 1.0), (5, 1.0, 1.0), (5, 0.1, 1.0), (10, 0.1, 5.0), (20, 1.0, 10.0)])
def test_float32_power_path_against_float64_tree(k, tau, scale):
    # the fused float32 path (every row smooth and certified) against log sigma by the float64 tree, same inputs
    s32, y = random_scores(11, 64, 1000, scale, torch.float32)
    s32.requires_grad_()
    loss, ok = _SmoothTopkSVMFunction.apply(s32, y, k, tau, 1.0, False, False)
    assert ok.all()
    s = s32.detach().double().requires_grad_()
    log_sig = log_sigma(scores_without_target(s, y) / (k * tau), k, method="autograd")
    s_y = s.gather(1, y[:, None])[:, 0]
    ref = tau * F.softplus(1.0 / tau + log_sig[:, 1] - log_sig[:, 0] - s_y / (k * tau))
    assert ((loss.double() - ref).abs() <= 1e-4 * ref.abs() + 1e-6).all()
    w = torch.rand(64, dtype=torch.float64)
    (g,) = torch.autograd.grad((loss * w.float()).sum(), s32)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), s)
    assert ((g.double() - g_ref).abs().amax(1) <= 1e-4 * g_ref.abs().amax(1)).all()


@pytest.mark.parametrize("n,k,tau,scale,certified", [
    (60, 50, 1.0, 1.0, True), (120, 50, 0.1, 1.0, True), (200, 49, 1.0, 5.0, True),     # the whole row in the head
    (1000, 50, 1.0, 1.0, True), (3000, 100, 1.0, 1.0, True),                             # head of k+1 and a long tail
    (20000, 100, 1.0, 1.0, True),                                      # sigma_k beyond float64 unless shifted
    (1000, 100, 1.0, 1.0, True), (1000, 100, 0.1, 1.0, True),                             # Newton's bound within 1e-6
    (1000, 200, 1.0, 1.0, True),                                       # k^2 > 11m: the whole row in the head, certified
    (10000, 300, 1.0, 1.0, False),                     # a tail refused at k^2 = 9m: the loss retries with the whole row
    (1000, 600, 1.0, 1.0, None), (1000, 999, 0.5, 1.0, None), (100, 99, 0.1, 5.0, None)])   # past n/2: the complement
def test_large_k_against_float64_tree(n, k, tau, scale, certified):
    # large k (up to n - 1): the float32 loss and gradient against the float64 log-space tree
    s32, y = random_scores(12, 8, n, scale, torch.float32)
    s32.requires_grad_()
    loss_fn, ok = _SmoothTopkSVMFunction.apply(s32.detach(), y, k, tau, 1.0, False, False)
    if certified is not None:
        assert bool(ok.all()) == certified
    loss = smooth_svm(s32, y, k=k, tau=tau, reduction="none")
    s = s32.detach().double().requires_grad_()
    log_sig = log_sigma(scores_without_target(s, y) / (k * tau), k, method="autograd")
    s_y = s.gather(1, y[:, None])[:, 0]
    ref = tau * F.softplus(1.0 / tau + log_sig[:, 1] - log_sig[:, 0] - s_y / (k * tau))
    assert ((loss.double() - ref).abs() <= 1e-4 * ref.abs() + 1e-6).all()
    w = torch.rand(8, dtype=torch.float64)
    (g,) = torch.autograd.grad((loss * w.float()).sum(), s32)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), s)
    assert ((g.double() - g_ref).abs().amax(1) <= 1e-4 * g_ref.abs().amax(1)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_zero_temperature_is_the_topk_hinge(dtype):
    s, y = random_scores(7, 16, 20, 3.0, dtype)
    w = torch.rand(20, generator=torch.Generator().manual_seed(1), dtype=dtype)
    for k in (1, 4, 19):
        ref = TopkHinge(k=k, alpha=0.5, weight=w, ignore_index=3)
        for loss in (get_loss("smooth_svm", k=k, tau=0, alpha=0.5, weight=w, ignore_index=3),
                     SmoothSVM(k=k, tau=0.0, alpha=0.5, weight=w, ignore_index=3)):
            x, x_ref = s.clone().requires_grad_(True), s.clone().requires_grad_(True)
            out, expected = loss(x, y), ref(x_ref, y)
            out.backward(); expected.backward()
            assert out.dtype == expected.dtype == dtype
            assert torch.equal(out, expected) and torch.equal(x.grad, x_ref.grad)
