"Catalogue entries of the imagenet_subsets, plantnet_imbalanced, imagenet_lt and cifar100_transition experiments."
import pytest

from topk_nb import batch
from topk_nb.train import PRESETS

NAMES = ["imagenet_subsets", "plantnet_imbalanced", "imagenet_lt", "cifar100_transition"]


def entry(name):
    return batch.EXPERIMENTS[name]


def notebook_parameters(exp) -> dict:
    "The names and default values of the notebook's `parameters` cell."
    return batch.notebook_parameters(exp.notebook_path())


def paper_cells(exp) -> list[dict]:
    "Every cell of the non-smoke presets, completed with the notebook's defaults."
    defaults = notebook_parameters(exp)
    return [{**defaults, **cell} for name, preset in exp.presets.items() if name != "smoke"
            for cell in batch.expand_grid(preset)]


def test_training_presets_are_the_papers():
    ce, svm = PRESETS["berrada_imagenet"], PRESETS["berrada_imagenet_svm"]
    for p in (ce, svm):   # Berrada 2018, §5.2
        assert (p["epochs"], p["batch_size"], tuple(p["milestones"]), p["gamma"]) == (120, 256, (30, 60, 90), 0.1)
        assert p["select_metric"] == "val_top5" and p["multicrop"] == "marginals"
    assert (ce["lr"], ce["weight_decay"], svm["lr"], svm["weight_decay"]) == (0.1, 1e-4, 1.0, 2.5e-5)
    g = PRESETS["garcin_plantnet"]   # Garcin 2022, §4.5
    assert (g["epochs"], g["batch_size"], g["lr"], g["weight_decay"], tuple(g["milestones"])) == (30, 32, 2e-3, 1e-4, (20, 25))
    assert tuple(g["ks"]) == (1, 3, 5, 10)
    s = PRESETS["sawada_cifar100"]   # Sawada, §V-A
    assert (s["epochs"], s["batch_size"], s["lr"], s["weight_decay"], tuple(s["milestones"]), s["gamma"]) == \
        (200, 128, 0.1, 5e-4, (60, 120, 160), 0.2)


@pytest.mark.parametrize("name", NAMES)
def test_presets_name_notebook_parameters(name):
    exp = entry(name)
    params = notebook_parameters(exp)
    assert params["data_root"] is None and params["record_path"] is None and params["seed"] == 0
    assert "smoke" in exp.presets and set(exp.data_presets) <= set(exp.presets) and "smoke" not in exp.data_presets
    for preset in exp.presets.values():
        for cell in batch.expand_grid(preset):
            assert set(cell) <= set(params), (name, sorted(set(cell) - set(params)))


@pytest.mark.parametrize("name", NAMES)
def test_paper_values_select_a_paper_cell(name):
    exp = entry(name)
    cells = paper_cells(exp)
    for pv in exp.paper:
        assert (0 < pv.value < 1) if pv.unit == "%" else pv.value > 0, pv   # a fraction, or a count in its unit
        assert any(all(cell.get(k) == v for k, v in pv.where.items()) for cell in cells), pv
    for f in exp.findings:
        assert set(f.where) <= set(cells[0]), f


def test_paper_value_counts():
    def count(name, source):
        return sum(pv.source == source for pv in entry(name).paper)
    assert count("imagenet_subsets", "Berrada 2018, Tab. 2") == 10
    assert count("imagenet_subsets", "Berrada 2018, Tab. 7") == count("imagenet_subsets", "Berrada 2018, Tab. 8") == 2
    assert count("plantnet_imbalanced", "Garcin 2022, Tab. 5") == count("plantnet_imbalanced", "Garcin 2022, Tab. 7") == 23
    assert count("cifar100_transition", "Sawada, Tab. I") == 28
    assert not entry("imagenet_lt").paper


def test_paper_numbers_spot_checks():
    def value(name, source, metric, **where):
        (pv,) = [pv for pv in entry(name).paper if pv.source == source and pv.metric == metric
                 and all(pv.where.get(k) == v for k, v in where.items())]
        return pytest.approx(pv.value, abs=1e-12)
    assert value("imagenet_subsets", "Berrada 2018, Tab. 2", "top5", loss="ce", fraction=0.05) == 0.5831
    assert value("imagenet_subsets", "Berrada 2018, Tab. 2", "top5", loss="smooth_svm", fraction=0.1) == 0.7310
    assert value("plantnet_imbalanced", "Garcin 2022, Tab. 5", "macro_acc", loss="noised_imbal", K=1) == 0.4236
    assert value("plantnet_imbalanced", "Garcin 2022, Tab. 7", "acc", loss="focal", K=10) == 0.9772
    assert value("cifar100_transition", "Sawada, Tab. I", "top5", loss="topk_transition", model="cifar_densenet121",
                 augment="mixup") == 0.9518
    assert value("cifar100_transition", "Sawada, Tab. I", "top1", loss="smooth_svm", model="cifar_resnet18",
                 augment="cutout") == 0.6731


def test_no_smooth_svm_with_mixup_nor_at_k1():
    for cell in paper_cells(entry("cifar100_transition")):
        assert not (cell["loss"] == "smooth_svm" and cell["augment"] == "mixup"), cell   # Sawada Tab. I: N/A
    for cell in paper_cells(entry("plantnet_imbalanced")):
        assert not (cell["loss"] == "smooth_svm" and cell["K"] == 1), cell             # Garcin Tab. 5: NA
