"""The forward algorithms of topk_nb.math.esp against exact references: subset enumeration (small n) and an
independent float64 algorithm (large n), over random sizes, k, batch shapes, scales and dtypes."""
import math

import pytest
import torch
from hypothesis import given, strategies as st

from topk_nb.base.core import brute_esp, brute_log_esp
from topk_nb.math.esp import dc_schedule, dc_term_count, esp_summation, log_esp, log_esp_error, log_esp_summation


def random_x(seed, shape, scale, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


small = dict(
    n=st.integers(1, 10), batch=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    scale=st.sampled_from([1e-3, 0.1, 1.0, 10.0, 1e3, 1e5]), seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)


@given(**small)
def test_log_esp_float64_equals_subset_enumeration(n, batch, scale, seed, data):
    k = data.draw(st.integers(0, n))
    x = random_x(seed, (*batch, n), scale)
    ref = brute_log_esp(x, k)
    out = log_esp(x, k)
    assert out.shape == (*batch, k + 1)
    assert (log_esp_error(out, ref, x) <= 1e-12).all()
    assert (log_esp_error(log_esp_summation(x, k), ref, x) <= 1e-12).all()


@given(**small)
def test_log_esp_float32_within_target_of_float64_on_rounded_inputs(n, batch, scale, seed, data):
    k = data.draw(st.integers(0, n))
    x32 = random_x(seed, (*batch, n), scale, torch.float32)
    out = log_esp(x32, k)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (log_esp_error(out, brute_log_esp(x32.double(), k), x32) <= 1e-4).all()


@given(n=st.integers(11, 700), k=st.integers(1, 20), seed=st.integers(0, 2**31 - 1),
       scale=st.sampled_from([0.1, 1.0, 30.0, 1e4]))
def test_log_esp_large_n_against_float64_summation(n, k, seed, scale):
    k = min(k, n)
    x32 = random_x(seed, (3, n), scale, torch.float32)
    ref = log_esp_summation(x32.double(), k)
    assert (log_esp_error(log_esp(x32.double(), k), ref, x32) <= 1e-12).all()
    assert (log_esp_error(log_esp(x32, k), ref, x32) <= 1e-4).all()


@pytest.mark.parametrize("n, k", [(1, 0), (1, 1), (2, 2), (3, 3), (31, 31), (64, 64), (5, 0)])
def test_k_equal_n_and_k_zero(n, k):
    x = random_x(n, (2, n), 3.0)
    out = log_esp(x, k)
    torch.testing.assert_close(out[..., 0], torch.zeros(2, dtype=torch.float64))
    if k == n:   # sigma_n is the product of all entries
        torch.testing.assert_close(out[..., n], x.sum(-1))
    if k >= 1:   # sigma_1 is their sum
        torch.testing.assert_close(out[..., 1], x.logsumexp(-1))


def test_batch_of_one_and_no_batch_agree():
    x = random_x(0, (1, 9), 2.0)
    torch.testing.assert_close(log_esp(x, 4)[0], log_esp(x[0], 4))


def test_exact_rational_values():
    e = [1, 2, 3, 4, 5, 6, 7]
    x = torch.tensor(e, dtype=torch.float64).log()
    exact = torch.tensor([math.log(brute_esp(e, j)) for j in range(8)], dtype=torch.float64)
    torch.testing.assert_close(log_esp(x, 7), exact, rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(esp_summation(x.exp(), 7).log(), exact, rtol=1e-14, atol=1e-14)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_are_computed_in_float32(dtype):
    x = random_x(1, (4, 50), 3.0, dtype)
    out = log_esp(x, 5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, log_esp(x.float(), 5).to(dtype))


def test_gradients_are_finite_with_padding_and_extreme_spread():
    # odd sizes exercise the padding polynomials; the spread mimics tau = 1e-4
    for n in [3, 7, 13, 100]:
        x = (random_x(n, (2, n), 1e4)).requires_grad_()
        log_esp(x, min(n, 6)).sum().backward()
        assert torch.isfinite(x.grad).all()


def test_gradcheck_float64():
    x = random_x(3, (2, 7), 1.5).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: log_esp(t, 4), (x,))


def test_operation_count_is_linear_in_kn():
    for n in [2, 9, 1000, 4097]:
        for k in [1, 3, 10]:
            if k <= n:
                assert dc_term_count(n, k) <= 4 * k * n + n
    assert len(dc_schedule(1000, 5)) == math.ceil(math.log2(1000))


@pytest.mark.parametrize("fn", [log_esp, log_esp_summation, esp_summation])
@pytest.mark.parametrize("args, message", [
    ((torch.zeros(2, 4), -1), "k must be an integer in [0, 4], got -1"),
    ((torch.zeros(2, 4), 5), "k must be an integer in [0, 4], got 5"),
    ((torch.zeros(2, 4), 1.0), "k must be an integer"),
    ((torch.zeros(2, 4, dtype=torch.int64), 1), "must be a floating tensor"),
    ((torch.tensor(0.5), 0), "at least one dimension"),
    ((torch.zeros(2, 0), 0), "at least 1 entries along its last dimension"),
    ((torch.tensor([[0.0, float("nan")]]), 1), "must be finite"),
    ((torch.tensor([[0.0, float("-inf")]]), 1), "must be finite"),
    (([0.0, 1.0], 1), "must be a torch.Tensor"),
])
def test_bad_input_gives_clear_errors(fn, args, message):
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args)
    assert message in str(info.value)


def test_inputs_too_large_for_the_log_zero_stand_in_are_refused():
    with pytest.raises(ValueError, match="magnitude at most"):
        log_esp(torch.full((1, 3), 3e37), 2)
