"""Re-execute notebooks in place so that their committed outputs (what the README and the documentation show)
match the code. Cells flagged `#| slow` or `#| gpu` keep their committed outputs unless --slow is given.

    python tools/refresh_outputs.py nbs/08_losses.ipynb nbs/14_bench.ipynb [--slow]

Run `nbdev_clean` afterwards (`make outputs` does both).
"""
import argparse
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from topk_nb.runner.batch import kernel_config

FLAG = re.compile(r"^\s*#\s*\|\s*(slow|gpu)\b", re.MULTILINE)


def refresh(path: Path, slow: bool) -> int:
    "Execute the notebook's code cells in order (flagged ones only with `slow`) and write it back; returns the count executed."
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=3600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                            config=kernel_config())
    executed = 0
    with client.setup_kernel():
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code" or (FLAG.search(cell.source) and not slow):
                continue
            client.execute_cell(cell, index)
            executed += 1
    nbformat.write(nb, path)
    return executed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path, help="notebooks to re-execute in place")
    parser.add_argument("--slow", action="store_true", help="also run the cells flagged slow or gpu")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        print(f"refresh_outputs: no such notebook: {', '.join(missing)}", file=sys.stderr)
        return 2
    for path in args.notebooks:
        print(f"{path}: {refresh(path, args.slow)} cells executed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
