"""Every loss module as a drop-in for nn.CrossEntropyLoss: attributes that take effect, keyword-only
hyper-parameters, weight / ignore_index / extra dimensions / probability targets of any support, float32
under autocast, the top-level API, and the noised losses against the authors' package on the same noise."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import topk_nb
from topk_nb.loss.registry import LOSSES, get_loss

N_CLASSES = 8
COUNTS = torch.arange(1, N_CLASSES + 1) * 10


def extra(name):
    entry, kw = LOSSES[name], {}
    if entry.needs_class_counts: kw["class_counts"] = COUNTS
    if entry.stochastic: kw["generator"] = torch.Generator().manual_seed(3)
    return kw


def problem(seed=0, batch=6, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return 2 * torch.randn(batch, N_CLASSES, generator=g, dtype=dtype), torch.randint(0, N_CLASSES, (batch,), generator=g)


# hyper-parameters changed on a built module, and the value they change to
CHANGES = {"focal": {"gamma": 0.5}, "ldam": {"scale": 3.0, "max_m": 0.3}, "topk_hinge": {"k": 2, "alpha": 0.5},
           "cvx_hinge": {"k": 3, "alpha": 0.2}, "cal_hinge": {"k": 3}, "smooth_svm": {"tau": 0.01, "k": 3, "alpha": 0.5},
           "noised_bal": {"epsilon": 1.0, "k": 2}, "noised_imbal": {"epsilon": 0.5, "scale": 2.0},
           "topk_grouping": {"k": 3}, "topk_transition": {"k": 2}, "ce": {"label_smoothing": 0.2}}


@pytest.mark.parametrize("name", list(LOSSES))
def test_attributes_read_and_write_through(name):
    assert set(CHANGES) == set(LOSSES)
    s, y = problem(1)
    crit = get_loss(name, reduction="none", **extra(name))
    before = crit(s, y)
    for key, value in CHANGES[name].items():
        assert hasattr(crit, key)
        setattr(crit, key, value)
    fresh = get_loss(name, reduction="none", **{**extra(name), **CHANGES[name]})
    if LOSSES[name].stochastic:              # same seed, same order of draws: the same noise for both
        crit.generator, fresh.generator = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    after = crit(s, y)
    torch.testing.assert_close(after, fresh(s, y))
    assert not torch.allclose(before, after), name


def test_annealing_tau_follows_the_schedule():
    s, y = problem(2)
    crit = get_loss("smooth_svm", k=5, tau=1.0)
    for tau in (1.0, 0.3, 0.1, 0.01):
        crit.tau = tau
        torch.testing.assert_close(crit(s, y), topk_nb.smooth_topk_svm(s, y, 5, tau))


@pytest.mark.parametrize("name", list(LOSSES))
def test_hyper_parameters_are_keyword_only(name):
    module = LOSSES[name].module
    with pytest.raises(TypeError, match="keyword arguments only"):
        module(100)                                   # the authors' modules take n_classes first
    with pytest.raises(TypeError, match="no n_classes"):
        module(n_classes=100, **extra(name))


@pytest.mark.parametrize("name", list(LOSSES))
def test_weight_and_ignore_index_as_in_cross_entropy(name):
    s, y = problem(3)
    y[2] = -100
    w = torch.linspace(0.5, 2.0, N_CLASSES)
    crit = get_loss(name, weight=w, reduction="mean", **extra(name))
    each = get_loss(name, reduction="none", **extra(name))
    keep = y != -100
    if LOSSES[name].stochastic:              # the rows differ in number, so the draws would: compare the noiseless loss
        crit.epsilon = each.epsilon = 0.0
    per = each(s[keep], y[keep])
    wy = w.double()[y[keep]]
    torch.testing.assert_close(crit(s, y), (wy * per).sum() / wy.sum())


def test_cross_entropy_module_is_nn_cross_entropy():
    g = torch.Generator().manual_seed(4)
    s, y = torch.randn(3, 5, 2, 4, generator=g), torch.randint(0, 5, (3, 2, 4), generator=g)
    y[0, 1, 2] = 7 - 8                                   # ignore_index=-1 below
    w = torch.rand(5, generator=g) + 0.5
    for reduction in ("mean", "sum", "none"):
        ours = topk_nb.CE(weight=w, ignore_index=-1, label_smoothing=0.1, reduction=reduction)(s, y)
        ref = nn.CrossEntropyLoss(weight=w, ignore_index=-1, label_smoothing=0.1, reduction=reduction)(s, y)
        torch.testing.assert_close(ours, ref)


@pytest.mark.parametrize("name", list(LOSSES))
def test_extra_dimensions(name):
    g = torch.Generator().manual_seed(5)
    s, y = torch.randn(2, N_CLASSES, 3, 2, generator=g, dtype=torch.float64), torch.randint(0, N_CLASSES, (2, 3, 2), generator=g)
    crit = get_loss(name, reduction="none", **extra(name))
    flat = get_loss(name, reduction="none", **extra(name))
    out = crit(s, y)
    assert out.shape == (2, 3, 2)
    torch.testing.assert_close(out, flat(s.movedim(1, -1).reshape(-1, N_CLASSES), y.reshape(-1)).reshape(2, 3, 2))


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_one_unbatched_sample_as_in_cross_entropy(name, reduction):
    "Scores (n,) with a class index () or probabilities (n,): the shape nn.CrossEntropyLoss gives, the value of a batch of one."
    g = torch.Generator().manual_seed(6)
    s = 2 * torch.randn(N_CLASSES, generator=g, dtype=torch.float64)
    p = torch.softmax(torch.randn(N_CLASSES, generator=g, dtype=torch.float64), 0)
    for t in (torch.tensor(3), p):
        one, batch = get_loss(name, reduction=reduction, **extra(name)), get_loss(name, reduction=reduction, **extra(name))
        out = one(s, t)
        assert out.shape == nn.CrossEntropyLoss(reduction=reduction)(s, t).shape == ()
        torch.testing.assert_close(out, batch(s[None], t[None]).reshape(()))
    with pytest.raises(ValueError, match=r"target must be a class index of shape \(\) or probabilities of shape \(8,\)"):
        get_loss(name, **extra(name))(s, torch.tensor([3]))


@pytest.mark.parametrize("name", [n for n, e in LOSSES.items() if not e.native_soft_targets])
def test_probability_targets_of_any_support(name):
    s, y = problem(6)
    smooth = 0.8 * F.one_hot(y, N_CLASSES).double() + 0.2 / N_CLASSES     # label smoothing: every class has mass
    crit = get_loss(name, reduction="none", **extra(name))
    twin = get_loss(name, reduction="none", **extra(name))
    expected = sum(smooth[:, j] * twin(s, torch.full_like(y, j)) for j in range(N_CLASSES)
                   ) if not LOSSES[name].stochastic else None
    out = crit(s, smooth)
    assert out.shape == (6,) and torch.isfinite(out).all()
    if expected is not None:
        torch.testing.assert_close(out, expected)
    with topk_nb.force_sync_free():                  # no support read back: every class is summed over
        again = get_loss(name, reduction="none", **extra(name))(s, smooth)
    if expected is not None:
        torch.testing.assert_close(again, expected)


@pytest.mark.parametrize("name", list(LOSSES))
def test_float32_result_under_autocast(name):
    s, y = problem(7, dtype=torch.float32)
    crit = get_loss(name, **extra(name))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = crit(s.bfloat16(), y)
    assert out.dtype == torch.float32 and torch.isfinite(out)
    assert crit(s.bfloat16(), y).dtype == torch.bfloat16              # without autocast: the scores' dtype


def test_top_level_api():
    from topk_nb import LOSSES as top_losses, SmoothSVM, get_loss as top_get_loss, macro_topk_accuracy, topk_accuracy
    assert top_losses is LOSSES and top_get_loss is get_loss and SmoothSVM is LOSSES["smooth_svm"].module
    assert callable(topk_accuracy) and callable(macro_topk_accuracy)


pytopk = pytest.importorskip("pytopk")


@pytest.mark.parametrize("k, epsilon, scale", [(1, 1.0, 50.0), (3, 0.1, 60.0), (2, 0.01, 1.0)])
def test_noised_imbalanced_matches_pytopk_on_the_same_noise(k, epsilon, scale):
    g = torch.Generator().manual_seed(k)
    n, batch, draws = 20, 64, 5
    s = torch.nn.functional.normalize(torch.randn(batch, n, generator=g), dim=1)   # cosine scores, as in the papers' runs
    y = torch.randint(0, n, (batch,), generator=g)
    counts = torch.randint(1, 500, (n,), generator=g)
    Z = torch.randn(batch, n, draws, generator=g)                                  # pytopk's layout (B, n, n_sample)
    theirs = pytopk.ImbalNoisedTopK(k=k, epsilon=epsilon, max_m=0.2, cls_num_list=counts.numpy(), scale=scale,
                                    n_sample=draws)
    ref = pytopk.functional.imbal_noised_topk_loss(s, y, k, theirs.m_list, epsilon, theirs._noised_topk, Z, scale)
    ours = topk_nb.NoisedImbal(class_counts=counts, k=k, epsilon=epsilon, max_m=0.2, scale=scale, n_samples=draws)
    torch.testing.assert_close(ours(s, y, noise=Z.permute(2, 0, 1)), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k, epsilon", [(1, 1.0), (4, 0.2)])
def test_noised_balanced_matches_pytopk_on_the_same_noise(k, epsilon):
    g = torch.Generator().manual_seed(10 + k)
    s, y = 3 * torch.randn(32, 15, generator=g), torch.randint(0, 15, (32,), generator=g)
    Z = torch.randn(32, 15, 6, generator=g)
    ref = pytopk.functional.bal_noised_topk_loss(s, y, k, epsilon, pytopk.noised_topk._noised_topk, Z)
    ours = topk_nb.NoisedBal(k=k, epsilon=epsilon, n_samples=6)
    torch.testing.assert_close(ours(s, y, noise=Z.permute(2, 0, 1)), ref, rtol=1e-5, atol=1e-5)


def test_default_scale_is_the_authors():
    assert topk_nb.NoisedImbal(class_counts=COUNTS).scale == 50.0


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("magnitude", [torch.finfo(torch.float32).max, 1e38, 1e30, 1e4])
def test_extreme_finite_scores_give_a_finite_loss_or_a_clear_error(name, magnitude):
    s = torch.tensor([[magnitude, -magnitude, 0.0, 1.0, 2.0], [-magnitude, magnitude, magnitude, 0.0, -1.0]])
    y = torch.tensor([1, 0])
    crit = get_loss(name, **({**extra(name), "class_counts": torch.arange(1, 6)} if LOSSES[name].needs_class_counts
                             else extra(name)), **({"k": 2} if "k" in LOSSES[name].defaults else {}))
    x = s.clone().requires_grad_()
    try:
        loss = crit(x, y)
    except ValueError as error:
        assert "overflows torch.float32" in str(error) and "rescale" in str(error)
        return
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all(), (name, loss, x.grad)


@pytest.mark.parametrize("name", list(LOSSES))
def test_label_smoothing_is_the_smoothed_target(name):
    s, y = problem(8)
    eps = 0.1
    smooth = (1 - eps) * F.one_hot(y, N_CLASSES).double() + eps / N_CLASSES
    crit = get_loss(name, label_smoothing=eps, reduction="none", **extra(name))
    twin = get_loss(name, reduction="none", **extra(name))
    out = crit(s, y)
    assert out.shape == (6,) and torch.isfinite(out).all()
    if not LOSSES[name].stochastic:          # the same draws cannot be replayed through two different roads
        torch.testing.assert_close(out, twin(s, smooth))
    if name == "ce":
        torch.testing.assert_close(out, F.cross_entropy(s, y, label_smoothing=eps, reduction="none"))


def built(name, **kw):
    "The registry loss `name` with k=2 where it takes k, on 5 classes."
    counts = {"class_counts": torch.arange(1, 6)} if LOSSES[name].needs_class_counts else {}
    return get_loss(name, **{**extra(name), **counts, **({"k": 2} if "k" in LOSSES[name].defaults else {}), **kw})


def same_as(ours, ref):
    "Equal shape and dtype, NaN where the reference is NaN, equal values elsewhere."
    assert ours.shape == ref.shape and ours.dtype == ref.dtype, (ours, ref)
    assert torch.equal(ours.isnan(), ref.isnan()) and torch.equal(ours.nan_to_num(), ref.nan_to_num()), (ours, ref)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_batch_as_in_cross_entropy(name, reduction):
    for s, y in [(torch.zeros(0, 5), torch.zeros(0, dtype=torch.long)),                # a rank or filter with no sample
                 (torch.zeros(3, 5, 0), torch.zeros(3, 0, dtype=torch.long))]:       # (B, n, d) with d = 0
        ref = nn.CrossEntropyLoss(reduction=reduction)(s, y)                         # NaN, 0, empty
        same_as(built(name, reduction=reduction)(s, y), ref)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_target_ignored_as_in_cross_entropy(name, reduction):
    s, y = 2.5 * torch.randn(4, 5, generator=torch.Generator().manual_seed(0)), torch.full((4,), -100)
    for kw in [{}, {"weight": torch.arange(1.0, 6.0)}, {"ignore_index": 3}]:
        yy = torch.full((4,), kw.get("ignore_index", -100))
        same_as(built(name, reduction=reduction, **kw)(s, yy), nn.CrossEntropyLoss(reduction=reduction, **kw)(s, yy))
    s4, y4 = torch.randn(2, 5, 3, 2), torch.full((2, 3, 2), -100)                     # segmentation-shaped
    same_as(built(name, reduction=reduction)(s4, y4), nn.CrossEntropyLoss(reduction=reduction)(s4, y4))


@pytest.mark.parametrize("name", list(LOSSES))
def test_float16_scores_give_the_float32_value_or_a_clear_error(name):
    g = torch.Generator().manual_seed(1)
    cases = [torch.tensor([[6e4, -6e4, 0.0, 0.0, 0.0]]), torch.tensor([[-6e4, 6e4, 1.0, 2.0, 3.0]]),
             torch.tensor([[3e4, -3e4, 0.0, 0.0, 0.0]]), 300 * torch.randn(4, 5, generator=g), torch.randn(4, 5, generator=g)]
    for s in cases:
        s16 = s.half()
        y = torch.arange(s.shape[0]) % 5 if s.shape[0] > 1 else torch.tensor([1])
        for reduction in ["mean", "sum", "none"]:
            ref = built(name, reduction=reduction)(s16.float(), y)                     # the same scores, float32
            try:
                out = built(name, reduction=reduction)(s16.requires_grad_(), y)
            except ValueError as error:                                               # only when float16 cannot hold it
                assert (ref.abs() > torch.finfo(torch.float16).max).any(), (name, s, reduction, ref)
                assert "beyond torch.float16's largest value" in str(error)
                continue
            assert out.dtype == torch.float16 and torch.isfinite(out).all(), (name, s, reduction, out)
            torch.testing.assert_close(out, ref.half(), rtol=0, atol=0)                # rounded once, from the float32 value


@pytest.mark.parametrize("name", list(LOSSES))
def test_integer_scores_are_refused(name):
    y = torch.tensor([1, 2, 3, 0])
    for s in [torch.randint(0, 5, (4, 5)), torch.randint(0, 5, (4, 5), dtype=torch.int32)]:
        with pytest.raises(TypeError, match=r"^scores must be a floating tensor \(float16, bfloat16, float32 or float64\), got torch.int"):
            built(name)(s, y)


@pytest.mark.parametrize("name", list(LOSSES))
def test_errors_name_the_argument(name):
    s = torch.randn(4, 5)
    with pytest.raises(TypeError, match=r"^target must hold integer class indices \(int64\) of shape \(4,\)"):
        built(name)(s, torch.tensor([1.0, 2.0, 3.0, 0.0]))                           # labels stored as floats
    with pytest.raises(ValueError, match=r"^weight must have one entry per class: the scores have 5 classes, weight has 7$"):
        built(name, weight=torch.ones(7))(s, torch.tensor([1, 2, 3, 0]))
    if "k" in LOSSES[name].defaults:
        with pytest.raises(ValueError, match=r"^k must be an integer in \[1, 4\] for scores with 5 classes"):
            built(name, k=5)(s, torch.tensor([1, 2, 3, 0]))


@pytest.mark.parametrize("make", [
    lambda m, c: m.BalNoisedTopK(2, 0.5),
    lambda m, c: m.BalNoisedTopK(k=4, epsilon=1.0, n_sample=8),
    lambda m, c: m.ImbalNoisedTopK(3, 0.2, 0.3, c.tolist()),
    lambda m, c: m.ImbalNoisedTopK(k=1, epsilon=0.05, max_m=0.2, cls_num_list=c.numpy(), scale=2, n_sample=3)])
def test_pytopk_spellings_give_pytopk_numbers_with_the_same_seed(make):
    g = torch.Generator().manual_seed(4)
    s, y, counts = 2 * torch.randn(32, 12, generator=g), torch.randint(0, 12, (32,), generator=g), torch.randint(1, 400, (12,), generator=g)
    results = []
    for package in (pytopk, topk_nb):                          # one import line changed, nothing else
        x = s.clone().requires_grad_()
        torch.manual_seed(11)
        loss = make(package, counts)(x, y)
        loss.backward()
        results.append((loss.detach(), x.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [dict(k=1), dict(k=3, epsilon=0.2, n_sample=6), dict(k=2, dim=0), dict(k=2, epsilon=0.0, dim=1)])
def test_noised_topk_value_as_pytopk(kw):
    x = torch.randn(5, 7, 4, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3); ref = pytopk.NoisedTopK(**kw)(x)
    torch.manual_seed(3); ours = topk_nb.NoisedTopK(**kw)(x)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)


def test_peer_keywords_get_a_hint_and_smooth_topk_alpha_none_is_one():
    with pytest.raises(TypeError, match=r"NoisedBal takes no argument 'n_sample' \(did you mean n_samples=\?\)"):
        topk_nb.NoisedBal(k=2, n_sample=5)
    with pytest.raises(TypeError, match=r"did you mean class_counts=\?"):
        topk_nb.NoisedImbal(cls_num_list=COUNTS)
    s, y = problem(3)
    ref = topk_nb.smooth_svm(s, y, k=3, tau=0.5, alpha=1.0)             # smooth-topk documents alpha=None as 1
    torch.testing.assert_close(topk_nb.SmoothTopkSVM(k=3, tau=0.5, alpha=None)(s, y), ref)
    torch.testing.assert_close(topk_nb.SmoothSVM(k=3, tau=0.5, alpha=None)(s, y), ref)


def test_import_star_docstring_and_help_text():
    namespace = {}
    exec("from topk_nb import *", namespace)
    for name in ["SmoothSVM", "get_loss", "LOSSES", "topk_accuracy", "BalNoisedTopK", "ImbalNoisedTopK", "NoisedTopK", "CE"]:
        assert namespace[name] is getattr(topk_nb, name), name
    assert all(hasattr(topk_nb, name) for name in topk_nb.__all__)
    assert topk_nb.__doc__ and "nn.CrossEntropyLoss" in topk_nb.__doc__
    import inspect
    for name, entry in LOSSES.items():
        params = inspect.signature(entry.module.__init__).parameters
        assert {"weight", "ignore_index", "label_smoothing", "reduction"} <= set(params), name
        assert "conventions" not in params, name
        doc = entry.module.__init__.__doc__
        assert "ignore_index=-100" in doc and "Initialize internal Module state" not in doc, name
        assert "scores" in entry.module.forward.__doc__ and "see the section above" not in entry.module.forward.__doc__, name


def test_topk_accuracy_takes_k_and_still_ks_with_a_warning():
    s, y = problem(5)
    ref = {k: (s.topk(k, dim=1).indices == y[:, None]).any(1).double().mean().item() for k in (1, 3)}
    assert topk_nb.topk_accuracy(s, y, k=(1, 3)) == pytest.approx(ref)
    with pytest.warns(FutureWarning, match="pass k="):
        assert topk_nb.topk_accuracy(s, y, ks=(1, 3)) == pytest.approx(ref)


# ---- no silent difference: the authors' class names, probability targets, attributes, meta, double backward

@pytest.mark.parametrize("make, ours", [
    (lambda **kw: topk_nb.BalNoisedTopK(3, 0.0, **kw), lambda **kw: topk_nb.NoisedBal(k=3, epsilon=0.0, **kw)),
    (lambda **kw: topk_nb.ImbalNoisedTopK(3, 0.0, 0.3, COUNTS, scale=2.0, **kw),
     lambda **kw: topk_nb.NoisedImbal(class_counts=COUNTS, k=3, epsilon=0.0, max_m=0.3, scale=2.0, **kw)),
])
def test_pytopk_class_names_keep_the_conventions(make, ours):
    # epsilon = 0: no noise, so the two spellings must agree exactly under every convention
    s, y = problem(4, batch=8)
    y[[1, 5]] = -100
    w = torch.linspace(0.2, 2.0, N_CLASSES)
    probs = torch.softmax(torch.randn(8, N_CLASSES, dtype=torch.float64), 1)
    cases = [({"weight": w}, s, y.clamp_min(0)), ({"ignore_index": 3}, s, y.clamp_min(0)), ({}, s, y),
             ({"weight": w, "reduction": "sum"}, s, y), ({"label_smoothing": 0.2}, s, y.clamp_min(0)), ({}, s, probs),
             ({}, s[0], y.clamp_min(0)[0]), ({"reduction": "none"}, s.reshape(2, 4, N_CLASSES).transpose(1, 2), y.clamp_min(0).reshape(2, 4))]
    for kw, scores, target in cases:
        torch.testing.assert_close(make(**kw)(scores, target), ours(**kw)(scores, target))
    assert not torch.allclose(make(weight=w)(s, y.clamp_min(0)), make()(s, y.clamp_min(0)))   # the weight takes effect


def test_pytopk_class_names_weigh_the_same_noise_as_pytopk():
    # with noise, the weighted pytopk spelling is pytopk's per-sample loss on the same draws, weighted as nn does
    import pytopk
    s, y = problem(5, batch=8, dtype=torch.float32)
    w = torch.linspace(0.2, 2.0, N_CLASSES)
    torch.manual_seed(9); ref = pytopk.BalNoisedTopK(2, 0.5)
    torch.manual_seed(9); z = torch.randn(*s.shape, 5)
    ours = topk_nb.BalNoisedTopK(2, 0.5, reduction="none")(s, y, z.permute(2, 0, 1))
    weighted = topk_nb.BalNoisedTopK(2, 0.5, weight=w)(s, y, z.permute(2, 0, 1))
    torch.testing.assert_close(weighted, (w[y] * ours).sum() / w[y].sum())
    torch.manual_seed(9); theirs = ref(s, y)
    torch.testing.assert_close(ours.mean(), theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", [n for n in LOSSES if n != "ce"])
def test_label_smoothing_applies_to_probability_targets(name):
    # nn.CrossEntropyLoss smooths probability targets too: (1 - eps) t + eps / n
    s, y = problem(6)
    probs = torch.softmax(torch.randn(6, N_CLASSES, dtype=torch.float64, generator=torch.Generator().manual_seed(1)), 1)
    smoothed = 0.7 * probs + 0.3 / N_CLASSES
    a = get_loss(name, label_smoothing=0.3, **extra(name))(s, probs)
    b = get_loss(name, **extra(name))(s, smoothed)
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, get_loss(name, **extra(name))(s, probs))


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("attribute, value, message", [
    ("reduction", "avg", "reduction must be one of"), ("label_smoothing", 2, "label_smoothing must be a finite number in [0.0, 1.0]"),
    ("ignore_index", 1.5, "ignore_index must be an integer"), ("weight", torch.tensor([-1.0, 2.0]), "weight must be a 1-D tensor"),
    ("max_support", 0, "max_support must be an integer in [1, inf]"),
])
def test_conventions_are_checked_when_set(name, attribute, value, message):
    crit = get_loss(name, **extra(name))
    before = getattr(crit, attribute)
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace("]", r"\]")):
        setattr(crit, attribute, value)
    assert getattr(crit, attribute) is before or torch.equal(getattr(crit, attribute), before)


@pytest.mark.parametrize("name", list(LOSSES))
def test_hyper_parameters_are_checked_when_set(name):
    crit = get_loss(name, **extra(name))
    for key in CHANGES[name]:
        bad = -1 if key != "label_smoothing" else 2.0
        with pytest.raises((ValueError, TypeError), match=key):
            setattr(crit, key, bad)


@pytest.mark.parametrize("name", list(LOSSES))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_meta_scores_give_a_meta_loss_as_cross_entropy(name, reduction):
    s, y = torch.empty(4, N_CLASSES, 3, device="meta"), torch.zeros(4, 3, dtype=torch.long, device="meta")
    ref = nn.CrossEntropyLoss(reduction=reduction)(s, y)
    out = get_loss(name, reduction=reduction, **extra(name))(s, y)
    assert out.device.type == "meta" and out.shape == ref.shape and out.dtype == ref.dtype


@pytest.mark.parametrize("name", list(LOSSES))
def test_double_backward_matches_autograd_of_the_gradient(name):
    # a Hessian-vector product through every loss: finite differences of the gradient along v (float64)
    s, y = problem(8)
    crit = get_loss(name, **extra(name))
    v = torch.randn_like(s)

    def grad_at(x):
        if LOSSES[name].stochastic: crit.generator = torch.Generator().manual_seed(3)
        x = x.detach().requires_grad_()
        (g,) = torch.autograd.grad(crit(x, y), x, create_graph=True)
        return x, g

    x, g = grad_at(s)
    (hv,) = torch.autograd.grad((g * v).sum(), x, allow_unused=True)
    hv = torch.zeros_like(s) if hv is None else hv
    h = 1e-6
    fd = (grad_at(s + h * v)[1] - grad_at(s - h * v)[1]) / (2 * h)
    torch.testing.assert_close(hv, fd.detach(), rtol=1e-4, atol=1e-5)


def test_smooth_topk_positional_signature_and_state():
    s, y = problem(9)
    crit = topk_nb.SmoothTopkSVM(N_CLASSES, None, 0.5, 3)          # smooth-topk's order: n_classes, alpha, tau, k
    torch.testing.assert_close(crit(s, y), topk_nb.SmoothSVM(k=3, tau=0.5, alpha=1.0)(s, y))
    crit.load_state_dict({"labels": torch.arange(N_CLASSES)})    # smooth-topk's state: its labels buffer
    with pytest.raises(ValueError, match="n_classes=8"):
        topk_nb.SmoothTopkSVM(N_CLASSES)(torch.randn(2, 5), torch.tensor([0, 1]))
    import inspect
    assert list(inspect.signature(topk_nb.SmoothTopkSVM).parameters)[:4] == ["n_classes", "alpha", "tau", "k"]
    assert list(inspect.signature(topk_nb.BalNoisedTopK).parameters)[:3] == ["k", "epsilon", "n_sample"]


def test_pytopk_imbalanced_state_dict_loads():
    import pytopk
    theirs = pytopk.ImbalNoisedTopK(2, 0.1, 0.3, COUNTS.tolist())
    ours = topk_nb.ImbalNoisedTopK(2, 0.1, 0.2, [1] * N_CLASSES)
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours.margins.float(), theirs.m_list)
    s, y = problem(10, dtype=torch.float32)
    torch.manual_seed(4); a = theirs(s, y)
    torch.manual_seed(4); b = ours(s, y)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", list(LOSSES))
def test_masked_classes_at_minus_inf_as_in_cross_entropy(name):
    # -inf logits (masked classes) are accepted where the loss is defined: the value and gradient are the limit,
    # equal to those with the masked scores far below the rest (float64); a masked target is refused naming the way out
    g = torch.Generator().manual_seed(11)
    s = 2 * torch.randn(6, 12, generator=g, dtype=torch.float64)
    y = torch.randint(0, 8, (6,), generator=g)
    mask = torch.zeros_like(s, dtype=torch.bool); mask[:, 8:] = True; mask[0, 7] = True; y[0] = 1
    kw = {"class_counts": torch.arange(1, 13) * 5} if LOSSES[name].needs_class_counts else {}
    values, grads = [], []
    for fill in (float("-inf"), -1e4):
        if LOSSES[name].stochastic: kw["generator"] = torch.Generator().manual_seed(0)
        x = s.masked_fill(mask, fill).requires_grad_()
        loss = get_loss(name, **kw)(x, y)
        loss.backward()
        values.append(loss.detach()); grads.append(x.grad)
    torch.testing.assert_close(values[0], values[1]); torch.testing.assert_close(grads[0], grads[1])
    assert torch.isfinite(grads[0]).all()
    y[0] = 9                                                             # a masked target: the loss is infinite
    if LOSSES[name].stochastic: kw["generator"] = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="check_finite=False"):
        get_loss(name, **kw)(s.masked_fill(mask, float("-inf")), y)
    with pytest.raises(ValueError, match=r"NaN or \+inf"):
        get_loss(name, **kw)(s.masked_fill(mask, float("inf")), y)


@pytest.mark.parametrize("name", list(LOSSES))
def test_torch_func_grad_matches_autograd(name):
    # torch.func.grad of every registry loss is autograd's gradient (stochastic losses: the same draws, which the
    # sync-free path makes dense, as it does under a transform)
    from topk_nb.base.core import force_sync_free
    s, y = problem(12)
    y[2] = -100
    kw = {**extra(name), "weight": torch.linspace(0.5, 2.0, N_CLASSES)}
    crit = get_loss(name, **kw)

    def reseed():
        if LOSSES[name].stochastic: crit.generator = torch.Generator().manual_seed(3)

    reseed()
    g_func = torch.func.grad(lambda x: crit(x, y))(s)
    reseed()
    x = s.clone().requires_grad_()
    with force_sync_free():
        crit(x, y).backward()
    torch.testing.assert_close(g_func, x.grad)


@pytest.mark.parametrize("name", list(LOSSES))
def test_torch_func_vmap_matches_the_batch(name):
    # vmap over samples, each (1, n) with its label, gives the per-sample losses of the whole batch (noised losses
    # without noise, epsilon = 0, so that both sides draw nothing); the gradient of each sample's loss too
    s, y = problem(13)
    kw = {**extra(name), **({"epsilon": 0.0} if LOSSES[name].stochastic else {})}
    crit = get_loss(name, reduction="none", **kw)
    per_sample = torch.func.vmap(lambda x, t: crit(x[None], t[None])[0])(s, y)
    torch.testing.assert_close(per_sample, crit(s, y))
    grads = torch.func.vmap(torch.func.grad(lambda x, t: crit(x[None], t[None])[0]))(s, y)
    x = s.clone().requires_grad_()
    crit(x, y).sum().backward()
    torch.testing.assert_close(grads, x.grad)


def test_vmap_still_checks_the_labels():
    crit = topk_nb.SmoothSVM(k=3)
    s, y = problem(14)
    y[1] = N_CLASSES                                                     # out of range
    with pytest.raises(RuntimeError, match=r"target must hold class indices in \[0, 7\]"):
        torch.func.vmap(lambda x, t: crit(x[None], t[None]))(s, y)


def test_noised_losses_under_vmap_draw_as_vmap_says():
    s, y = problem(15)
    crit = topk_nb.NoisedBal(k=2, reduction="none")
    with pytest.raises(RuntimeError, match="randomness"):                # PyTorch's own rule for random draws
        torch.func.vmap(lambda x, t: crit(x[None], t[None]))(s, y)
    out = torch.func.vmap(lambda x, t: crit(x[None], t[None]), randomness="different")(s, y)
    assert out.shape == (6, 1) and torch.isfinite(out).all()


@pytest.mark.parametrize("module", [e.module for e in LOSSES.values()]
                         + [topk_nb.SmoothTopkSVM, topk_nb.BalNoisedTopK, topk_nb.ImbalNoisedTopK])
def test_help_explains_every_argument_on_its_first_screen(module):
    import inspect
    import pydoc
    from topk_nb.base.core import ARGUMENTS, CONVENTIONS
    first_screen = "\n".join(pydoc.render_doc(module, renderer=pydoc.plaintext).splitlines()[:40])
    for name in inspect.signature(module).parameters:
        meanings = [m for m in (ARGUMENTS.get(name), CONVENTIONS.get(name)) if m]
        assert meanings, f"{module.__name__}: {name} is not explained"
        assert any(f"{name}" in first_screen and m[:40] in first_screen for m in meanings), (module.__name__, name)
