"""Top-k marginals and multi-crop prediction (topk_nb.math.predict) against enumeration of the k-sets in float64."""
import itertools
import math

import pytest
import torch
from hypothesis import given, strategies as st

from topk_nb.math.predict import PREDICT_METHODS, _tree_marginals, multicrop_marginals, predict_topk, topk_marginals


def random_scores(seed, shape, scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def marginals_by_subsets(scores, k, tau=1.0):
    "P(i in A), A a k-set with probability proportional to exp(sum_{j in A} s_j / tau), by enumeration (float64)."
    x = scores.double() / tau
    n = x.shape[-1]
    log_w = {A: x[..., list(A)].sum(-1) for A in itertools.combinations(range(n), k)}
    log_z = torch.stack(list(log_w.values()), -1).logsumexp(-1)
    cols = [torch.stack([w for A, w in log_w.items() if i in A], -1).logsumexp(-1) for i in range(n)]
    return torch.exp(torch.stack(cols, -1) - log_z[..., None])


@given(n=st.integers(1, 8), seed=st.integers(0, 2**31 - 1), tau=st.sampled_from([0.05, 0.3, 1.0, 4.0]),
       scale=st.sampled_from([0.1, 1.0, 5.0]), data=st.data())
def test_matches_enumeration(n, seed, tau, scale, data):
    k = data.draw(st.integers(1, n))
    s = random_scores(seed, (3, n), scale)
    p = topk_marginals(s, k, tau)
    assert p.shape == s.shape and p.dtype == torch.float64
    torch.testing.assert_close(p, marginals_by_subsets(s, k, tau), rtol=1e-9, atol=1e-12)


@given(n=st.integers(2, 200), seed=st.integers(0, 2**31 - 1), tau=st.sampled_from([1e-3, 0.1, 1.0, 100.0]),
       data=st.data())
def test_sum_to_k_and_in_unit_interval(n, seed, tau, data):
    k = data.draw(st.integers(1, min(n, 20)))
    p = topk_marginals(random_scores(seed, (4, n), 3.0), k, tau)
    assert ((p >= 0) & (p <= 1)).all()
    torch.testing.assert_close(p.sum(-1), torch.full((4,), float(k), dtype=torch.float64))


@given(n=st.integers(2, 60), seed=st.integers(0, 2**31 - 1), tau=st.sampled_from([0.2, 1.0, 3.0]), data=st.data())
def test_order_of_the_scores_is_preserved(n, seed, tau, data):
    k = data.draw(st.integers(1, n - 1))
    s = random_scores(seed, (3, n), 2.0)
    p = topk_marginals(s, k, tau)
    above = s[:, :, None] > s[:, None, :]
    assert (p[:, :, None] >= p[:, None, :])[above].all()
    top_p = p.topk(k, dim=-1).indices.sort(-1).values
    assert torch.equal(top_p, s.topk(k, dim=-1).indices.sort(-1).values)


def test_equal_scores_give_equal_marginals():
    s = torch.tensor([[1.0, 2.0, 1.0, 0.5, 2.0]], dtype=torch.float64)
    p = topk_marginals(s, 2)   # equal in exact arithmetic; different tree positions round differently
    torch.testing.assert_close(p[:, [0, 1]], p[:, [2, 4]], rtol=1e-14, atol=0)


@pytest.mark.parametrize("tau", [0.1, 1.0, 7.0])
def test_k1_is_softmax_and_k_n_is_ones(tau):
    s = random_scores(0, (5, 30), 4.0)
    torch.testing.assert_close(topk_marginals(s, 1, tau), torch.softmax(s / tau, -1))
    assert torch.equal(topk_marginals(s, 30, tau), torch.ones_like(s))
    torch.testing.assert_close(topk_marginals(s, 29, tau), 1 - torch.softmax(-s / tau, -1))   # complements


def test_single_row_and_extra_leading_dims():
    s = random_scores(1, (2, 3, 7), 2.0)
    ref = marginals_by_subsets(s, 3)
    torch.testing.assert_close(topk_marginals(s, 3), ref)
    torch.testing.assert_close(topk_marginals(s[0, 0], 3), ref[0, 0])
    assert topk_marginals(torch.empty(0, 7), 3).shape == (0, 7)


def test_no_autograd_side_effects():
    leaf = torch.randn(4, 20, requires_grad=True)
    hidden = leaf * 3
    for context in (torch.no_grad, torch.inference_mode, torch.enable_grad):
        with context():
            for k in (1, 5, 20):
                p = topk_marginals(hidden, k)
                assert not p.requires_grad and p.grad_fn is None
    assert leaf.grad is None
    hidden.sum().backward()
    assert torch.equal(leaf.grad, torch.full_like(leaf, 3.0))


def test_half_is_computed_in_float32():
    s = random_scores(2, (3, 40), 3.0, torch.float32)
    for dtype in (torch.float16, torch.bfloat16):
        p = topk_marginals(s.to(dtype), 4)
        assert p.dtype == dtype
        assert torch.equal(p, topk_marginals(s.to(dtype).float(), 4).to(dtype))


def attainable_error(s, k, tau):
    "max(1e-6, 2 u M), M the spread |s_j - c| / tau of the k+1 best scores around c, the mean of the k best."
    top = s.double().topk(k + 1, dim=-1).values
    m = (top - top[..., :k].mean(-1, keepdim=True)).abs().sum(-1) / tau
    return torch.clamp(torch.finfo(torch.float32).eps * m, min=1e-6)


@pytest.mark.parametrize("tau", [1e2, 1.0, 1e-2, 1e-4])
@pytest.mark.parametrize("k", [2, 5, 20])
def test_float32_large_scores_stable(tau, k):
    s = random_scores(3, (8, 1000), 100.0, torch.float32)
    p32 = topk_marginals(s, k, tau)
    assert torch.isfinite(p32).all() and ((p32 >= 0) & (p32 <= 1)).all()
    assert (p32.double().sum(-1) - k).abs().max() < 1e-4 * k
    # the float64 result from the same float32 scores, within what a float32 computation can attain
    err = (p32.double() - topk_marginals(s.double(), k, tau)).abs().amax(-1)
    assert (err <= attainable_error(s, k, tau)).all()


def test_tiny_tau_gives_the_hard_topk_indicator():
    s = random_scores(8, (4, 300), 5.0, torch.float32)
    hard = torch.zeros_like(s).scatter_(1, s.topk(5, dim=-1).indices, 1.0)
    for tau in (1e-6, 1e-20, 1e-38):
        torch.testing.assert_close(topk_marginals(s, 5, tau), hard, rtol=0, atol=1e-17)


def test_masked_logits_and_far_leaders():
    fmin = torch.finfo(torch.float32).min
    masked = torch.tensor([[10.0, 9.0, fmin, fmin]])
    leader = torch.tensor([[1e6, 5.0, 5.0, 0.0, -1e6]])
    for tau in (1.0, 1e-3, 1e-30):
        # the two masked labels share the last place; the tied labels behind the leader share theirs
        torch.testing.assert_close(topk_marginals(masked, 3, tau), torch.tensor([[1.0, 1.0, 0.5, 0.5]]))
        if tau < 1:
            torch.testing.assert_close(topk_marginals(leader, 2, tau), torch.tensor([[1.0, 0.5, 0.5, 0.0, 0.0]]),
                                       rtol=0, atol=1e-6)


def test_far_leader_does_not_cost_precision():
    # the leader is in the set and -1e6 out (to e^-1e6): the rest is the top-2 marginals of (7, 5, 5, 0)
    lead = torch.tensor([[1e6, 7.0, 5.0, 5.0, 0.0, -1e6]])
    expected = torch.cat([torch.ones(1, 1), marginals_by_subsets(lead[:, 1:5], 2).float(), torch.zeros(1, 1)], -1)
    torch.testing.assert_close(topk_marginals(lead, 3, 1.0), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", range(4))
def test_float32_accuracy_with_many_sets_near_the_top(seed):
    # k = 20 of 100 labels at small tau: the case that needs the top-k mean as origin (5e-5 and 1e-3 without it)
    s = random_scores(seed, (4, 100), 1.0, torch.float32)
    for tau in (1e-3, 1e-2):
        p32, p64 = topk_marginals(s, 20, tau).double(), topk_marginals(s.double(), 20, tau)
        assert (p32 - p64).abs().max() < 1e-5
        assert (p32.sum(-1) - 20).abs().max() < 1e-4


def test_extreme_inputs_stay_finite_and_in_range():
    s = torch.tensor([[3e38, -3e38, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1e30, 1e30, -1e30, 0.0]])
    for k in (1, 2, 3, 4):
        for tau in (1e-38, 1e-10, 1.0, 1e30):
            p = topk_marginals(s, k, tau)
            assert torch.isfinite(p).all() and ((p >= 0) & (p <= 1)).all()
            assert (p.double().sum(-1) - k).abs().max() < 1e-5
    torch.testing.assert_close(topk_marginals(s, 2)[0], torch.tensor([1.0, 0.0, 1 / (1 + math.e), 1 / (1 + 1 / math.e)]))
    torch.testing.assert_close(topk_marginals(s, 3)[1], torch.full((4,), 0.75))


def test_multicrop_is_the_mean_over_crops():
    crops = random_scores(4, (6, 4, 9), 2.0)
    got = multicrop_marginals(crops, 3, tau=0.5)
    assert got.shape == (6, 9)
    manual = torch.stack([marginals_by_subsets(crops[:, c], 3, 0.5) for c in range(4)], 1).mean(1)
    torch.testing.assert_close(got, manual)
    torch.testing.assert_close(got.sum(-1), torch.full((6,), 3.0, dtype=torch.float64))
    torch.testing.assert_close(multicrop_marginals(crops[:, :1], 3, 0.5), topk_marginals(crops[:, 0], 3, 0.5))


def test_predict_single_view_is_topk_of_scores():
    s = random_scores(5, (32, 50), 1.0)
    for method in PREDICT_METHODS:
        assert torch.equal(predict_topk(s, 5, method), s.topk(5, dim=-1).indices)
    assert predict_topk(s, 5).dtype == torch.int64


@pytest.mark.parametrize("method", PREDICT_METHODS)
def test_predict_crops_is_topk_of_manual_average(method):
    crops = random_scores(6, (16, 5, 8), 2.0)
    if method == "marginals":
        avg = torch.stack([marginals_by_subsets(crops[:, c], 3, 0.7) for c in range(5)], 1).mean(1)
    elif method == "softmax":
        avg = torch.softmax(crops / 0.7, -1).mean(1)
    else:
        avg = crops.mean(1)
    got = predict_topk(crops, 3, method, tau=0.7)
    assert got.shape == (16, 3)
    assert torch.equal(got, avg.topk(3, dim=-1).indices)


def test_marginals_and_softmax_averaging_disagree():
    crops = torch.tensor([[[5.0, 0.0, 4.0, 0.0], [0.0, 5.5, 4.0, 0.0]]])
    assert predict_topk(crops, 2, "softmax").tolist() == [[1, 0]]
    assert predict_topk(crops, 2, "marginals").tolist() == [[2, 1]]


def test_ties_are_deterministic():
    tied = torch.tensor([[[1.0, 3.0, 3.0, 0.0, 3.0]]])
    for method in ("softmax", "scores"):
        assert predict_topk(tied, 2, method).tolist() == [[1, 2]]          # equal: the smaller index first
    # equal scores give marginals equal only up to rounding (different tree positions); the set is right
    first = predict_topk(tied, 3, "marginals")
    assert sorted(first[0].tolist()) == [1, 2, 4] and torch.equal(predict_topk(tied, 3, "marginals"), first)
    assert predict_topk(tied[:, 0], 3).tolist() == [[1, 2, 4]]
    # marginals saturated at 1 by a tiny tau: ties broken by the mean score
    sharp = torch.tensor([[[0.0, 20.0, 10.0, 30.0, 5.0], [0.0, 20.0, 10.0, 30.0, 5.0]]])
    assert (multicrop_marginals(sharp, 4, 1e-3)[:, 1:] == 1).all()
    assert predict_topk(sharp, 4, tau=1e-3).tolist() == [[3, 1, 2, 4]]
    # softmax underflowing to 0 for all but the best label: the rest still ranked by the mean score
    assert predict_topk(sharp, 4, "softmax", tau=1e-3).tolist() == [[3, 1, 2, 4]]


def test_tree_path_without_shortcuts():
    # topk_marginals answers k = 1 with the softmax and k = n with ones; the tree path must agree
    s = random_scores(7, (3, 12), 2.0)
    x = (s - s.amax(-1, keepdim=True)) / 0.5
    torch.testing.assert_close(_tree_marginals(x, 1), torch.softmax(s / 0.5, -1))
    torch.testing.assert_close(_tree_marginals(x, 12), torch.ones_like(s))
    torch.testing.assert_close(_tree_marginals(x, 2), marginals_by_subsets(s, 2, 0.5))


@pytest.mark.parametrize("call, error, match", [
    (lambda s: topk_marginals(s, 0), ValueError, r"k must be an integer in \[1, 5\]"),
    (lambda s: topk_marginals(s, 6), ValueError, r"k must be an integer in \[1, 5\]"),
    (lambda s: topk_marginals(s, 2.5), TypeError, "k must be an integer"),
    (lambda s: topk_marginals(s, 2, tau=0.0), ValueError, r"tau must be a finite number in \(0.0, inf\]"),
    (lambda s: topk_marginals(s, 2, tau=-1.0), ValueError, r"tau must be a finite number in \(0.0, inf\]"),
    (lambda s: topk_marginals(s, 2, tau=math.inf), ValueError, "tau must be a finite number"),
    (lambda s: topk_marginals(s.fill_(math.nan), 2), ValueError, "scores must be finite"),
    (lambda s: topk_marginals(s[0, 0], 1), ValueError, "at least one dimension"),
    (lambda s: topk_marginals(s.long(), 2), TypeError, "scores must be a floating tensor"),
    (lambda s: topk_marginals(s.tolist(), 2), TypeError, "scores must be a torch.Tensor"),
    (lambda s: multicrop_marginals(s, 2), ValueError, r"scores must have shape \(B, n_crops, n\)"),
    (lambda s: multicrop_marginals(s[:, None, :], 6), ValueError, r"k must be an integer in \[1, 5\]"),
    (lambda s: multicrop_marginals(s[:, :0, None].expand(2, 0, 5), 2), ValueError, "n_crops >= 1"),
    (lambda s: predict_topk(s, 2, "vote"), ValueError, "method must be one of"),
    (lambda s: predict_topk(s[0], 2), ValueError, r"scores must have shape \(B, n\) or \(B, n_crops, n\)"),
    (lambda s: predict_topk(s[None, None], 2), ValueError, r"scores must have shape \(B, n\) or \(B, n_crops, n\)"),
    (lambda s: predict_topk(s, 0), ValueError, r"k must be an integer in \[1, 5\]"),
    (lambda s: predict_topk(s[:, None], 2, tau=0), ValueError, "tau must be a finite number"),
    (lambda s: predict_topk(torch.tensor([[0.0, math.inf]]), 1), ValueError, "scores must be finite"),
])
def test_bad_input(call, error, match):
    with pytest.raises(error, match=match):
        call(torch.randn(2, 5))
