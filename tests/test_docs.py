"""The documentation site's extension (docs/topk_docs.py): notebook pages, anchors, docments, catalogue."""
import json
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "docs"))

import topk_docs  # noqa: E402


def notebook(*cells) -> str:
    return json.dumps({"nbformat": 4, "nbformat_minor": 5, "metadata": {}, "cells": [
        {"cell_type": kind, "id": f"c{i}", "metadata": {}, "source": source,
         **({"outputs": outputs, "execution_count": None} if kind == "code" else {})}
        for i, (kind, source, outputs) in enumerate(cells)]})


def test_page_names_are_nbdevs():
    assert topk_docs.page_name(Path("nbs/06_baselines.ipynb")) == "baselines"
    assert topk_docs.page_name(Path("nbs/index.ipynb")) == "index"
    assert topk_docs.page_name(Path("nbs/experiments/level_sets.ipynb")) == "level_sets"
    assert topk_docs.doc_name("experiments/level_sets.ipynb") == "experiments/level_sets"


def test_every_exported_function_and_class_has_a_chapter_anchor():
    site = topk_docs.Site()
    assert site.link("topk_nb.loss.svm.smooth_svm") == ("smooth_svm", "smooth_svm")
    assert site.link("topk_nb.experiments.level_sets.ENTRY") is None            # constants: no chapter link
    missing = [name for name in site.links if site.link(name) is None]
    assert not missing, missing


def test_process_drops_hidden_cells_strips_directives_and_places_anchors():
    site = topk_docs.Site()
    site.anchors["demo"] = {"c1": ["f"], "show_doc:f": ["f"], "c2": ["g"], "show_doc:g": ["g"]}
    site.names.update({("demo", "f"): "topk_nb.demo.f", ("demo", "g"): "topk_nb.demo.g"})
    shown = {"output_type": "execute_result", "execution_count": None, "metadata": {}, "data": {
        "text/plain": "f()", "text/markdown": "---\n\n[source](https://x/f.py#L1){target=\"_blank\"}\n\n### f\n\n*Doc.*"}}
    text = notebook(("code", "#| default_exp demo", []), ("code", "#| export\ndef f(): pass", []),
                    ("code", "#| export\ng = 1", []), ("code", "#| hide\nimport os", []),
                    ("code", "show_doc(f)", [shown]), ("markdown", "# Title", []))
    nb = json.loads(site.process("demo", text))
    sources = [c["source"] for c in nb["cells"]]
    assert sources == ["def f(): pass", '<div id="g"></div>\n', "g = 1", "show_doc(f)", "# Title"]
    doc = nb["cells"][3]
    assert "remove-input" in doc["metadata"]["tags"]
    markdown = doc["outputs"][0]["data"]["text/markdown"]
    assert '<h3 class="showdoc-name" id="f">f</h3>' in markdown and not markdown.startswith("---")
    assert '<a href="https://x/f.py#L1">source</a> · <a href="reference/topk_nb.demo.html#topk_nb.demo.f">API</a>' in markdown
    assert site.placed["demo"] == {"f", "g"}


def test_a_methods_show_doc_output_loses_its_leading_rule():
    # docutils allows no transition at the start of an output: a method's show_doc output needs the same treatment
    site = topk_docs.Site()
    shown = {"output_type": "execute_result", "execution_count": None, "metadata": {}, "data": {
        "text/plain": "m()", "text/markdown": "---\n\n[source](https://x/f.py#L9){target=\"_blank\"}\n\n### C.m\n\n*Doc.*"}}
    nb = json.loads(site.process("demo", notebook(("code", "show_doc(C.m)", [shown]))))
    markdown = nb["cells"][0]["outputs"][0]["data"]["text/markdown"]
    assert not markdown.lstrip().startswith("---") and '<h3 class="showdoc-name">C.m</h3>' in markdown
    assert '<a href="https://x/f.py#L9">source</a>' in markdown and "remove-input" in nb["cells"][0]["metadata"]["tags"]


def test_front_page_gets_the_site_toctree():
    site = topk_docs.Site()
    nb = json.loads(site.process("index", notebook(("markdown", "# topk_nb", []))))
    assert "{toctree}" in nb["cells"][-1]["source"] and "reference/index" in nb["cells"][-1]["source"]


def test_docments_become_param_fields_after_the_chapter_link():
    from topk_nb.loss.svm import SmoothSVM
    app = SimpleNamespace(topk_site=topk_docs.Site())
    lines = ["Smooth top-k SVM loss."]
    topk_docs.on_process_docstring(app, "class", "topk_nb.loss.svm.SmoothSVM", SmoothSVM, {}, lines)
    assert lines[2].startswith("Defined in the chapter `") and "<../smooth_svm.html#smoothsvm>`__" in lines[2]
    assert ":param k: the k of top-k" in lines and ":type k: int" in lines
    assert ("smooth_svm", "smoothsvm") in app.topk_site.linked


def test_markdown_docstrings_are_escaped_for_rst():
    assert topk_docs._rst_escape("max(1, |x|) * 2, `a*b|c`") == "max(1, \\|x\\|) \\* 2, `a*b|c`"
    assert topk_docs._rst_escape("targets_ and w_j") == "targets\\_ and w_j"


def test_catalogue_lists_every_experiment_and_preset():
    from topk_nb.runner.batch import EXPERIMENTS
    page = topk_docs.catalogue_page()
    for exp in EXPERIMENTS.values():
        assert f"## `{exp.name}`" in page and f"{{doc}}`{Path(exp.notebook).stem}`" in page
        for preset in exp.presets:
            assert f"* **{preset}** (" in page
