"""The plan a loss keeps per call signature (chapter 00) and the kernels it calls (chapters 03a, 05a, 06a): the same
numbers as the general path, every convention, and a plan that follows the module's settings."""
import math
import os

import pytest
import torch
import torch.nn.functional as F

from topk_nb import LOSSES, get_loss
from topk_nb.base.core import MAX_PLANS, conventions_loss, force_sync_free
from topk_nb.ops.launch import HAS_TRITON, force_triton
from topk_nb.ops.rows import ROW_LOSSES

pytestmark = pytest.mark.skipif(not HAS_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the kernels run on the CPU in Triton's interpreter only")

N = 24


def build(name, **kw):
    "A registry loss with small k (so that the rows can hold masked classes), seeded where it draws noise."
    if LOSSES[name].needs_class_counts:
        kw.setdefault("class_counts", torch.arange(1, N + 1))
    if "k" in LOSSES[name].defaults:
        kw.setdefault("k", 2)
    if LOSSES[name].stochastic:
        kw.setdefault("generator", torch.Generator().manual_seed(0))
    return get_loss(name, **kw)


def general(crit, x, y):
    "The loss by the general path: nn.CrossEntropyLoss's own code for ce, the conventions' code for the others."
    if type(crit).__name__ == "CE":
        w = None if crit.weight is None else crit.weight.to(x.dtype)
        return F.cross_entropy(x, y, weight=w, ignore_index=crit.ignore_index, reduction=crit.reduction,
                               label_smoothing=crit.label_smoothing)
    return conventions_loss(crit, x, y)


def both(crit, s, y, v=None):
    "(value, gradient, v . the gradient's gradient or None) by the module's plan and by the general path, on the same noise draws."
    out = []
    for planned in (True, False):
        if getattr(crit, "generator", None) is not None:
            crit.generator.manual_seed(7)
        x = s.clone().requires_grad_()
        with force_sync_free(), force_triton():
            loss = crit(x, y) if planned else general(crit, x, y)
            grad, = torch.autograd.grad(loss.sum(), x, create_graph=v is not None)
            second = None if v is None else torch.autograd.grad((grad * v).sum(), x)[0]
        if planned:
            plans = crit.__dict__.get("_plans", {})
            assert len(plans) == 1 and next(iter(plans.values())) is not None, "the call took no plan"
        out.append((loss, grad, second))
    return out


def labels(B, generator, ignored=True):
    y = torch.randint(0, N, (B,), generator=generator)
    if ignored: y[1] = -100                                            # a row that counts for nothing
    return y


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_the_plan_gives_the_general_paths_numbers(name, reduction, weighted):
    g = torch.Generator().manual_seed(1)
    s, y = 2 * torch.randn(6, N, generator=g), labels(6, g)
    weight = torch.rand(N, generator=g) + 0.5 if weighted else None
    crit = build(name, reduction=reduction, weight=weight)
    (a, ga, _), (b, gb, _) = both(crit, s, y)
    assert a.shape == b.shape and a.dtype == b.dtype
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [n for n in LOSSES if n != "ce"])
def test_masked_classes_and_half_scores_through_the_plan(name):
    g = torch.Generator().manual_seed(2)
    s, y = 2 * torch.randn(5, N, generator=g), labels(5, g, ignored=False)
    s[:, :4] = -math.inf                                                # masked classes, none a target
    y = torch.where(y < 4, y + 4, y)
    (a, ga, _), (b, gb, _) = both(build(name), s, y)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(a).all() and (ga[:, :4] == 0).all()
    (a, ga, _), (b, gb, _) = both(build(name), s.half(), y)                   # half scores: computed in float32, returned in half
    assert a.dtype == b.dtype == torch.float16
    torch.testing.assert_close(a, b, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("name", [n for n in LOSSES if n != "ce"])
def test_a_gradient_of_the_gradient_through_the_plan(name):
    # create_graph=True: the plan's backward is the loss's own formula by autograd, so a gradient penalty
    # backpropagates as on the general path (zero for the hinges, whose gradient is constant between kinks)
    g = torch.Generator().manual_seed(3)
    s, y, v = 2 * torch.randn(4, N, generator=g), labels(4, g), torch.randn(4, N, generator=g)
    (_, ga, sa), (_, gb, sb) = both(build(name, weight=torch.rand(N, generator=g) + 0.5), s, y, v)
    torch.testing.assert_close(ga, gb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sa, sb, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["focal", "topk_hinge", "smooth_svm", "noised_bal"])
def test_a_label_out_of_range_is_asserted_on_the_device(name):
    crit = build(name)
    s, y = torch.randn(3, N), torch.tensor([0, N, 1])
    with force_sync_free(), force_triton(), pytest.raises(RuntimeError, match="class indices"):
        crit(s, y)


@pytest.mark.parametrize("name", ["topk_hinge", "cvx_hinge", "cal_hinge", "topk_grouping", "smooth_svm", "noised_bal"])
def test_k_beyond_the_classes_is_refused_as_on_the_general_path(name):
    crit = build(name, k=N)
    s, y = torch.randn(3, N), torch.tensor([0, 1, 2])
    with force_sync_free(), force_triton(), pytest.raises(ValueError, match="k must be"):
        crit(s, y)


def test_a_plan_is_kept_per_signature_and_follows_the_settings():
    g = torch.Generator().manual_seed(4)
    s, y = torch.randn(5, N, generator=g), labels(5, g)
    crit = build("focal", gamma=2.0)
    with force_sync_free(), force_triton():
        first = crit(s, y)
        crit(s, y)
        assert len(crit._plans) == 1                                    # kept: the second call made none
        crit(s[:3], y[:3])
        assert len(crit._plans) == 2                                    # another shape, another plan
        crit.gamma = 0.0                                                # a setting drops the plans: it takes effect
        assert "_plans" not in crit.__dict__
        torch.testing.assert_close(crit(s, y), F.cross_entropy(s, y, ignore_index=-100))   # gamma = 0 is cross-entropy
        assert not torch.allclose(first, crit(s, y))
        for b in range(1, MAX_PLANS + 3):                               # a bounded store
            crit(s[:1].expand(b, N).contiguous(), y[:1].expand(b).contiguous())
        assert len(crit._plans) <= MAX_PLANS


def test_weights_and_class_counts_changed_in_place_take_effect():
    g = torch.Generator().manual_seed(5)
    s, y = torch.randn(5, N, generator=g), labels(5, g, ignored=False)
    for name in ("focal", "smooth_svm"):
        crit = build(name, weight=torch.ones(N), reduction="sum")
        with force_sync_free(), force_triton():
            before = crit(s, y)
            crit.weight.mul_(3.0)                                       # in place: the plan reads the buffer each call
            torch.testing.assert_close(crit(s, y), 3 * before)
    crit = build("ldam", class_counts=torch.ones(N))
    with force_sync_free(), force_triton():
        crit(s, y)
        crit.class_counts[:12] = 100.0                                  # in place: the margins are made again
        after = crit(s, y)
        fresh = build("ldam", class_counts=crit.class_counts.clone())(s, y)
    torch.testing.assert_close(after, fresh)


def test_the_host_asks_little_of_a_planned_call():
    from topk_nb.perf import bench
    rows = {r["loss"]: r for r in bench.host_table()}
    ce = rows["F.cross_entropy"]
    for name in LOSSES:
        r = rows[name]
        assert not r["dispatched"] and r["asserts"] == 0, r                # the kernels assert the labels themselves
        if name == "ce":
            assert r["kernels"] == ce["kernels"] and r["launches"] == 0, r  # F.cross_entropy itself
        else:
            seed = int(LOSSES[name].stochastic)                          # the noised losses draw a seed on the device
            assert r["launches"] <= 4 and r["kernels"] + r["launches"] <= ce["kernels"] + seed, r
        if name in ROW_LOSSES:                                           # the state (aux in it), the finishing kernel's
            assert r["allocations"] <= 3, r                              # loss, the gradient
        if name == "smooth_svm":                                         # rows of one tile: the forward's buffer (aux,
            assert r["allocations"] <= 3, r                              # rows, state, the backward's lists), the
                                                                         # finishing kernel's loss, the gradient; no tiles
        if LOSSES[name].stochastic:                                      # the selection's buffer (aux, means, candidates),
            assert r["allocations"] <= 4, r                              # the indices, the finishing kernel's loss, the
                                                                         # gradient: none that a kernel leaves unread


def test_a_copy_keeps_no_plan_of_its_original_and_a_module_pickles():
    import copy
    import io
    g = torch.Generator().manual_seed(6)
    s, y = torch.randn(5, N, generator=g), labels(5, g, ignored=False)
    for name in ("focal", "smooth_svm", "ce"):
        crit = build(name, weight=torch.ones(N), reduction="sum")
        with force_sync_free(), force_triton():
            before = crit(s, y)                                         # a plan kept
            twin = copy.deepcopy(crit)
            twin.weight.mul_(2.0)                                       # the copy's own buffer, in place
            torch.testing.assert_close(twin(s, y), 2 * before)          # its own plan reads its own weights
            torch.testing.assert_close(crit(s, y), before)
            buffer = io.BytesIO()
            torch.save(crit, buffer)                                    # the plans (closures) are not pickled
            buffer.seek(0)
            torch.testing.assert_close(torch.load(buffer, weights_only=False)(s, y), before)
