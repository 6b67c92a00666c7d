"Tests specific to the stability and level_sets experiments: the level-set functions of topk_nb.loss.registry against direct formulas, the overflow rule the stability notebook checks, and the catalogue entries against the notebooks' parameters."
import math
from pathlib import Path

import pytest
import torch

from topk_nb.runner import batch
from topk_nb.math.esp import esp_summation, imagenet_like_scores, log_esp_summation
from topk_nb.loss.registry import (
    TOPK_ERROR,
    level_set_atlas,
    level_set_params,
    level_set_values,
    parse_panel,
    simplex_grid,
)

EXPERIMENTS = Path(__file__).resolve().parent.parent / "nbs" / "experiments"


def random_simplex_points(n=40, radius=2.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = -torch.rand(n, 3, generator=g, dtype=torch.float64).log()          # Dirichlet(1, 1, 1)
    return radius * w / w.sum(1, keepdim=True)


# --- the grid ----------------------------------------------------------------------------------------------------
def test_simplex_grid_points_corners_and_symmetry():
    r = 12
    scores, xy = simplex_grid(r, radius=2.0)
    assert scores.shape == ((r + 1) * (r + 2) // 2, 3) and xy.shape == (len(scores), 2)
    torch.testing.assert_close(scores.sum(1), torch.full((len(scores),), 2.0, dtype=torch.float64), rtol=0, atol=1e-12)
    assert (scores >= 0).all()
    rows = {tuple(s.tolist()) for s in scores}
    assert {(2.0, 0.0, 0.0), (0.0, 2.0, 0.0), (0.0, 0.0, 2.0), (1.0, 1.0, 0.0)} <= rows
    assert {(b, a, c) for a, b, c in rows} == rows                       # exchanging classes 0 and 1: exact
    top = int(xy[:, 1].argmax())
    assert scores[top].tolist() == [0.0, 0.0, 2.0]
    torch.testing.assert_close(xy[top], torch.tensor([0.5, math.sqrt(3) / 2], dtype=torch.float64))
    for bad in ({"resolution": 0}, {"radius": 0.0}, {"resolution": 2.5}):
        with pytest.raises((ValueError, TypeError)):
            simplex_grid(**bad)


# --- panels ------------------------------------------------------------------------------------------------------
def test_parse_panel():
    assert parse_panel("ce") == ("ce", {})
    assert parse_panel("smooth_svm(tau=0.1, alpha=1)") == ("smooth_svm", {"tau": 0.1, "alpha": 1})
    assert parse_panel("noised_bal(epsilon: 1.0, n_samples: 50)") == ("noised_bal", {"epsilon": 1.0, "n_samples": 50})
    assert parse_panel("smooth_svm(hard_switch=False)") == ("smooth_svm", {"hard_switch": False})
    assert parse_panel(TOPK_ERROR) == (TOPK_ERROR, {})
    for bad, msg in [("nope", "unknown loss"), ("ce(", "a panel is"), ("smooth_svm(tau)", "key=value"),
                     ("smooth_svm(tau=abc)", "must be a number"), (3, "a panel is")]:
        with pytest.raises(ValueError, match=msg):
            parse_panel(bad)


def test_level_set_params_harmonise_margins():
    assert level_set_params("topk_hinge", 2) == {"k": 2, "alpha": 0.5}
    assert level_set_params("smooth_svm", 1, tau=0.1) == {"k": 1, "alpha": 1.0, "tau": 0.1}
    assert level_set_params("ce", 2) == {}
    p = level_set_params("noised_imbal", 2)
    assert p["max_m"] == 1.0 and torch.equal(p["class_counts"], torch.ones(3))
    with pytest.raises(ValueError, match="does not take tau"):
        level_set_params("ce", 1, tau=1.0)


# --- values against direct formulas ------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2])
def test_level_set_values_match_direct_formulas(k):
    s = random_simplex_points()
    y = torch.full((len(s),), 2)
    s_y, others = s[:, 2], s[:, :2]
    top_other = others.sort(1, descending=True).values[:, k - 1]          # top_K of s without y
    top_k_plus_1 = s.sort(1, descending=True).values[:, k]                  # top_{K+1} of s
    direct = {
        "ce": torch.logsumexp(s, 1) - s_y,
        "topk_hinge": ((1 + top_other - s_y) / k).clamp_min(0),            # alpha = 1/K: margin 1 after the 1/K scale
        "cal_hinge": (1 + top_k_plus_1 - s_y).clamp_min(0),
        "ldam": torch.logsumexp(s - torch.nn.functional.one_hot(y, 3).double(), 1) - (s_y - 1),
        TOPK_ERROR: (others >= s_y[:, None]).sum(1).ge(k).double(),        # ties count against the true class
    }
    for panel, want in direct.items():
        torch.testing.assert_close(level_set_values(panel, s, y, k), want, rtol=1e-10, atol=1e-12, msg=panel)


def test_smooth_svm_panel_matches_brute_force_over_subsets():
    # Berrada 2018 eq. (10) with L = 3, written out over the K-subsets A: tau log sum_A exp(alpha 1[y not in A]/tau +
    # sum_A s/(K tau)) - tau log sum_{A containing y} exp(sum_A s/(K tau)), alpha = 1/K after harmonisation.
    import itertools
    s = random_simplex_points(12, seed=3)
    y = torch.full((len(s),), 2)
    for k, tau in [(1, 1.0), (2, 1.0), (2, 0.5)]:
        alpha = 1.0 / k
        subsets = list(itertools.combinations(range(3), k))
        sums = torch.stack([s[:, list(a)].sum(1) / (k * tau) for a in subsets], 1)
        margin = torch.tensor([alpha / tau * (2 not in a) for a in subsets], dtype=torch.float64)
        with_y = [i for i, a in enumerate(subsets) if 2 in a]
        want = tau * (torch.logsumexp(sums + margin, 1) - torch.logsumexp(sums[:, with_y], 1))
        got = level_set_values(f"smooth_svm(tau={tau}, hard_switch=false)", s, y, k)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_noised_panel_is_the_average_and_tends_to_the_calibrated_hinge():
    s = random_simplex_points(30, seed=1)
    y = torch.full((len(s),), 2)
    for k in (1, 2):
        tiny = level_set_values("noised_bal(epsilon=1e-7, n_samples=5)", s, y, k, replications=3, seed=4)
        torch.testing.assert_close(tiny, level_set_values("cal_hinge", s, y, k), rtol=0, atol=1e-5)
    one = level_set_values("noised_bal(epsilon=1.0)", s, y, 2, replications=1, seed=7)
    many = level_set_values("noised_bal(epsilon=1.0)", s, y, 2, replications=8, seed=7)
    again = level_set_values("noised_bal(epsilon=1.0)", s, y, 2, replications=8, seed=7)
    torch.testing.assert_close(many, again, rtol=0, atol=0)                 # seeded: reproducible
    assert not torch.equal(one, many)
    with pytest.raises(ValueError, match="takes no parameters"):
        level_set_values("topk_error(k=1)", s, y, 1)


def test_level_set_atlas_small():
    atlas = level_set_atlas(["topk_error", "ce", "cal_hinge"], ks=(1, 2), resolution=6, replications=2)
    assert atlas.panels == ["topk_error", "ce", "cal_hinge"] and atlas.ks == [1, 2]
    for key, v in atlas.values.items():
        r = atlas.rescaled(*key)
        assert v.shape == (28,) and r.min() == 0 and r.max() == 1, key
    assert atlas.at("cal_hinge", 1, [1.0, 1.0, 0.0]) == 2.0
    assert atlas.at("ce", 2, [0.0, 0.0, 2.0]) == pytest.approx(math.log(math.exp(2) + 2) - 2)
    with pytest.raises(ValueError, match="y must be an integer"):
        level_set_atlas(["ce"], y=3)


# --- the overflow rule of the stability notebook ---------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_summation_overflows_iff_largest_term_exceeds_the_range(dtype):
    # SA's partial sums sigma_{j,i} only grow with i, so it overflows iff some e_i or some final sigma_j does.
    s = imagenet_like_scores(4, 60, generator=torch.Generator().manual_seed(0))
    k, log_fmax = 5, math.log(torch.finfo(dtype).max)
    for tau in (10.0, 1.0, 0.3, 0.1, 0.05, 0.01, 0.001):
        x = (s / (k * tau)).to(dtype)
        overflow = not torch.isfinite(esp_summation(x.exp(), k, check_finite=False)).all()
        peak = max(x.max().item(), log_esp_summation(x.double(), k).max().item())
        if abs(peak - log_fmax) > 0.5:
            assert overflow == (peak > log_fmax), (tau, peak)


# --- the catalogue entries ----------------------------------------------------------------------------------------
def notebook_parameters(path: Path) -> set[str]:
    return set(batch.notebook_parameters(path))


ROW_KEYS = {"stability": {"part", "variant", "algorithm", "method", "dtype", "tau"},
            "level_sets": {"panel", "loss", "k", "sweep", "epsilon", "n_samples"}}   # the sweeps' rows carry their own


@pytest.mark.parametrize("name", ["stability", "level_sets"])
def test_catalogue_entry_matches_the_notebook(name):
    exp = batch.EXPERIMENTS[name]
    params = notebook_parameters(EXPERIMENTS / exp.notebook)
    for preset, grid in exp.presets.items():
        for cell in batch.expand_grid(grid):
            assert set(cell) <= params, (preset, set(cell) - params)
            if name == "stability":
                assert 1 <= cell.get("k", 5) <= cell.get("n", 1000), (preset, cell)
    for pv in exp.paper:
        assert set(pv.where) <= params | ROW_KEYS[name], pv
        assert 0.0 <= pv.value <= 1.0
    for f in exp.findings:
        assert set(f.where) <= params | ROW_KEYS[name] and f.x in params | ROW_KEYS[name], f
