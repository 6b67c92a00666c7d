"""Sphinx configuration of the documentation site (`make docs`).

The sources are not in this folder: `sphinx-build -c docs _proc/docs _proc/html` (then moved to `_docs`)
reads this file, and the `topk_docs` extension beside it fills the empty source folder `_proc/docs` at the
start of the build with
the notebooks of `nbs/` (under nbdev's page names: `nbs/06_baselines.ipynb` -> `baselines.html`), one API
page per module of the package, and the experiment catalogue. The notebooks are rendered with their
committed outputs; nothing is executed.
"""
import sys
from configparser import ConfigParser
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent
sys.path.insert(0, str(DOCS))          # the topk_docs extension
sys.path.insert(0, str(ROOT))          # the package of this source tree, whatever is installed

_cfg = ConfigParser(delimiters=["="])
_cfg.read(ROOT / "settings.ini", encoding="utf-8")
_cfg = _cfg["DEFAULT"]

project = _cfg["title"]
author = _cfg["author"]
copyright = _cfg["copyright"]
release = version = _cfg["version"]

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.mathjax",
    "topk_docs",
]

root_doc = "index"
exclude_patterns = []
templates_path = []

# Notebooks: the committed outputs, never re-executed; nbdev's markdown is CommonMark with $-math.
nb_execution_mode = "off"
nb_merge_streams = True
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence"]
myst_dmath_double_inline = True   # a $$...$$ display inside a paragraph (the chapters' habit, as Jupyter renders it)
suppress_warnings = ["mystnb.unknown_mime_type"]

# API reference: signatures and docstrings of the exported code; nbdev's docments become parameter lists.
autodoc_default_options = {"members": True, "undoc-members": True, "no-value": True, "member-order": "bysource"}
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
autodoc_inherit_docstrings = False   # torch's docstrings of the methods a class overrides are not ours
add_module_names = False

# MathJax from the site itself (readers may be offline): `make docs` unpacks MathJax 3 into _proc/mathjax,
# which is copied to _static/mathjax.
STATIC = ROOT / "_proc" / "static"
if not (STATIC / "mathjax" / "tex-chtml.js").is_file():
    raise RuntimeError(f"MathJax is missing from {STATIC / 'mathjax'}: build the site with `make docs`, which unpacks it there")
html_static_path = [str(STATIC), "static"]
html_css_files = ["topk_docs.css"]
mathjax_path = "mathjax/tex-chtml.js"
default_role = "literal"               # `name` in the docstrings is code, as in their markdown

html_theme = "pydata_sphinx_theme"
html_title = project
html_last_updated_fmt = None
html_copy_source = False
html_show_sourcelink = False
html_theme_options = {
    "github_url": _cfg["git_url"],
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 6,
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_sidebars = {"index": []}
html_context = {"default_mode": "light"}
html_favicon = "favicon.svg"
