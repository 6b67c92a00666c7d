import pytest
import torch
import torch.nn.functional as F

from topk_nb.loss.baselines import ce
from topk_nb.base.core import target_rank
from topk_nb.loss.registry import LOSSES, TopkMixture, get_loss, loss_table
from topk_nb.loss.noised import noised_bal
from topk_nb.loss.svm import smooth_svm, topk_hinge

NAMES = ["ce", "focal", "ldam", "topk_hinge", "cvx_hinge", "cal_hinge", "smooth_svm", "noised_bal", "noised_imbal",
         "topk_grouping", "topk_transition"]


def problem(seed=0, batch=12, n=8):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(batch, n, generator=g, dtype=torch.float64) * 2
    y = torch.randint(0, n, (batch,), generator=g)
    return s, y


def extra(name, n=8, seed=1):
    kw = {}
    if LOSSES[name].needs_class_counts: kw["class_counts"] = torch.arange(1, n + 1) * 5
    if LOSSES[name].stochastic: kw["generator"] = torch.Generator().manual_seed(seed)
    return kw


def test_registry_names_are_the_documented_ones():
    assert list(LOSSES) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_every_loss_builds_with_defaults_and_matches_its_function(name):
    entry = LOSSES[name]
    s, y = problem()
    crit = get_loss(name, reduction="none", **extra(name))
    value = crit(s, y)
    assert value.shape == (12,) and torch.isfinite(value).all() and (value >= 0).all()
    torch.testing.assert_close(value, entry.function(s, y, **entry.defaults, reduction="none", **extra(name)))
    assert type(crit) is entry.module                            # the module itself: attributes read and write through


@pytest.mark.parametrize("name", NAMES)
def test_every_loss_takes_mixup_targets(name):
    s, y = problem(2)
    y2 = (y + 1) % 8
    mixed = 0.6 * F.one_hot(y, 8).double() + 0.4 * F.one_hot(y2, 8).double()
    crit = get_loss(name, reduction="none", **extra(name))
    twin = get_loss(name, reduction="none", **extra(name))    # same seed: the same noise draws, in the same order
    torch.testing.assert_close(crit(s, mixed), 0.6 * twin(s, y) + 0.4 * twin(s, y2))


def test_registry_module_reduction_and_indices():
    s, y = problem(3)
    crit = get_loss("smooth_svm", k=3, tau=0.5)
    assert crit.reduction == "mean"
    torch.testing.assert_close(crit(s, y), smooth_svm(s, y, 3, 0.5))
    torch.testing.assert_close(get_loss("topk_hinge", k=2, reduction="sum")(s, y), topk_hinge(s, y, 2, reduction="sum"))


def test_stochastic_losses_reproducible_with_generator():
    s, y = problem(4)
    a = get_loss("noised_bal", generator=torch.Generator().manual_seed(9))(s, y)
    b = noised_bal(s, y, generator=torch.Generator().manual_seed(9))
    torch.testing.assert_close(a, b)


def test_registry_errors():
    with pytest.raises(ValueError, match="unknown loss 'cross_entropyy'; registered losses: ce, focal"):
        get_loss("cross_entropyy")
    with pytest.raises(ValueError, match="does not take temperature; it accepts: alpha"):
        get_loss("smooth_svm", temperature=0.1)
    with pytest.raises(ValueError, match="does not take generator"):
        get_loss("smooth_svm", generator=torch.Generator())
    with pytest.raises(ValueError, match="needs class_counts"):
        get_loss("noised_imbal")
    with pytest.raises(ValueError, match="epsilon"):
        get_loss("noised_bal", epsilon=-1.0)
    with pytest.raises(ValueError, match="n_samples"):
        get_loss("noised_bal", n_samples=0)


def test_mixture_over_k():
    s, y = problem(5)
    mix = get_loss("smooth_svm", k={1: 2.0, 3: 2.0, 5: 4.0}, tau=0.3, reduction="none")
    assert mix.ks == (1, 3, 5) and mix.weights == pytest.approx((0.25, 0.25, 0.5))
    expected = sum(w * smooth_svm(s, y, k, 0.3, reduction="none") for k, w in zip((1, 3, 5), mix.weights))
    torch.testing.assert_close(mix(s, y), expected)
    point = TopkMixture("topk_grouping", [0, 0, 1])
    torch.testing.assert_close(point(s, y), get_loss("topk_grouping", k=3)(s, y))
    bound = get_loss("cvx_hinge", k={1: 0.5, 4: 0.5}, reduction="none")(s, y)
    errors = 0.5 * (target_rank(s, y) >= 1).double() + 0.5 * (target_rank(s, y) >= 4).double()
    assert (bound >= errors - 1e-12).all()
    with pytest.raises(ValueError, match="needs a registered top-k loss"):
        TopkMixture("focal", [1.0])
    with pytest.raises(ValueError, match="not all zero"):
        TopkMixture("cal_hinge", [0.0, 0.0])
    with pytest.raises(ValueError, match="k must be"):
        get_loss("cal_hinge", k={8: 1.0})(s, y)


def test_table_lists_every_loss():
    table = loss_table()
    for name in NAMES:
        assert f"`{name}`" in table
    assert "Sawada eq. (5)" in table and "Berrada 2018 eq. (9)-(10)" in table and r"y \in A} e^" in table
    torch.testing.assert_close(get_loss("ce")(*problem(6)), ce(*problem(6)))


def test_names_line_up():
    # registry name = function name; module = the same words in CamelCase; all three at the top level
    import topk_nb
    acronyms = {"ce": "CE", "ldam": "LDAM", "svm": "SVM"}
    for name, entry in LOSSES.items():
        assert entry.function.__name__ == name
        assert entry.module.__name__ == "".join(acronyms.get(w, w.capitalize()) for w in name.split("_"))
        assert getattr(topk_nb, name) is entry.function and getattr(topk_nb, entry.module.__name__) is entry.module
    # the earlier names are the same objects
    assert issubclass(topk_nb.SmoothTopkSVM, topk_nb.SmoothSVM) and topk_nb.smooth_topk_svm is topk_nb.smooth_svm   # smooth-topk's signature
    assert topk_nb.NoisedImbalTopK is topk_nb.NoisedImbal and topk_nb.CrossEntropy is topk_nb.CE


@pytest.mark.parametrize("name", [n for n in NAMES if "k" in LOSSES[n].defaults])
@pytest.mark.parametrize("conventions", [{"ignore_index": -100}, {"weight": "w"}, {"weight": "w", "ignore_index": 3}])
def test_mixture_averages_as_its_losses_do(name, conventions):
    # a mixture of means over the counted, class-weighted samples equals the same mixture of the modules by hand
    s, y = problem(7)
    y[[1, 4]] = -100 if conventions.get("ignore_index") == -100 else y[[1, 4]]
    kw = {**conventions, **({"weight": torch.linspace(0.5, 2.0, 8)} if "weight" in conventions else {})}
    for reduction in ("mean", "sum", "none"):
        mix = get_loss(name, k={1: 0.25, 3: 0.75}, reduction=reduction, **kw, **extra(name))
        shared = extra(name)                     # the noised losses: one generator, drawn from by k = 1, then k = 3
        by_hand = (0.25 * get_loss(name, k=1, reduction=reduction, **kw, **shared)(s, y)
                   + 0.75 * get_loss(name, k=3, reduction=reduction, **kw, **shared)(s, y))
        torch.testing.assert_close(mix(s, y), by_hand)



@pytest.mark.parametrize("name", NAMES)
def test_a_module_shows_every_setting_it_was_given(name):
    "print(module) shows each argument of its own with the value it holds, and the conventions only where they differ from nn.CrossEntropyLoss's defaults: one function for every loss and fused head, so no module leaves a setting out."
    import inspect, re
    from topk_nb.base.core import CONVENTIONS
    from topk_nb.loss.fused import FusedLinearNoisedBal, FusedLinearNoisedImbal, FusedLinearSmoothSVM
    kw = {"class_counts": torch.arange(1, 9)} if LOSSES[name].needs_class_counts else {}
    fused = {"smooth_svm": FusedLinearSmoothSVM, "noised_bal": FusedLinearNoisedBal, "noised_imbal": FusedLinearNoisedImbal}
    given = dict(reduction="sum", ignore_index=3, weight=torch.ones(8))
    for make in [LOSSES[name].module] + ([fused[name]] if name in fused else []):
        plain, configured = repr(make(**kw)), repr(make(**kw, **given))
        own = [p.name for p in inspect.signature(make.__init__).parameters.values()
               if p.name not in ("self", *CONVENTIONS) and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        shows = lambda arg, text: re.search(rf"\b{arg}=", text) is not None
        assert all(shows(arg, plain) for arg in own), (own, plain)                           # every own argument
        assert not any(shows(arg, plain) for arg in CONVENTIONS), plain                      # defaults: not shown
        assert "reduction='sum'" in configured and "ignore_index=3" in configured and "weight=<tensor (8,)>" in configured, configured


def test_the_authors_signatures_show_their_own_names():
    "The classes that take an authors' package's arguments show them under the authors' names."
    from topk_nb.loss.noised import BalNoisedTopK, ImbalNoisedTopK, NoisedTopK
    from topk_nb.loss.svm import SmoothTopkSVM
    assert repr(SmoothTopkSVM(10)) == "SmoothTopkSVM(n_classes=10, alpha=1.0, tau=1.0, k=5, hard_switch=True)"
    assert repr(BalNoisedTopK(5, 0.1)) == "BalNoisedTopK(k=5, epsilon=0.1, n_sample=5, generator=None)"
    shown = repr(ImbalNoisedTopK(5, 0.1, 0.5, [3, 4, 5, 6, 7, 8, 9]))
    assert shown.startswith("ImbalNoisedTopK(k=5, epsilon=0.1, max_m=0.5, cls_num_list=<tensor (7,)>, scale=50"), shown
    assert repr(NoisedTopK(3)) == "NoisedTopK(k=3, epsilon=1.0, n_sample=5, dim=-1, generator=None)"
