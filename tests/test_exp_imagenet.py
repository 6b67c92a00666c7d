"Catalogue entries of the imagenet_subsets (with Garcin's draft Tab. 9), plantnet_imbalanced, imagenet_lt and cifar100_transition experiments."
import json

import nbformat
import pytest

from topk_nb.runner import batch
from topk_nb.training.loop import PRESETS

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
    n = PRESETS["garcin_imagenet_noised"]   # Garcin 2022 draft, App. D, the noised balanced loss (batch size garbled: Berrada's)
    assert (n["epochs"], n["batch_size"], tuple(n["milestones"]), n["gamma"], n["multicrop"]) == (120, 256, (30, 60, 90), 0.1, "marginals")
    assert (n["lr"], n["weight_decay"]) == (0.1, 1.5e-4)
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
    assert not [pv for pv in entry("imagenet_subsets").paper if "Tab. 9" in pv.source]   # all lost in our copy of the draft
    assert len(entry("imagenet_subsets").paper) == 14


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


# --- Garcin 2022 (draft), App. D, Tab. 9: CE, the smoothed hinge and the noised balanced loss on ImageNet ---------
def test_garcin_tab9_preset_is_the_drafts():
    exp = entry("imagenet_subsets")
    cells = batch.expand_grid(exp.presets["tab9"])
    # "We optimize all losses for [K = 1] and [K = 5]" (the table's rows), "(3 seeds, 95% confidence interval)"
    assert sorted((c["loss"], c["K"], c["seed"]) for c in cells) == sorted(
        (loss, K, s) for loss in ("ce", "smooth_svm", "noised_bal") for K in (1, 5) for s in (0, 1, 2))
    for c in cells:   # each loss trained for its K; Berrada's ResNet-18, data and validation set, all the training images
        assert c["k"] == c["K"] and c["study"] == "tab9" and c["fraction"] == 1.0 and c["val_per_class"] == 50
        assert (c["model"], c["image_size"], c["resize"]) == ("resnet18", 224, 256)
        assert (c["tau"], c["alpha"], c["epsilon"], c["n_samples"]) == (0.1, 1.0, 0.5, 10)   # "0.1", "0.5", "10"
        assert c["epochs"] is None and c["batch_size"] is None and c["lr"] is None   # the loss's training preset
    assert "tab9" in exp.data_presets and "tab9" in {c.get("study") for c in batch.expand_grid(exp.presets["smoke"])}
    # "all three losses give similar results": each at most 1 point (ours) below the best of the other two, 3 seeds
    tab9 = [f for f in exp.findings if f.source == "Garcin 2022 draft, App. D, Tab. 9"]
    assert sorted(f.reference for f in tab9) == ["ce", "noised_bal", "smooth_svm"]
    assert all((f.relation, f.tol, f.single_run, f.x, f.xs, f.metric, f.where) ==
               ("best", 0.01, False, "K", (1, 5), "acc", {"study": "tab9"}) for f in tab9)
    (fig,) = [f for f in exp.figures if f.name == "tab9"]
    assert (fig.x, fig.series, fig.where, fig.metrics) == ("K", "loss", {"study": "tab9"}, ("acc",))
    # Berrada's numbers stand for Berrada's runs only (K None), never for Tab. 9's CE and L_{5,0.1} on the full data
    assert all(pv.where.get("K", "absent") is None for pv in exp.paper)


def test_tab9_notebook_trains_for_K_and_refuses_a_loss_for_another_k(tmp_path):
    exp = entry("imagenet_subsets")
    cell = {"study": "tab9", "loss": "noised_bal", "K": 1, "k": 1, "fraction": 1.0, "epochs": 2}
    rec = batch.run_cell(exp.notebook_path(), cell, tmp_path / "ok", experiment=exp.name)
    assert rec["status"] == "ok", rec.get("error")
    row = rec["metrics"]["final"][0]
    assert (row["study"], row["loss"], row["K"], row["k"], row["epsilon"], row["n_samples"]) == ("tab9", "noised_bal", 1, 1, 0.5, 10)
    assert row["acc"] == row["top1"] and "tau" not in row
    crops = rec["metrics"]["final"][1:]     # the crop comparison's rows: K, but no acc (each seed counts once in Tab. 9)
    assert sorted(r["crops"] for r in crops) == ["centre", "marginals", "softmax"]
    assert all(r["K"] == 1 and "acc" not in r for r in crops)
    # the draft's settings for this loss, selected on validation top-1 (the K trained for), not Berrada's top-5
    executed = nbformat.read(str(tmp_path / "ok" / "notebook.ipynb"), as_version=4)
    printed = "".join(o.get("text", "") for c in executed.cells if c.cell_type == "code" for o in c.outputs)
    (line,) = [l for l in printed.splitlines() if l.startswith("garcin_imagenet_noised ")]
    config = json.loads(line.split(" ", 1)[1])
    assert (config["lr"], config["weight_decay"], config["select_metric"]) == (0.1, 1.5e-4, "val_top1")
    hist = rec["metrics"]["history"]
    best = max(range(len(hist)), key=lambda i: hist[i]["val_top1"])
    assert row["best_epoch"] == hist[best]["epoch"] and row["val_top1"] == hist[best]["val_top1"]
    bad = batch.run_cell(exp.notebook_path(), {**cell, "loss": "smooth_svm", "K": 5}, tmp_path / "bad", experiment=exp.name)
    assert bad["status"] == "failed" and "k must equal K=5, got k=1" in bad["error"]
