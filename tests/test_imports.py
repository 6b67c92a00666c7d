"""The package's modules import one another without a circle: imports inside functions count, and so do the modules a
module imports by name (`importlib.import_module`: the catalogue imports every experiment's module) and the exported
cells of the notebooks, which are the modules' source. The command line is on top of the runner, the Slurm executor
and the report, the report reads the grid and never imports the runner, and an experiment's module imports nothing
that reads the catalogue."""
import ast
import json
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "topk_nb"
NOTEBOOKS = PACKAGE.parent / "nbs"
EXPERIMENTS = "topk_nb.experiments"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> set[str]:
    return {module_name(p) for p in PACKAGE.rglob("*.py")}


def _by_name(tree: ast.AST, known: set[str]) -> set[str]:
    "The modules that the strings of `tree` name for importlib to import: 'topk_nb.loss.registry:LOSSES', a package (each of its modules), or the start of an f-string, 'topk_nb.experiments.{name}' (any module of that package)."
    calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", None)
             for n in ast.walk(tree) if isinstance(n, ast.Call)}
    if not calls & {"import_module", "iter_modules", "__import__"}:
        return set()
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = re.fullmatch(r"(topk_nb(?:\.\w+)+)(?::\w+)?", node.value)
            if match and match[1] in known:
                found |= {match[1]} | {m for m in known if m.startswith(match[1] + ".")}
        elif isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
            head = str(node.values[0].value)
            if re.fullmatch(r"topk_nb(?:\.\w+)*\.", head):
                found |= {m for m in known if m.startswith(head)}
    return found


def imports_of(tree: ast.AST, name: str, package: str) -> set[str]:
    "The modules of the package that the code `tree` of the module `name` (in `package`) imports, anywhere in it."
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}      # `from topk_nb import batch`
    known = modules()
    return {m for m in found | _by_name(tree, known) if m in known and m != name and m != "topk_nb"}


def imported(path: Path) -> set[str]:
    "The modules of the package that the file at `path` imports, anywhere in it."
    name = module_name(path)
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    return imports_of(ast.parse(path.read_text()), name, package)


def exported_cells(notebook: Path) -> tuple[str | None, list[str]]:
    "The module a notebook exports to (`#| default_exp`), and the source of its exported cells."
    cells = [c for c in json.loads(notebook.read_text(encoding="utf-8"))["cells"] if c["cell_type"] == "code"]
    sources = ["".join(c["source"]) for c in cells]
    target = next((m[1] for s in sources if (m := re.search(r"^#\|\s*default_exp\s+(\S+)", s, re.M))), None)
    return target, [s for s in sources if re.match(r"#\|\s*exports?\b", s)]


def notebook_imports(notebook: Path) -> tuple[str | None, set[str]]:
    "The module a notebook exports to, and the modules of the package its exported cells import."
    target, sources = exported_cells(notebook)
    if target is None:
        return None, set()
    name = f"topk_nb.{target}"
    tree = ast.Module(body=[stmt for s in sources for stmt in ast.parse(s).body], type_ignores=[])
    return name, imports_of(tree, name, name.rpartition(".")[0])


def graph() -> dict[str, set[str]]:
    "Each module's imports: those of its file, and those of the exported cells of its notebooks (its source)."
    g = {module_name(p): imported(p) for p in PACKAGE.rglob("*.py") if p.name != "_modidx.py"}
    for notebook in NOTEBOOKS.rglob("*.ipynb"):
        if ".ipynb_checkpoints" in notebook.parts: continue
        name, found = notebook_imports(notebook)
        if name is not None:
            g[name] = g.get(name, set()) | found
    return g


def reachable(g: dict, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in g.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m); todo.append(m)
    return seen


def circles(g: dict) -> dict:
    "Each module that imports itself through others, with the modules of a circle it imports."
    looped = sorted(m for m in g if m in reachable(g, m))
    return {m: sorted(g[m] & set(looped)) for m in looped}


def test_no_module_imports_itself_through_others():
    assert circles(graph()) == {}


# The folders, bottom up, and the folders each may import (the design page draws them): a module imports modules of its
# own folder and of the folders listed for it, never one above.
LAYERS = {
    "base": set(),                                         # the loss module's conventions, files, the catalogue's types
    "math": {"base"},                                      # the polynomials and their gradients, predictions
    "ops": {"base", "math"},                               # the Triton kernels and their launches
    "loss": {"base", "math", "ops"},                       # the losses, the perturbed optimizer, the registry
    "training": {"base", "math", "ops", "loss"},           # data, models, the training loop
    "experiments": {"base"},                               # the experiments' entries: types and records only
    "runner": {"base", "math", "ops", "loss", "training", "experiments"},   # grids, records, report, command line
    "perf": {"base", "math", "ops", "loss", "training", "experiments", "runner"},   # benchmarks and the GPU check
}


def folder(module: str) -> str | None:
    "The folder of a module of the package (`topk_nb.ops.svm` -> 'ops'); None for the package's own `__init__`."
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else None


def layer_violations(g: dict) -> list[tuple[str, str]]:
    "The imports (module, imported module) of `g` that cross into a folder that the importer's layer does not list."
    return sorted((m, d) for m, deps in g.items() for d in deps
                  if folder(m) and folder(d) and folder(d) != folder(m) and folder(d) not in LAYERS[folder(m)])


def test_each_folder_imports_only_the_folders_below_it():
    g = graph()
    assert {folder(m) for m in g} - {None} == set(LAYERS)                # every folder has its layer, and no other exists
    assert layer_violations(g) == []
    g["topk_nb.math.esp"] = g["topk_nb.math.esp"] | {"topk_nb.loss.svm"}   # one import up: named
    assert layer_violations(g) == [("topk_nb.math.esp", "topk_nb.loss.svm")]
    assert not any(len(m.split(".")) == 2 and folder(m) is None and m != "topk_nb.__init__" for m in g), sorted(g)   # no module
                                                                           # outside the folders


def test_the_report_imports_the_grid_and_not_the_runner():
    g = graph()
    assert "topk_nb.runner.grid" in g["topk_nb.runner.report"]
    assert not reachable(g, "topk_nb.runner.report") & {"topk_nb.runner.batch", "topk_nb.runner.slurm", "topk_nb.runner.cli"}
    assert not reachable(g, "topk_nb.runner.grid") & {"topk_nb.runner.batch", "topk_nb.runner.slurm", "topk_nb.runner.cli", "topk_nb.runner.report"}
    assert {"topk_nb.runner.batch", "topk_nb.runner.slurm", "topk_nb.runner.report", "topk_nb.runner.grid"} <= g["topk_nb.runner.cli"]


def test_the_graph_sees_imports_inside_functions(tmp_path):
    # the checks above are only as good as the parser: a lazy import counts, relative or absolute
    assert "topk_nb.base.files" in imported(PACKAGE / "runner" / "records.py")            # `from topk_nb.base.files import` in a function
    assert "topk_nb.base.catalogue" in imported(PACKAGE / "runner" / "records.py")        # `from .catalogue import`


def test_the_graph_sees_the_modules_imported_by_name():
    # the catalogue imports every experiment's module by name, the records look an entry up by its name, the grid
    # imports the registries its parameters name ("topk_nb.loss.registry:LOSSES"): each an import the graph counts
    experiments = {m for m in modules() if m.startswith(EXPERIMENTS + ".")}
    assert "topk_nb.experiments.circles_tradeoffs" in experiments
    assert experiments <= imported(PACKAGE / "runner" / "grid.py") and experiments <= imported(PACKAGE / "runner" / "records.py")
    assert {"topk_nb.loss.registry", "topk_nb.training.models", "topk_nb.training.loop"} <= imported(PACKAGE / "runner" / "grid.py")


def test_an_experiment_imports_nothing_that_reads_the_catalogue():
    # an entry's module (its drawings' imports included) may use the entry types, the atomic writes and what the
    # report shares with the entries; any other chapter reads the catalogue, or imports one that does
    g = graph()
    allowed = {"topk_nb.base.catalogue", "topk_nb.base.files", "topk_nb.base.results"}
    for name in sorted(m for m in g if m.startswith(EXPERIMENTS)):
        assert g[name] <= allowed, (name, sorted(g[name] - allowed))
    for leaf in allowed:
        assert not reachable(g, leaf), (leaf, sorted(reachable(g, leaf)))


def test_a_circle_through_a_function_of_an_experiment_notebook_is_found(tmp_path):
    # an experiment notebook whose drawing imports the report inside a function, as one once did: exported, its cells
    # close a circle (the report reads the grid, which imports every experiment's module), and the check names it
    source = next(NOTEBOOKS.glob("experiments/circles_tradeoffs.ipynb"))
    nb = json.loads(source.read_text(encoding="utf-8"))
    drawing = [c for c in nb["cells"] if c["cell_type"] == "code" and "def sawada_fig5" in "".join(c["source"])][0]
    text = "".join(drawing["source"]).replace("    import matplotlib\n",
                                               "    import matplotlib\n    from topk_nb.runner.report import unique_rows\n", 1)
    assert text != "".join(drawing["source"])
    drawing["source"] = text
    changed = tmp_path / source.name
    changed.write_text(json.dumps(nb), encoding="utf-8")
    name, found = notebook_imports(changed)
    assert (name, "topk_nb.runner.report" in found) == ("topk_nb.experiments.circles_tradeoffs", True)
    g = graph()
    g[name] = g[name] | found
    assert name in circles(g) and "topk_nb.runner.report" in circles(g)
    assert circles(graph()) == {}                                          # as the notebooks are


def test_the_catalogue_is_read_on_first_use():
    # importing the grid, the runner, the report or the command line imports no experiment's module; the first look
    # at the catalogue imports them all, once
    out = _fresh("import sys\n"
                 "import topk_nb.runner.grid, topk_nb.runner.batch, topk_nb.runner.report, topk_nb.runner.cli, topk_nb.runner.notebook\n"
                 f"print(sorted(m for m in sys.modules if m.startswith('{EXPERIMENTS}.')))\n"
                 "from topk_nb.runner.grid import EXPERIMENTS, experiment_catalogue\n"
                 "assert 'circles_tradeoffs' in EXPERIMENTS and experiment_catalogue() is experiment_catalogue()\n"
                 f"print(sorted(m for m in sys.modules if m.startswith('{EXPERIMENTS}.')) == "
                 f"sorted('{EXPERIMENTS}.' + n for n in EXPERIMENTS))")
    assert out.split() == ["[]", "True"], out


def _fresh(code: str, **env) -> str:
    "Run `code` in a fresh interpreter (this checkout's package first, TRITON_INTERPRET unset unless given); its stdout."
    import os, subprocess, sys
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(PYTHONPATH=os.pathsep.join([str(PACKAGE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]), **env)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_package_and_the_command_line_import_no_torch():
    out = _fresh("import sys, topk_nb, topk_nb.runner.cli, topk_nb.runner.report, topk_nb.base.files\n"
                 "print(sorted(m for m in ('torch', 'triton', 'matplotlib') if m in sys.modules))\n"
                 "from topk_nb.runner.cli import main\n"
                 "assert main(['list']) == 0\n"
                 "print(sorted(m for m in ('torch', 'triton', 'matplotlib') if m in sys.modules))")
    lines = out.splitlines()
    assert lines[0] == lines[-1] == "[]", out
    assert any(line.startswith("circles_tradeoffs: ") for line in lines), out


def test_top_level_names_are_their_modules_objects_imported_on_first_use():
    out = _fresh("import sys, topk_nb\n"
                 "from topk_nb import SmoothSVM, get_loss, LOSSES\n"
                 "from topk_nb.loss.svm import SmoothSVM as S\n"
                 "from topk_nb.loss.registry import get_loss as g, LOSSES as L\n"
                 "assert SmoothSVM is S and get_loss is g and LOSSES is L and topk_nb.SmoothSVM is S\n"
                 "assert set(topk_nb.__all__) <= set(dir(topk_nb))\n"
                 "assert all(getattr(topk_nb, name) is not None for name in topk_nb.__all__)\n"
                 "assert topk_nb.ops.launch is sys.modules['topk_nb.ops.launch']     # a module, as an attribute\n"
                 "try: topk_nb.no_such_name\n"
                 "except AttributeError as e: print(e)")
    assert out.strip() == "module 'topk_nb' has no attribute 'no_such_name'", out


def test_triton_interprets_without_a_gpu_unless_told_otherwise():
    "Without a CUDA device, Triton's first import after the package's sets TRITON_INTERPRET=1; a value given stays, and Triton imported before the package is left as it is."
    check = ("import os, sys, topk_nb\n"
             "before = os.environ.get('TRITON_INTERPRET')\n"
             "import topk_nb.ops.launch, torch\n"
             "print(before, os.environ.get('TRITON_INTERPRET'), torch.cuda.is_available(), topk_nb.ops.launch.HAS_TRITON)")
    before, after, cuda, has_triton = _fresh(check).split()
    assert before == "None"
    if has_triton == "True":
        assert after == ("None" if cuda == "True" else "1")
    assert _fresh(check, TRITON_INTERPRET="0").split()[:2] == ["0", "0"]
    first = "import os, triton, topk_nb, topk_nb.ops.launch; print(os.environ.get('TRITON_INTERPRET'))"
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    assert _fresh(first).strip() == "None"
