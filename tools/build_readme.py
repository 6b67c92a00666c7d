"""Build README.md from nbs/index.ipynb (Quarto-free replacement for `nbdev_readme`).

The notebook is executed so that the README shows fresh outputs; cells marked `#| hide` are dropped
and nbdev directives are stripped from the code that is shown. `--check` exits 1 if README.md is stale.
"""
import argparse
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbconvert import MarkdownExporter

from topk_nb.runner.batch import kernel_config

ROOT = Path(__file__).resolve().parent.parent
DIRECTIVE = re.compile(r"^\s*#\s*\|.*$\n?", re.MULTILINE)


def merge_streams(outputs: list) -> list:
    "Join consecutive stream outputs of the same stream: how the kernel splits printed text into chunks depends on timing (load)."
    merged = []
    for out in outputs:
        last = merged[-1] if merged else None
        if (out.get("output_type") == "stream" and last is not None and last.get("output_type") == "stream"
                and last.get("name") == out.get("name")):
            last["text"] = last["text"] + out["text"]
        else:
            merged.append(out)
    return merged


def render() -> str:
    nb = nbformat.read(ROOT / "nbs" / "index.ipynb", as_version=4)
    NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "nbs")}},
                   config=kernel_config()).execute()
    cells = []
    for cell in nb.cells:
        if cell.cell_type == "code":
            if re.search(r"^\s*#\s*\|\s*(hide|default_exp)", cell.source, re.MULTILINE):
                continue
            if re.search(r"^\s*#\s*\|\s*echo:\s*false\s*$", cell.source, re.MULTILINE):   # the output alone, as markdown
                text = "".join(out.get("data", {}).get("text/markdown", "") or out.get("text", "") for out in cell.get("outputs", []))
                cells.append(nbformat.v4.new_markdown_cell(text))
                continue
            cell.source = DIRECTIVE.sub("", cell.source)
            cell.outputs = merge_streams(cell.get("outputs", []))
            for out in cell.outputs:
                out.pop("execution_count", None)
            cell.execution_count = None
        cells.append(cell)
    nb.cells = cells
    body, _ = MarkdownExporter().from_notebook_node(nb)
    body = re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"
    note = "<!-- Generated from nbs/index.ipynb by tools/build_readme.py: edit the notebook, not this file. -->\n\n"
    return note + body


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if README.md differs from the rendered notebook")
    args = parser.parse_args()
    text = render()
    readme = ROOT / "README.md"
    if args.check:
        if not readme.exists() or readme.read_text(encoding="utf-8") != text:
            print("README.md is out of date with nbs/index.ipynb: run `make readme`.", file=sys.stderr)
            return 1
        return 0
    readme.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
