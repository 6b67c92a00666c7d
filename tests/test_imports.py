"""The package's modules import one another without a circle (imports inside functions count too): the command line is on
top of the runner, the Slurm executor and the report, the report reads the grid and never imports the runner."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "topk_nb"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported(path: Path) -> set[str]:
    "The modules of the package that the file at `path` imports, anywhere in it."
    name, found = module_name(path), set()
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{a.name}" for a in node.names}      # `from topk_nb import batch`
    modules = {module_name(p) for p in PACKAGE.rglob("*.py")}
    return {m for m in found if m in modules and m != name and m != "topk_nb"}


def graph() -> dict[str, set[str]]:
    return {module_name(p): imported(p) for p in PACKAGE.rglob("*.py") if p.name != "_modidx.py"}


def reachable(g: dict, start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for m in g.get(todo.pop(), ()):
            if m not in seen:
                seen.add(m); todo.append(m)
    return seen


def test_no_module_imports_itself_through_others():
    g = graph()
    circles = sorted(m for m in g if m in reachable(g, m))
    assert circles == [], {m: sorted(g[m] & set(circles)) for m in circles}


def test_the_report_imports_the_grid_and_not_the_runner():
    g = graph()
    assert "topk_nb.grid" in g["topk_nb.report"]
    assert not reachable(g, "topk_nb.report") & {"topk_nb.batch", "topk_nb.slurm", "topk_nb.cli"}
    assert not reachable(g, "topk_nb.grid") & {"topk_nb.batch", "topk_nb.slurm", "topk_nb.cli", "topk_nb.report"}
    assert {"topk_nb.batch", "topk_nb.slurm", "topk_nb.report", "topk_nb.grid"} <= g["topk_nb.cli"]


def test_the_graph_sees_imports_inside_functions(tmp_path):
    # the checks above are only as good as the parser: a lazy import counts, relative or absolute
    assert "topk_nb.files" in imported(PACKAGE / "records.py")            # `from topk_nb.files import` in a function
    assert "topk_nb.catalogue" in imported(PACKAGE / "records.py")        # `from .catalogue import`


def _fresh(code: str, **env) -> str:
    "Run `code` in a fresh interpreter (this checkout's package first, TRITON_INTERPRET unset unless given); its stdout."
    import os, subprocess, sys
    environ = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    environ.update(PYTHONPATH=os.pathsep.join([str(PACKAGE.parent), *filter(None, [os.environ.get("PYTHONPATH")])]), **env)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_package_and_the_command_line_import_no_torch():
    out = _fresh("import sys, topk_nb, topk_nb.cli, topk_nb.report, topk_nb.files\n"
                 "print(sorted(m for m in ('torch', 'triton', 'matplotlib') if m in sys.modules))\n"
                 "from topk_nb.cli import main\n"
                 "assert main(['list']) == 0\n"
                 "print(sorted(m for m in ('torch', 'triton', 'matplotlib') if m in sys.modules))")
    lines = out.splitlines()
    assert lines[0] == lines[-1] == "[]", out
    assert any(line.startswith("circles_tradeoffs: ") for line in lines), out


def test_top_level_names_are_their_modules_objects_imported_on_first_use():
    out = _fresh("import sys, topk_nb\n"
                 "from topk_nb import SmoothSVM, get_loss, LOSSES\n"
                 "from topk_nb.svm import SmoothSVM as S\n"
                 "from topk_nb.losses import get_loss as g, LOSSES as L\n"
                 "assert SmoothSVM is S and get_loss is g and LOSSES is L and topk_nb.SmoothSVM is S\n"
                 "assert set(topk_nb.__all__) <= set(dir(topk_nb))\n"
                 "assert all(getattr(topk_nb, name) is not None for name in topk_nb.__all__)\n"
                 "assert topk_nb.kernels is sys.modules['topk_nb.kernels']     # a module, as an attribute\n"
                 "try: topk_nb.no_such_name\n"
                 "except AttributeError as e: print(e)")
    assert out.strip() == "module 'topk_nb' has no attribute 'no_such_name'", out


def test_triton_interprets_without_a_gpu_unless_told_otherwise():
    "Without a CUDA device, Triton's first import after the package's sets TRITON_INTERPRET=1; a value given stays, and Triton imported before the package is left as it is."
    check = ("import os, sys, topk_nb\n"
             "before = os.environ.get('TRITON_INTERPRET')\n"
             "import topk_nb.kernels, torch\n"
             "print(before, os.environ.get('TRITON_INTERPRET'), torch.cuda.is_available(), topk_nb.kernels.HAS_TRITON)")
    before, after, cuda, has_triton = _fresh(check).split()
    assert before == "None"
    if has_triton == "True":
        assert after == ("None" if cuda == "True" else "1")
    assert _fresh(check, TRITON_INTERPRET="0").split()[:2] == ["0", "0"]
    first = "import os, triton, topk_nb, topk_nb.kernels; print(os.environ.get('TRITON_INTERPRET'))"
    try:
        import triton  # noqa: F401
    except ImportError:
        return
    assert _fresh(first).strip() == "None"
