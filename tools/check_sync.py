"""Fail if `nbdev_export` or `nbdev_clean` would change the package or the notebooks, or README.md is stale.

Works on file contents (no git needed): hashes before and after running the two commands. When it
fails, the working tree holds the corrected files, ready to review and commit.
"""
import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def snapshot() -> dict[str, str]:
    files = [*ROOT.glob("topk_nb/**/*.py"), *ROOT.glob("nbs/**/*.ipynb")]
    return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in files if ".ipynb_checkpoints" not in p.parts}


def main() -> int:
    before = snapshot()
    for cmd in (["nbdev_export"], ["nbdev_clean"]):
        subprocess.run(cmd, cwd=ROOT, check=True)
    after = snapshot()
    changed = sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))
    status = 0
    if changed:
        print("nbdev_export / nbdev_clean changed these files (commit the result):", *changed, sep="\n  ", file=sys.stderr)
        status = 1
    readme = subprocess.run([sys.executable, str(ROOT / "tools" / "build_readme.py"), "--check"], cwd=ROOT)
    status |= readme.returncode
    if status == 0:
        print("package, notebooks and README are in sync")
    return status


if __name__ == "__main__":
    sys.exit(main())
