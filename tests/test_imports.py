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
