"Tests specific to the experiment notebooks cifar100_noise, temperature and noise_scale: the gradient-sparsity measurements against independent computations, and their catalogue entries."
from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch

from topk_nb.runner import batch
from topk_nb.runner.batch import expand_grid
from topk_nb.loss.registry import LOSSES, get_loss
from topk_nb.loss.svm import smooth_topk_svm_bruteforce
from topk_nb.training.loop import PRESETS

NOTEBOOKS = Path(__file__).resolve().parent.parent / "nbs" / "experiments"


def _cells(name: str):
    return [c for c in nbformat.read(str(NOTEBOOKS / f"{name}.ipynb"), as_version=4).cells if c.cell_type == "code"]


def parameters(name: str) -> dict:
    "The defaults of a notebook's `parameters` cell."
    return batch.notebook_parameters(NOTEBOOKS / f"{name}.ipynb")


def definitions(name: str, **extra) -> dict:
    "A namespace with the notebook's parameters, its imports and its definition cells (cells starting with def/class)."
    ns = dict(parameters(name))
    cells = _cells(name)
    imports = next(c.source for c in cells if "from topk_nb.runner.notebook import start" in c.source)   # the cell that starts
    exec("\n".join(line for line in imports.splitlines() if line.startswith(("import ", "from "))), ns)
    for c in cells:
        if c.source.startswith(("def ", "class ")):
            exec(c.source, ns)                   # also runs the notebook's own check at the end of the cell
    ns.update(extra)
    return ns


@pytest.fixture(scope="module")
def temperature():
    return definitions("temperature")


@pytest.fixture(scope="module")
def noise_scale():
    return definitions("noise_scale")


# --- temperature: share of non-zero derivative entries ---------------------------------------------------------
@pytest.mark.parametrize("tau", [0.05, 0.5, 5.0])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_score_gradients_match_bruteforce(temperature, tau, k):
    g = torch.Generator().manual_seed(k)
    scores, target = torch.randn(12, 7, generator=g, dtype=torch.float64), torch.randint(0, 7, (12,), generator=g)
    ours = temperature["score_gradients"](get_loss("smooth_svm", k=k, tau=tau, alpha=1.0, reduction="none"), scores, target)
    brute = temperature["score_gradients"](lambda s, y: smooth_topk_svm_bruteforce(s, y, k, tau, 1.0), scores, target)
    torch.testing.assert_close(ours, brute, rtol=1e-8, atol=1e-11)
    assert torch.equal(temperature["nonzero_counts"](ours), torch.full((12,), 7))
    # per-sample: row i is the derivative of sample i's loss alone
    single = temperature["score_gradients"](get_loss("smooth_svm", k=k, tau=tau, reduction="none"), scores[3:4], target[3:4])
    torch.testing.assert_close(ours[3:4], single)


def test_hinge_nonzero_counts_by_hand(temperature):
    scores = np.array([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.0, 0.0]])
    # y=3, k=1: 1 + (3 - 0) > 0 -> 2; y=0, k=1: 1 + (2 - 3) = 0 -> inactive; y=0, k=2: 1 + (1 - 3)/2 = 0 -> inactive
    assert temperature["hinge_nonzero_counts"](scores[:2], np.array([3, 0]), 1, 1.0).tolist() == [2, 0]
    assert temperature["hinge_nonzero_counts"](scores[2:], np.array([0]), 2, 1.0).tolist() == [0]
    assert temperature["hinge_nonzero_counts"](scores[2:], np.array([0]), 2, 1.5).tolist() == [2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_small_tau_count_is_the_hard_hinge_count(temperature, dtype):
    g = torch.Generator().manual_seed(3)
    scores = torch.stack([torch.randperm(30, generator=g) for _ in range(40)]).to(dtype) * 0.5   # gaps of 0.5
    target = torch.randint(0, 30, (40,), generator=g)
    for k in (1, 3):
        grad = temperature["score_gradients"](get_loss("smooth_svm", k=k, tau=1e-4, alpha=0.3, reduction="none"),
                                              scores, target)
        expected = temperature["hinge_nonzero_counts"](scores, target, k, 0.3)
        assert 0 < expected.sum() < 80
        assert np.array_equal(temperature["nonzero_counts"](grad).numpy(), expected)
    # and the hard hinge itself (tau = 0 in the notebook) gives the same count
    grad = temperature["score_gradients"](temperature["make_loss"]("topk_hinge"), scores, target)
    assert np.array_equal(temperature["nonzero_counts"](grad).numpy(),
                          temperature["hinge_nonzero_counts"](scores, target, temperature["k"], temperature["alpha"]))


# --- noise_scale: eq. (12) and the first-epoch counter -----------------------------------------------------------
@pytest.mark.parametrize("eps,B", [(0.0, 1), (0.01, 2), (0.5, 5), (50.0, 3)])
def test_eq12_matches_autograd(noise_scale, eps, B):
    g = torch.Generator().manual_seed(B)
    scores, target = torch.randn(24, 20, generator=g), torch.randint(0, 20, (24,), generator=g)
    scores[::3] *= 0.05                                     # some samples with the target inside the noise band
    noise = torch.randn(B, 24, 20, generator=g)
    for k in (1, 3):
        ours = noise_scale["autograd_gradient"](scores, target, k, eps, noise, 1.0)
        ref = noise_scale["eq12_gradient"](scores, target, k, eps, noise, 1.0)
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        assert torch.equal(ours != 0, ref != 0)
        assert int((ref != 0).sum(1).max()) <= (2 if eps == 0 else B + 1)
        # each active row of eq. (12) sums to zero: B picks of 1/B minus delta_y
        torch.testing.assert_close(ref.sum(1), torch.zeros(24), atol=1e-6, rtol=0)


def test_eq12_all_picks_on_the_target_cancel(noise_scale):
    # the target's score is the (k+1)-th largest under every perturbation: its coordinate is exactly zero
    scores = torch.tensor([[5.0, 4.0, 3.0, 0.0, -5.0]])
    noise = torch.zeros(3, 1, 5)
    grad = noise_scale["eq12_gradient"](scores, torch.tensor([2]), 2, 0.1, noise)
    assert torch.equal(grad, torch.zeros(1, 5))
    grad = noise_scale["eq12_gradient"](scores, torch.tensor([3]), 2, 0.1, noise)   # active: +1 at index 2, -1 at y
    assert torch.equal(grad, torch.tensor([[0.0, 0.0, 1.0, -1.0, 0.0]]))


def test_first_epoch_counter(noise_scale):
    counter = noise_scale["FirstEpochCounter"](get_loss("noised_bal", k=2, epsilon=1.0, n_samples=2), 10,
                                              {"ce": get_loss("ce", reduction="none")})
    g = torch.Generator().manual_seed(0)
    values = []
    for _ in range(3):                                      # batches of 6: counts 6, 4, then nothing
        s = torch.randn(6, 8, generator=g).requires_grad_(True)
        y = torch.randint(0, 8, (6,), generator=g)
        torch.manual_seed(1); loss = counter(s, y); loss.backward()
        torch.manual_seed(1); values.append((loss.item(), get_loss("noised_bal", k=2, epsilon=1.0, n_samples=2)(s, y).item()))
    assert all(a == b for a, b in values), "the counter changed the loss"
    assert [len(c) for c in counter.counts] == [6, 4] and counter.seen == 10
    assert torch.cat(counter.ref_counts["ce"]).tolist() == [8] * 10
    assert int(torch.cat(counter.counts).max()) <= 3
    with torch.no_grad():                                    # evaluation passes are not counted
        counter.left = 5
        counter(torch.randn(4, 8), torch.zeros(4, dtype=torch.long))
    assert counter.seen == 10


# --- catalogue entries ---------------------------------------------------------------------------------------
ENTRIES = {"cifar100_noise": 54, "temperature": 14, "noise_scale": 15}   # PaperValues: every number of the tables
ROW_KEYS = {"loss"}                                                      # set by the notebooks' rows, not parameters


def entry(name: str):
    return batch.EXPERIMENTS[name]


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_paper_values_are_produced_by_a_paper_cell(name):
    exp = entry(name)
    defaults = parameters(name)
    assert len(exp.paper) == ENTRIES[name] and len({(p.source, p.row, p.metric) for p in exp.paper}) == ENTRIES[name]
    cells = [{**defaults, **c} for c in expand_grid(exp.presets["paper"])]
    for pv in exp.paper:
        assert 0 <= pv.value <= 1
        assert set(pv.where) <= set(defaults) | ROW_KEYS, pv
        wanted = {k: v for k, v in pv.where.items() if k in defaults}
        assert any(all(c[k] == v for k, v in wanted.items()) for c in cells), f"no paper cell runs {pv}"
        if "loss" in pv.where and "loss" in defaults:
            assert pv.where["loss"] in LOSSES


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_presets_are_notebook_parameters_and_use_the_train_presets(name):
    exp = entry(name)
    defaults = parameters(name)
    assert PRESETS[defaults["train_preset"]]["epochs"] == 300 and PRESETS[defaults["train_preset"]]["batch_size"] == 64
    for preset, grid in exp.presets.items():
        for cell in expand_grid(grid):
            assert set(cell) <= set(defaults), (preset, set(cell) - set(defaults))
            if preset != "smoke":
                assert cell["model"] in ("densenet40_40", "densenet40_12") and cell["batch_size"] is None
                assert "lr" not in cell and "train_preset" not in cell      # the training values come from PRESETS
    assert set(exp.data_presets) == set(exp.presets) - {"smoke"}


def test_cifar100_noise_presets_share_runs():
    exp = entry("cifar100_noise")
    both = expand_grid(exp.presets["paper"])
    berrada, garcin = expand_grid(exp.presets["berrada"]), expand_grid(exp.presets["garcin"])
    shared = 2 * 3 * 2                                       # ce, smooth_svm x p in 0, 0.2, 0.4 x seeds 0, 1
    assert len(berrada) == 2 * 6 * 3 and len(garcin) == 3 * 5 * 2 and len(both) == len(berrada) + len(garcin) - shared
    assert PRESETS["garcin_cifar100"] == PRESETS["berrada_cifar100"]
