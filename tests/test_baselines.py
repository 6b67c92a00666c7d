import itertools
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from topk_nb.loss.baselines import (CE, CvxHinge, Focal, LDAM, TopkGrouping, TopkTransition,
                               ce, cvx_hinge, expected_loss, focal, ldam, split_target,
                               topk_group_mask, topk_grouping, topk_transition)
from topk_nb.base.core import target_rank
from topk_nb.loss.svm import topk_hinge


def problem(seed, batch, n, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(batch, n, generator=g, dtype=torch.float64) * scale
    y = torch.randint(0, n, (batch,), generator=g)
    t = torch.softmax(torch.randn(batch, n, generator=g, dtype=torch.float64) * 2, 1)
    return s, y, t


def test_cross_entropy_direct_formula_and_label_smoothing():
    s, y, t = problem(0, 7, 6)
    log_q = torch.log(torch.softmax(s, 1))
    torch.testing.assert_close(ce(s, y, reduction="none"), -log_q[torch.arange(7), y])
    torch.testing.assert_close(ce(s, t, reduction="none"), -(t * log_q).sum(1))
    smooth = 0.9 * F.one_hot(y, 6).double() + 0.1 / 6
    torch.testing.assert_close(ce(s, y, 0.1, reduction="none"), -(smooth * log_q).sum(1))


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0, 2.0, 5.0])
def test_focal_direct_formula(gamma):
    s, y, t = problem(1, 9, 5)
    q = torch.softmax(s, 1)
    q_y = q[torch.arange(9), y]
    torch.testing.assert_close(focal(s, y, gamma, reduction="none"), -(1 - q_y) ** gamma * q_y.log())
    torch.testing.assert_close(focal(s, t, gamma, reduction="none"), -(t * (1 - q) ** gamma * q.log()).sum(1))


def test_focal_gradient_finite_for_confident_samples():
    x = torch.tensor([[60.0, 0.0, -3.0], [0.0, 0.0, 0.0]], requires_grad=True)
    focal(x, torch.tensor([0, 1]), gamma=0.25).backward()
    assert torch.isfinite(x.grad).all()
    assert torch.autograd.gradcheck(lambda z: focal(z, torch.tensor([0, 2]), 0.5),
                                    (torch.randn(2, 4, dtype=torch.float64, requires_grad=True),))


def test_ldam_direct_formula_and_margins():
    s, y, _ = problem(2, 8, 4, scale=0.5)
    counts = torch.tensor([1000, 100, 10, 1])
    m = 0.5 * (counts.double().min() / counts.double()) ** 0.25
    for c in (1.0, 30.0):
        z = c * s.clone()
        z[torch.arange(8), y] -= c * m[y]
        torch.testing.assert_close(ldam(s, y, counts, 0.5, c, reduction="none"),
                                   z.logsumexp(1) - z[torch.arange(8), y])
    # Mixup: the lambda-weighted pair.
    y2 = (y + 1) % 4
    mixed = 0.25 * F.one_hot(y, 4).double() + 0.75 * F.one_hot(y2, 4).double()
    torch.testing.assert_close(ldam(s, mixed, counts, reduction="none"),
                               0.25 * ldam(s, y, counts, reduction="none") + 0.75 * ldam(s, y2, counts, reduction="none"))


@given(st.integers(0, 10_000), st.integers(3, 7), st.data())
def test_cvx_hinge_against_subsets_and_bounds(seed, n, data):
    k = data.draw(st.integers(1, n - 1))
    s, y, _ = problem(seed, 6, n)
    a = s + 1 - F.one_hot(y, n).double()
    best = torch.stack([a[:, list(A)].mean(1) for A in itertools.combinations(range(n), k)], 1).max(1).values
    expected = F.relu(best - s[torch.arange(6), y])
    cvx = cvx_hinge(s, y, k, reduction="none")
    torch.testing.assert_close(cvx, expected)
    assert (cvx >= k * topk_hinge(s, y, k, alpha=1 / k, reduction="none") - 1e-12).all()
    assert (cvx >= (target_rank(s, y) >= k).double() - 1e-12).all()


def grouping_reference(s, t, k):
    out = []
    for si, ti in zip(s.tolist(), t.tolist()):
        q = [math.exp(v) / math.fsum(math.exp(w) for w in si) for v in si]
        order = sorted(range(len(si)), key=lambda i: (-si[i], ti[i], i))      # ties: least target mass first
        group = set(order[:k])
        out.append(-math.fsum(ti[i] for i in group) * math.log(math.fsum(q[i] for i in group))
                   - math.fsum(ti[i] * math.log(q[i]) for i in range(len(si)) if i not in group))
    return torch.tensor(out, dtype=torch.float64)


@given(st.integers(0, 10_000), st.integers(2, 8), st.data(), st.booleans())
def test_grouping_and_transition_against_reference(seed, n, data, integer_scores):
    k = data.draw(st.integers(1, n - 1))
    s, y, t = problem(seed, 5, n)
    if integer_scores:             # many ties, at the k-th score too
        s = s.round().clamp(-1, 1)
    for target in (t, F.one_hot(y, n).double()):
        ref = grouping_reference(s, target, k)
        torch.testing.assert_close(topk_grouping(s, target, k, reduction="none"), ref)
        ce_s = ce(s, target, reduction="none")
        w = torch.softmax(s, 1).topk(k, 1).values.sum(1)
        torch.testing.assert_close(topk_transition(s, target, k, reduction="none"), (1 - w) * ce_s + w * ref)
    torch.testing.assert_close(topk_grouping(s, y, k, reduction="none"),
                               topk_grouping(s, F.one_hot(y, n).double(), k, reduction="none"))


def test_grouping_hand_cases_and_tie_gradient():
    s = torch.tensor([[0.4, 0.3, 0.2, 0.1]], dtype=torch.float64).log()
    assert topk_grouping(s, torch.tensor([1]), 2).item() == pytest.approx(-math.log(0.7))
    assert topk_grouping(s, torch.tensor([3]), 2).item() == pytest.approx(-math.log(0.1))
    assert topk_transition(s, torch.tensor([1]), 2).item() == pytest.approx(
        0.3 * -math.log(0.3) + 0.7 * -math.log(0.7))
    flat = torch.zeros(2, 4, dtype=torch.float64, requires_grad=True)
    yt = torch.tensor([1, 3])
    topk_grouping(flat, yt, 2, reduction="sum").backward()
    torch.testing.assert_close(flat.grad, 0.25 - F.one_hot(yt, 4).double())
    mask = topk_group_mask(flat.detach(), F.one_hot(yt, 4).double(), 2)
    assert mask.sum(1).tolist() == [2, 2] and not mask[0, 1] and not mask[1, 3]


def test_transition_between_grouping_and_ce():
    s, _, t = problem(4, 20, 10)
    for k in (1, 3, 9):
        tr = topk_transition(s, t, k, reduction="none")
        assert (topk_grouping(s, t, k, reduction="none") <= tr + 1e-12).all()
        assert (tr <= ce(s, t, reduction="none") + 1e-12).all()
    torch.testing.assert_close(topk_transition(s, t, 1), ce(s, t))


def test_gradchecks_away_from_ties():
    s, y, t = problem(5, 4, 6)
    x = s.clone().requires_grad_()
    for fn in (lambda z: topk_grouping(z, t, 2), lambda z: topk_transition(z, y, 3),
               lambda z: focal(z, t, 2.0),
               lambda z: ldam(z, y, [5, 4, 3, 2, 1, 1], scale=2.0), lambda z: cvx_hinge(z, y, 2)):
        assert torch.autograd.gradcheck(fn, (x,))


def test_detached_weight_gradient_is_the_weighted_mix():
    s, y, _ = problem(9, 5, 7)
    grads = []
    for fn in (lambda z: topk_transition(z, y, 3, detach_weight=True), lambda z: topk_grouping(z, y, 3),
               lambda z: ce(z, y)):
        x = s.clone().requires_grad_()
        fn(x).backward()
        grads.append(x.grad)
    w = torch.softmax(s, 1).topk(3, 1).values.sum(1, keepdim=True)
    torch.testing.assert_close(grads[0], (1 - w) * grads[2] + w * grads[1])


def test_split_target_and_expected_loss_errors():
    s, y, t = problem(6, 3, 4)
    with pytest.raises(ValueError, match="sum to 1"):
        split_target(t * 1.5, s)
    with pytest.raises(ValueError, match="non-negative"):
        split_target(t - 0.5, s)
    with pytest.raises(ValueError, match=r"shape \(3, 4\)"):
        split_target(t[:, :3], s)
    with pytest.raises(TypeError, match="integer class indices"):
        split_target(torch.tensor([True, False, True]), s)
    with pytest.raises(ValueError, match="max_support=2"):
        expected_loss(lambda a, b, reduction: a.sum(1), s, t, max_support=2)


@pytest.mark.parametrize("crit", [CE(), Focal(), LDAM(class_counts=[3, 2, 1, 1, 1]), CvxHinge(k=2),
                                  TopkGrouping(k=2), TopkTransition(k=2)], ids=lambda c: type(c).__name__)
def test_module_conventions_and_bad_input(crit):
    s, y, t = problem(7, 6, 5)
    s32 = s.float()
    loss = crit(s32, y)
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)
    assert crit(s32[:1], y[:1]).shape == ()
    assert crit(s32, t.float()).shape == ()
    assert crit(s32.bfloat16(), y).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):                 # float32 under autocast, as nn.CrossEntropyLoss
        assert crit(s32.bfloat16(), t.bfloat16()).dtype == torch.float32
    with pytest.raises(ValueError, match="finite"):
        crit(torch.full((2, 5), float("inf")), y[:2])
    with pytest.raises(ValueError, match=r"\[0, 4\]"):
        crit(s32, torch.full((6,), 5))
    torch.testing.assert_close(crit(s32[0], y[0]), crit(s32[:1], y[:1]))   # one unbatched sample: a batch of one
    with pytest.raises(ValueError, match=r"shape \(n,\), \(B, n\)"):
        crit(s32[0, 0], y[0])


def test_parameter_errors():
    s, y, _ = problem(8, 2, 4)
    with pytest.raises(ValueError, match="k must be"):
        topk_grouping(s, y, 4)
    with pytest.raises(ValueError, match="k must be"):
        cvx_hinge(s, y, 0)
    with pytest.raises(ValueError, match="gamma"):
        focal(s, y, -1.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        ce(s, y, 1.5)
    with pytest.raises(ValueError, match="one entry per class"):
        ldam(s, y, [1, 2, 3])
    with pytest.raises(ValueError, match="scale"):
        ldam(s, y, [1, 2, 3, 4], scale=0.0)
    with pytest.raises(ValueError, match="reduction"):
        topk_transition(s, y, 2, reduction="avg")
