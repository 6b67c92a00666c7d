"""Perturbed top-K (topk_nb.loss.perturbed) and the noised top-K hinge losses (topk_nb.loss.noised) of Garcin 2022."""
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st

from topk_nb.loss.noised import (CalHinge, NoisedBal, NoisedImbal, cal_hinge, margins_from_counts,
                            noised_bal, noised_imbal)
from topk_nb.loss.perturbed import (arg_top_sum, draw_noise, perturbed_argmax, perturbed_topk_law, sample_perturbed_topk,
                               smooth_topk, top_sum, topk_value)


def test_paper_illustration():
    s = torch.tensor([2.4, 2.6, 2.3, 0.5], dtype=torch.float64, requires_grad=True)
    z = torch.tensor([[0.2, -0.1, 0.1, 0.3], [0.1, 0.1, -0.1, 0.1], [-0.1, -0.1, 0.1, -0.1]], dtype=torch.float64)
    value = smooth_topk(s, 2, 1.0, noise=z)
    (grad,) = torch.autograd.grad(value, s)
    assert round(value.item(), 2) == 2.47 and abs(value.item() - 7.4 / 3) < 1e-12
    torch.testing.assert_close(grad, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.0], dtype=torch.float64))


@given(n=st.integers(2, 12), batch=st.integers(1, 5), seed=st.integers(0, 2**31 - 1), data=st.data())
def test_epsilon_zero_is_the_calibrated_hinge(n, batch, seed, data):
    k = data.draw(st.integers(1, n - 1))
    g = torch.Generator().manual_seed(seed)
    s, y = torch.randn(batch, n, generator=g, dtype=torch.float64) * 3, torch.randint(0, n, (batch,), generator=g)
    expected = F.relu(1 + s.sort(1, descending=True).values[:, k] - s.gather(1, y[:, None])[:, 0])
    torch.testing.assert_close(cal_hinge(s, y, k, reduction="none"), expected)
    torch.testing.assert_close(noised_bal(s, y, k, 0.0, reduction="none"), expected)


@given(n=st.integers(2, 10), seed=st.integers(0, 2**31 - 1), eps=st.sampled_from([0.01, 0.3, 3.0]),
       n_samples=st.integers(1, 6), data=st.data())
def test_loss_and_gradient_are_eq_10_and_12(n, seed, eps, n_samples, data):
    k = data.draw(st.integers(1, n - 1))
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(4, n, generator=g, dtype=torch.float64) * 2).requires_grad_()
    y = torch.randint(0, n, (4,), generator=g)
    z = torch.randn(n_samples, 4, n, generator=g, dtype=torch.float64)
    loss = noised_bal(s, y, k, eps, noise=z, reduction="sum")
    (grad,) = torch.autograd.grad(loss, s)
    perturbed = s.detach() + eps * z
    kth = perturbed.topk(k + 1, dim=-1)
    top_hat = kth.values[..., -1].mean(0)
    s_y = s.detach().gather(1, y[:, None])[:, 0]
    torch.testing.assert_close(loss, F.relu(1 + top_hat - s_y).sum())
    active = (1 + top_hat - s_y > 0).double()
    expected = active[:, None] * (F.one_hot(kth.indices[..., -1], n).double().mean(0) - F.one_hot(y, n).double())
    torch.testing.assert_close(grad, expected)
    assert ((grad != 0).sum(1) <= n_samples + 1).all()


def test_expected_gradient_is_the_smoothed_gradient():
    g = torch.Generator().manual_seed(3)
    s = torch.tensor([[3.0, 2.9, 2.7, 0.5, -1.0, -2.0]], dtype=torch.float64)   # hinge active, far from its kink
    y, k, eps = torch.tensor([5]), 2, 0.3
    copies = 20_000
    s_ = s.clone().requires_grad_()
    loss = noised_bal(s_.expand(copies, 6), y.expand(copies), k, eps, n_samples=3, generator=g, reduction="mean")
    (mean_grad,) = torch.autograd.grad(loss, s_)
    big = torch.randn(500_000, 1, 6, generator=g, dtype=torch.float64)
    arg_top = F.one_hot((s + eps * big).topk(k + 1, dim=-1).indices[..., -1], 6).double().mean(0)
    torch.testing.assert_close(mean_grad, arg_top - F.one_hot(y, 6).double(), atol=1.5e-2, rtol=0)


def test_reproducible_with_a_generator_and_differs_between_draws():
    s, y = torch.randn(16, 30), torch.randint(0, 30, (16,))
    a = noised_bal(s, y, 5, 0.5, 4, generator=torch.Generator().manual_seed(7), reduction="none")
    b = noised_bal(s, y, 5, 0.5, 4, generator=torch.Generator().manual_seed(7), reduction="none")
    c = noised_bal(s, y, 5, 0.5, 4, generator=torch.Generator().manual_seed(8), reduction="none")
    assert torch.equal(a, b) and not torch.equal(a, c)
    crit = NoisedBal(k=5, epsilon=0.5, n_samples=4, generator=torch.Generator().manual_seed(7), reduction="none")
    assert torch.equal(crit(s, y), a)


def test_smooth_topk_converges_within_prop_3_5():
    g = torch.Generator().manual_seed(4)
    s = torch.randn(30, generator=g, dtype=torch.float64)
    z = torch.randn(100_000, 30, generator=g, dtype=torch.float64)
    for k in (1, 4, 10):
        for eps in (1.0, 0.1, 0.01):
            gap = abs(smooth_topk(s, k, eps, noise=z).item() - topk_value(s, k).item())
            assert gap <= eps * k * (2 * torch.log(torch.tensor(30.0))).sqrt().item() + 0.01


def test_top_sum_and_its_argmax():
    s = torch.randn(6, 9, dtype=torch.float64)          # float32 sums in two orders can differ by more than allclose's atol near 0
    for k in range(0, 10):
        assert torch.allclose(top_sum(s, k), s.sort(1, descending=True).values[:, :k].sum(1))
        if k:
            assert torch.allclose((arg_top_sum(s, k) * s).sum(1), top_sum(s, k))
            assert (arg_top_sum(s, k).sum(1) == k).all()


def test_perturbed_argmax_backward_matches_closed_form_in_two_dimensions():
    theta = torch.tensor([0.4, 0.0], dtype=torch.float64, requires_grad=True)
    one_hot = lambda t: F.one_hot(t.argmax(-1), 2).to(t.dtype)
    y = perturbed_argmax(theta, one_hot, 1.0, n_samples=400_000, generator=torch.Generator().manual_seed(0))
    (g,) = torch.autograd.grad(y[0], theta)
    a = 0.4 / 2 ** 0.5
    density = torch.exp(torch.tensor(-a * a / 2)) / (2 * torch.pi) ** 0.5 / 2 ** 0.5
    torch.testing.assert_close(g, torch.tensor([1.0, -1.0], dtype=torch.float64) * density.double(), atol=1e-2, rtol=0)


def test_imbalanced_margins_and_reduction_to_balanced():
    counts = torch.tensor([500.0, 50.0, 5.0])
    m = margins_from_counts(counts, max_m=0.3)
    assert abs(m.max().item() - 0.3) < 1e-12 and torch.all(m[:-1] < m[1:])
    s, y = torch.randn(12, 3, dtype=torch.float64), torch.randint(0, 3, (12,))
    z = torch.randn(4, 12, 3, dtype=torch.float64)
    torch.testing.assert_close(noised_imbal(s, y, [9, 9, 9], k=1, epsilon=0.2, max_m=1.0, scale=1.0, noise=z),
                               noised_bal(s, y, k=1, epsilon=0.2, noise=z))
    crit = NoisedImbal(class_counts=counts, k=1)
    assert crit.class_counts.dtype == torch.float64 and torch.isfinite(crit(s.float(), y))


def test_half_precision_and_modules():
    s, y = torch.randn(8, 20), torch.randint(0, 20, (8,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert noised_bal(s.bfloat16(), y).dtype == torch.float32    # as F.cross_entropy under autocast
    assert torch.equal(CalHinge(k=3)(s, y), cal_hinge(s, y, 3))


@pytest.mark.parametrize("call, message", [
    (lambda s, y: noised_bal(s, y, epsilon=-1.0), "epsilon must be a finite number in [0.0, inf]"),
    (lambda s, y: noised_bal(s, y, n_samples=0), "n_samples must be an integer in [1, inf]"),
    (lambda s, y: noised_bal(s, y, k=10), "k must be an integer in [1, 9]"),
    (lambda s, y: noised_bal(s, y, k=0), "k must be an integer in [1, 9]"),
    (lambda s, y: noised_bal(s, y, noise=torch.randn(2, 4, 9)), "noise must have shape (n_samples, 4, 10)"),
    (lambda s, y: noised_imbal(s, y, [3] * 9), "class_counts must have one entry per class: 10 expected, got 9"),
    (lambda s, y: noised_imbal(s, y, [3] * 9 + [0]), "class_counts must be positive"),
    (lambda s, y: noised_imbal(s, y, [3] * 9 + [float("nan")]), "class_counts must be positive"),
    (lambda s, y: noised_imbal(s, y, [3] * 10, max_m=-1.0), "max_m must be a finite number in [0.0, inf]"),
    (lambda s, y: noised_bal(s.masked_fill(s > 0, float("inf")), y), "scores must be finite"),
    (lambda s, y: cal_hinge(s, y.float()), "target must hold integer class indices"),
    (lambda s, y: smooth_topk(s, 3, 0.1, n_samples=-2), "n_samples must be an integer in [1, inf]"),
    (lambda s, y: draw_noise(s, None, noise=torch.randn(0, 4, 10)), "at least one sample"),
])
def test_bad_input(call, message):
    s, y = torch.randn(4, 10), torch.tensor([0, 3, 9, 2])
    with pytest.raises((ValueError, TypeError)) as info:
        call(s, y)
    assert message in str(info.value)


@pytest.mark.parametrize("k, eps", [(1, 0.3), (4, 0.5), (12, 0.2)])
@pytest.mark.parametrize("imbalanced", [False, True])
def test_default_path_is_eq_10_and_12_on_the_sampled_draws(k, eps, imbalanced):
    g = torch.Generator().manual_seed(k)
    s = 3 * torch.randn(48, 50, generator=g, dtype=torch.float64)
    y = torch.randint(0, 50, (48,), generator=g)
    y[:24] = s[:24].argmax(1)                                                  # some hinges inactive
    counts = torch.randint(1, 100, (50,), generator=g)
    scale, margin = (2.0, margins_from_counts(counts)[y]) if imbalanced else (1.0, torch.ones(48, dtype=torch.float64))
    s_ = s.clone().requires_grad_()
    if imbalanced:
        loss = noised_imbal(s_, y, counts, k, eps, 6, scale=scale, reduction="sum", generator=torch.Generator().manual_seed(1))
    else:
        loss = noised_bal(s_, y, k, eps, 6, reduction="sum", generator=torch.Generator().manual_seed(1))
    (grad,) = torch.autograd.grad(loss, s_)
    draws = sample_perturbed_topk(s, k + 1, eps, 6, generator=torch.Generator().manual_seed(1))   # noise on s, unscaled
    hinge = margin + draws.values.mean(0) - s.gather(1, y[:, None])[:, 0]
    assert 0 < (hinge > 0).sum() < 48
    torch.testing.assert_close(loss, scale * F.relu(hinge).sum())
    expected = scale * (hinge > 0)[:, None] * (F.one_hot(draws.indices, 50).double().mean(0) - F.one_hot(y, 50).double())
    torch.testing.assert_close(grad, expected)
    assert ((grad != 0).sum(1) <= 6 + 1).all()


def test_default_path_has_the_exact_expected_loss_and_gradient():
    s = torch.tensor([0.5, 0.45, 0.4, 0.3, 0.25, 0.1, -3.0], dtype=torch.float64)   # y = 6 far below: always active
    k, eps, copies = 2, 0.2, 60_000
    mean, probs = perturbed_topk_law(s, k + 1, eps)
    s_ = s.expand(copies, 7).clone().requires_grad_()
    losses = noised_bal(s_, torch.full((copies,), 6), k, eps, 2, generator=torch.Generator().manual_seed(6),
                             reduction="none")
    (grad,) = torch.autograd.grad(losses.sum(), s_)
    assert (losses > 0).all()
    assert abs(losses.mean().item() - (1 + mean + 3)) < 4.5 * losses.std().item() / copies ** 0.5
    se = (probs * (1 - probs) / (2 * copies)).sqrt() + 1e-12
    assert ((grad.mean(0) - (probs - F.one_hot(torch.tensor(6), 7).double())).abs() < 4.5 * se).all()


def test_default_path_keeps_the_global_generator_untouched_and_float64():
    s, y = torch.randn(16, 30, dtype=torch.float64), torch.randint(0, 30, (16,))
    state = torch.get_rng_state()
    loss = noised_bal(s, y, 3, 0.5, 4, generator=torch.Generator().manual_seed(0))
    assert torch.equal(torch.get_rng_state(), state) and loss.dtype == torch.float64
