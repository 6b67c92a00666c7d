"""Validation helpers and accuracy metrics of topk_nb.base.core against direct readings of their definitions."""
from fractions import Fraction

import pytest
import torch
from hypothesis import given, strategies as st

from topk_nb.base.core import (brute_esp, brute_log_esp, check_int, check_real, check_scores, check_target,
                          macro_topk_accuracy, target_rank, topk_accuracy, topk_correct)


@st.composite
def scored_batches(draw):
    "Scores on a coarse grid (so ties happen), labels, and a set of ks."
    batch = draw(st.integers(1, 40))
    n = draw(st.integers(1, 12))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    scores = torch.randint(-3, 4, (batch, n), generator=g).double() / 2
    target = torch.randint(0, n, (batch,), generator=g)
    ks = draw(st.lists(st.integers(1, n), min_size=1, max_size=4))
    return scores, target, ks


def reference_rank(scores, target, pessimistic):
    out = []
    for row, y in zip(scores.tolist(), target.tolist()):
        above = sorted((v for i, v in enumerate(row) if i != y), reverse=True)
        out.append(sum(v > row[y] or (pessimistic and v == row[y]) for v in above))
    return torch.tensor(out)


@given(scored_batches(), st.sampled_from(["pessimistic", "optimistic"]))
def test_topk_metrics_match_definitions(data, ties):
    scores, target, ks = data
    rank = reference_rank(scores, target, ties == "pessimistic")
    assert torch.equal(target_rank(scores, target, ties), rank)
    correct = topk_correct(scores, target, ks, ties)
    assert correct.shape == (len(ks), len(target))
    acc = topk_accuracy(scores, target, ks, ties)
    macro = macro_topk_accuracy(scores, target, ks, ties)
    for k in ks:
        hits = rank < k
        assert acc[k] == pytest.approx(hits.double().mean().item(), abs=1e-6)
        classes = target.unique().tolist()
        per_class = [hits[target == c].double().mean().item() for c in classes]
        assert macro[k] == pytest.approx(sum(per_class) / len(per_class), abs=1e-6)


def test_accuracy_is_monotone_in_k_and_complete_at_n():
    g = torch.Generator().manual_seed(0)
    s, y = torch.randn(100, 10, generator=g), torch.randint(0, 10, (100,), generator=g)
    acc = topk_accuracy(s, y, range(1, 11))
    assert all(acc[k] <= acc[k + 1] for k in range(1, 10))
    assert acc[10] == 1.0


def test_macro_accuracy_weighs_classes_equally():
    # class 0: 3 samples all right; class 1: one sample, wrong -> macro 0.5, micro 0.75
    scores = torch.tensor([[2.0, 0.0], [2.0, 0.0], [2.0, 0.0], [2.0, 0.0]])
    target = torch.tensor([0, 0, 0, 1])
    assert topk_accuracy(scores, target, 1) == {1: 0.75}
    assert macro_topk_accuracy(scores, target, 1) == {1: 0.5}


@pytest.mark.parametrize("call, message", [
    (lambda: check_int(-1, "k", 0, 5), "k must be an integer in [0, 5], got -1"),
    (lambda: check_int(1.5, "k"), "k must be an integer, got float"),
    (lambda: check_int(True, "k"), "k must be an integer, got bool"),
    (lambda: check_real(0.0, "tau", 0.0, lo_open=True), "tau must be a finite number in (0.0, inf]"),
    (lambda: check_real(float("nan"), "epsilon", 0.0), "epsilon must be a finite number in [0.0, inf]"),
    (lambda: check_scores(torch.zeros(3)), "scores must have shape (B, n)"),
    (lambda: check_scores(torch.zeros(3, 4, dtype=torch.int32)), "scores must be a floating tensor"),
    (lambda: check_scores(torch.tensor([[0.0, float("nan")]])), "scores must be finite"),
    (lambda: check_target(torch.tensor([0, 4]), 4, 2), "target must hold class indices in [0, 3]"),
    (lambda: check_target(torch.tensor([[0, 1]]), 4, 2), "target must have shape (2,)"),
    (lambda: check_target(torch.tensor([0.0, 1.0]), 4, 2), "target must hold integer class indices"),
    (lambda: topk_accuracy(torch.zeros(2, 3), torch.tensor([0, 1]), 4), "each k must be an integer in [1, 3]"),
])
def test_bad_input_messages(call, message):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert message in str(info.value)


@given(st.lists(st.fractions(min_value=Fraction(-5), max_value=Fraction(5), max_denominator=7), min_size=1, max_size=7))
def test_brute_esp_is_the_coefficients_of_the_product(e):
    # prod (1 + e_i X) expanded exactly; its coefficient j is sigma_j (chapter 01, Vieta)
    coeffs = [Fraction(1)]
    for v in e:
        coeffs = [a + v * b for a, b in zip(coeffs + [Fraction(0)], [Fraction(0)] + coeffs)]
    assert [brute_esp(e, j) for j in range(len(e) + 1)] == coeffs


def test_brute_log_esp_matches_exact_values():
    e = [Fraction(1, 2), Fraction(3), Fraction(5, 4), Fraction(2)]
    x = torch.tensor([float(v) for v in e], dtype=torch.float64).log()
    exact = torch.tensor([float(brute_esp(e, j)) for j in range(5)], dtype=torch.float64).log()
    torch.testing.assert_close(brute_log_esp(x, 4), exact, rtol=1e-14, atol=1e-14)


# torchmetrics is the field's reference for these metrics; where the semantics chosen here differ (ties, NaN
# rows, a predicted class absent from the targets at k = 1), the tests say how and check the difference exactly.
from torchmetrics.classification import MulticlassAccuracy   # a test dependency (the dev install)


def _tm(scores, target, k, average):
    return MulticlassAccuracy(scores.shape[1], top_k=k, average=average)(scores.float(), target).item()


@pytest.mark.parametrize("seed", range(5))
def test_metrics_agree_with_torchmetrics_on_random_scores(seed):
    g = torch.Generator().manual_seed(seed)
    n = 12
    scores = torch.randn(200, n, generator=g)
    target = torch.cat([torch.arange(n), torch.randint(0, n, (188,), generator=g)])     # every class present
    for k in (1, 3, 5):
        assert topk_accuracy(scores, target, k)[k] == pytest.approx(_tm(scores, target, k, "micro"), abs=1e-6)
        assert macro_topk_accuracy(scores, target, k)[k] == pytest.approx(_tm(scores, target, k, "macro"), abs=1e-6)


def test_expected_ties_are_torchmetrics_averaged_over_the_orders_of_the_classes():
    # torchmetrics breaks ties by position; over every permutation of the columns, each order of tied classes is
    # equally likely, so the mean of its accuracy over the permutations is the random tie-break's expectation
    import itertools
    g = torch.Generator().manual_seed(0)
    n = 5
    scores = torch.randint(0, 3, (40, n), generator=g).float()                          # many ties
    target = torch.randint(0, n, (40,), generator=g)
    perms = list(itertools.permutations(range(n)))
    for k in (1, 2, 3):
        ref = 0.0
        for p in perms:
            p = torch.tensor(p)                                                     # column j goes to p[j]
            moved = torch.empty_like(scores); moved[:, p] = scores
            ref += _tm(moved, p[target], k, "micro")
        assert topk_accuracy(scores, target, k)[k] == pytest.approx(ref / len(perms), abs=1e-6)
    # the constant model scores chance
    assert topk_accuracy(torch.zeros(6, n), torch.arange(6) % n, 2)[2] == pytest.approx(2 / n)


def test_nan_rows_are_misses_and_the_rest_agree_with_torchmetrics():
    g = torch.Generator().manual_seed(1)
    scores = torch.randn(30, 6, generator=g)
    target = torch.randint(0, 6, (30,), generator=g)
    scores[[2, 7, 11], target[[2, 7, 11]]] = float("nan")                                # NaN as the target's own score
    scores[[4, 9], 0] = float("nan")
    finite = ~scores.isnan().any(1)
    for k in (1, 2, 5):
        ours = topk_accuracy(scores, target, k)[k]
        assert ours * 30 == pytest.approx(_tm(scores[finite], target[finite], k, "micro") * int(finite.sum()), abs=1e-5)
        assert topk_correct(scores, target, k)[0][~finite].eq(0).all()
    assert topk_accuracy(torch.tensor([[float("nan"), 0.0], [0.0, 1.0]]), torch.tensor([0, 0]), 1) == {1: 0.0}


def test_macro_leaves_out_a_predicted_class_absent_from_the_targets():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(12, 4, generator=g)
    target = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])                          # class 3 absent
    scores[:3, 3] = 10.0                                                              # but predicted
    per_class = MulticlassAccuracy(4, top_k=1, average="none")(scores, target)[:3]
    assert macro_topk_accuracy(scores, target, 1)[1] == pytest.approx(per_class.mean().item(), abs=1e-6)
    # torchmetrics counts class 3 as 0 at top_k = 1 (mean over 4 classes) and leaves it out at top_k > 1
    assert _tm(scores, target, 1, "macro") == pytest.approx(per_class.sum().item() / 4, abs=1e-6)
    assert macro_topk_accuracy(scores, target, 2)[2] == pytest.approx(_tm(scores, target, 2, "macro"), abs=1e-6)


@pytest.mark.parametrize("call, message", [
    (lambda: topk_accuracy(torch.randn(4, 5), torch.tensor([0, 1, 2, 3]), 2.0), "k must be an integer, got float"),
    (lambda: topk_accuracy(torch.randn(5), torch.tensor(1), 1), "scores must have shape (B, n)"),
    (lambda: macro_topk_accuracy(torch.randn(5), torch.tensor(1), 1), "scores must have shape (B, n)"),
    (lambda: topk_accuracy(torch.randn(4, 5, device="meta"), torch.zeros(4, dtype=torch.long, device="meta"), 1),
     "cannot be on the meta device"),
    (lambda: topk_correct(torch.randn(4, 5), torch.tensor([0, 1, 2, 3]), 1, ties="random"), "ties must be one of"),
])
def test_metric_bad_input_messages(call, message):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert message in str(info.value)
