"""The exact sparse sampler of top_K(s + eps Z) (topk_nb.loss.perturbed, section 5) against an exact quadrature reference."""
import math

import pytest
import torch
import torch.nn.functional as F

from topk_nb.base.core import force_sync_free
from topk_nb.loss.perturbed import (DENSE_RATIO, perturbed_topk_law, sample_perturbed_topk, sampled_topk_value, smooth_topk,
                               topk_value)

FLAT = torch.tensor([1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], dtype=torch.float64)
CASES = [(FLAT, 2, 0.3), (torch.tensor([2.0, -1.0, 0.5, 0.4, 3.0], dtype=torch.float64), 3, 0.5),
         (torch.tensor([0.2, 0.1, 0.0, -0.3, 1.0, 0.05], dtype=torch.float64), 1, 1.0)]
ROUTES = {"sparse": dict(n_extra=1, dense_ratio=math.inf), "dense": dict(n_extra=1, dense_ratio=0.0),
          "mixed": dict(n_extra=1, dense_ratio=1.0)}


def z_scores(values, indices, mean, probs):
    "Largest |z| of the Monte-Carlo mean and of the index frequencies against the exact law."
    v, i = values.reshape(-1).double(), indices.reshape(-1)
    freq = torch.bincount(i, minlength=len(probs)).double() / len(i)
    se = (probs * (1 - probs) / len(i)).sqrt() + 1e-12
    return abs(v.mean().item() - mean) / (v.std().item() / math.sqrt(len(v))), ((freq - probs).abs() / se).max().item()


@pytest.mark.parametrize("s, k, eps", CASES)
def test_quadrature_reference_matches_brute_force(s, k, eps):
    mean, probs = perturbed_topk_law(s, k, eps)
    assert abs(probs.sum().item() - 1) < 1e-9 and (probs >= 0).all()
    g = torch.Generator().manual_seed(0)
    dense = (s + eps * torch.randn(400_000, len(s), generator=g, dtype=torch.float64)).topk(k, dim=-1)
    z_mean, z_freq = z_scores(dense.values[:, -1], dense.indices[:, -1], mean, probs)
    assert z_mean < 4.5 and z_freq < 4.5
    wrong_mean, wrong_probs = perturbed_topk_law(s, k, 1.05 * eps)            # sharp: 5% off in epsilon is detected
    assert max(z_scores(dense.values[:, -1], dense.indices[:, -1], wrong_mean, wrong_probs)) > 6


def test_quadrature_reference_special_cases():
    # K = 1 of two classes: P(X_0 > X_1) = Phi((s_0 - s_1) / (eps sqrt 2)); E[max] = s_0 Phi(d/c) + s_1 Phi(-d/c) + c phi(d/c)
    s, eps = torch.tensor([0.4, 0.0], dtype=torch.float64), 0.5
    c, d = eps * math.sqrt(2), 0.4
    Phi = lambda x: 0.5 * math.erfc(-x / math.sqrt(2))
    mean, probs = perturbed_topk_law(s, 1, eps)
    assert abs(probs[0].item() - Phi(d / c)) < 1e-9
    assert abs(mean - (0.4 * Phi(d / c) + c * math.exp(-(d / c) ** 2 / 2) / math.sqrt(2 * math.pi))) < 1e-9
    # equal scores: every class equally likely at every rank
    _, probs = perturbed_topk_law(torch.zeros(5), 3, 1.0)
    torch.testing.assert_close(probs, torch.full((5,), 0.2, dtype=torch.float64), rtol=0, atol=1e-9)


@pytest.mark.parametrize("s, k, eps", CASES)
@pytest.mark.parametrize("route", list(ROUTES))
def test_sampler_has_the_exact_law_on_every_route(s, k, eps, route):
    g = torch.Generator().manual_seed(11)
    rows = 160_000
    draws = sample_perturbed_topk(s.expand(rows // 5, len(s)), k, eps, 5, generator=g, **ROUTES[route])
    st = draws.stats
    assert st["candidates"] == k + 1 < len(s)                                  # there is a tail
    if route == "sparse":
        assert st["exceeders"] > 100 and st["dense_rows"] == 0                 # thinning accepted points
    elif route == "dense":
        assert st["dense_rows"] == rows and st["points"] == 0
    else:
        assert 0 < st["dense_rows"] < rows // 2 and st["exceeders"] > 100      # both routes in one call
    z_mean, z_freq = z_scores(draws.values, draws.indices, *perturbed_topk_law(s, k, eps))
    assert z_mean < 4.5 and z_freq < 4.5


def test_no_tail_when_the_candidates_are_all_classes():
    g = torch.Generator().manual_seed(2)
    draws = sample_perturbed_topk(FLAT.expand(20_000, 8), 6, 0.3, 5, generator=g)
    assert draws.stats == dict(candidates=8, points=0, exceeders=0, dense_rows=0)
    assert max(z_scores(draws.values, draws.indices, *perturbed_topk_law(FLAT, 6, 0.3))) < 4.5


def test_sparse_agrees_with_dense_noise_at_training_scale():
    g = torch.Generator().manual_seed(3)
    s = torch.randn(256, 1000, generator=g)
    for k in (2, 6, 21):
        st = sample_perturbed_topk(s, k, 0.2, 10, generator=g).stats
        assert st["candidates"] == 3 * k + 8 and st["points"] < 25_600 and st["dense_rows"] < 50
    rows, S = s[:32], 300
    sparse = sample_perturbed_topk(rows, 6, 0.2, S, generator=g).values
    dense = torch.stack([topk_value(rows + 0.2 * torch.randn(rows.shape, generator=g), 6) for _ in range(S)])
    z = (sparse.mean(0) - dense.mean(0)) / ((sparse.var(0) + dense.var(0)) / S).sqrt()
    assert z.abs().max() < 4.5
    assert sample_perturbed_topk(0.1 * s, 6, 0.2, 10, generator=g).stats["dense_rows"] == 2560   # flat: all dense


@pytest.mark.parametrize("shape, k", [((6, 40), 1), ((6, 40), 7), ((2, 3, 9), 4), ((12,), 12)])
def test_value_and_gradient_are_the_mean_and_mean_one_hot_of_the_draws(shape, k):
    g = torch.Generator().manual_seed(4)
    s = 0.3 * torch.randn(*shape, generator=g, dtype=torch.float64)
    s_ = s.clone().requires_grad_()
    value = smooth_topk(s_, k, 0.5, 7, generator=torch.Generator().manual_seed(9))
    w = torch.randn(shape[:-1], generator=g, dtype=torch.float64)
    (grad,) = torch.autograd.grad((w * value).sum(), s_)
    draws = sample_perturbed_topk(s, k, 0.5, 7, generator=torch.Generator().manual_seed(9))
    assert value.dtype == torch.float64 and value.shape == shape[:-1]
    assert torch.equal(value, draws.values.mean(0))
    torch.testing.assert_close(grad, w[..., None] * F.one_hot(draws.indices, shape[-1]).double().mean(0),
                               rtol=0, atol=1e-15)
    assert ((draws.values - topk_value(s, k)).abs() < 0.5 * 8).all()


def test_generator_is_used_for_every_draw():
    s = FLAT.expand(2000, 8)
    state = torch.get_rng_state()
    runs = [sample_perturbed_topk(s, 3, 0.4, 3, generator=torch.Generator().manual_seed(seed), n_extra=1,
                                  dense_ratio=1.0) for seed in (5, 5, 6)]
    assert torch.equal(torch.get_rng_state(), state)                        # the global generator was not touched
    assert 0 < runs[0].stats["dense_rows"] and runs[0].stats["exceeders"] > 0
    assert torch.equal(runs[0].values, runs[1].values) and torch.equal(runs[0].indices, runs[1].indices)
    assert not torch.equal(runs[0].values, runs[2].values)


def test_dtypes():
    s = torch.randn(4, 30)
    assert sample_perturbed_topk(s.double(), 2, 0.2, 3).values.dtype == torch.float64
    assert sampled_topk_value(s, 2, 0.2, 3).dtype == torch.float32
    for half in (torch.float16, torch.bfloat16):
        assert smooth_topk(s.to(half), 2, 0.2, 3).dtype == half
    assert DENSE_RATIO == 0.1


@pytest.mark.parametrize("call, message", [
    (lambda s: sample_perturbed_topk(s, 11, 0.1, 3), "k must be an integer in [1, 10]"),
    (lambda s: sample_perturbed_topk(s, 2, 0.1, 0), "n_samples must be an integer in [1, inf]"),
    (lambda s: sample_perturbed_topk(s, 2, 0.1, 3, n_extra=-1), "n_extra must be an integer in [0, inf]"),
    (lambda s: perturbed_topk_law(s[0], 2, 0.0), "epsilon must be a finite number in (0.0, inf]"),
    (lambda s: sample_perturbed_topk(s, 2, 0.0, 3), "epsilon must be a finite number in (0.0, inf]"),
    (lambda s: smooth_topk(s, 2, 0.1, n_samples=0), "n_samples must be an integer in [1, inf]"),
])
def test_bad_input(call, message):
    with pytest.raises((ValueError, TypeError)) as info:
        call(torch.randn(4, 10))
    assert message in str(info.value)


def test_runs_inside_torch_compile():
    # compiled code takes the sync-free route (dense draws, fixed shapes): eager code on that route draws the same
    f = torch.compile(lambda s: smooth_topk(s, 3, 0.5, 4, generator=torch.Generator().manual_seed(0)).sum(),
                      backend="aot_eager")
    for n in (50, 60, 70):
        s = torch.randn(8, n, requires_grad=True)
        value = f(s)
        value.backward()
        assert torch.equal(s.grad.sum(1), torch.ones(8))
        with force_sync_free():
            torch.testing.assert_close(value, smooth_topk(s, 3, 0.5, 4, generator=torch.Generator().manual_seed(0)).sum())
