"""Sphinx extension that turns the nbdev project into a documentation site.

At the start of the build (`builder-inited`) it fills the empty source folder with:

* the notebooks of `nbs/` and `nbs/experiments/`, under nbdev's page names (`06_baselines.ipynb` ->
  `baselines`), read with their committed outputs; `source-read` drops the `#| hide` and `#| default_exp`
  cells, strips the `#|` directive lines, shows the output of a `show_doc` cell without the call, and gives
  each exported function and class an anchor named as in nbdev's `_modidx.py` (`baselines.html#ldamloss`):
  on the heading of its `show_doc` output, else before the cell that defines it;
* one API page per module (`reference/<module>.rst`: a summary table, then autodoc of each name of `__all__`);
* the experiment catalogue (`experiments/index.md`), made from `topk_nb.runner.grid.EXPERIMENTS`.

`autodoc-process-docstring` adds to each docstring a link to the chapter that defines the object (the
page and anchor of `_modidx.py`) and turns nbdev's docments (a comment after each parameter of the
signature) into `:param:` fields, which the theme shows as a parameter list.
"""
from __future__ import annotations

import ast
import html
import importlib
import inspect
import json
import re
from configparser import ConfigParser
from pathlib import Path

from docutils.nodes import make_id
from fastcore.docments import docments
from sphinx.util import logging
from sphinx.util.inspect import signature as sphinx_signature, stringify_signature

ROOT = Path(__file__).resolve().parent.parent
_cfg = ConfigParser(delimiters=["="])
_cfg.read(ROOT / "settings.ini", encoding="utf-8")
LIB = _cfg["DEFAULT"]["lib_path"]
NBS = ROOT / _cfg["DEFAULT"]["nbs_path"]

DIRECTIVE = re.compile(r"^\s*#\s*\|\s*([\w-]+)")
DROPPED = {"hide", "default_exp"}            # cells that are not part of the page
SHOW_DOC = re.compile(r"^\s*show_doc\(\s*([\w.]+)", re.MULTILINE)
SHOW_DOC_ONLY = re.compile(r"show_doc\([^\n]*\)")           # a cell that only shows a docstring
CELL_HEADER = re.compile(r"^# %% (\S+\.ipynb)(?: #(\w+))?\s*$", re.MULTILINE)

logger = logging.getLogger(__name__)


def page_name(notebook: Path) -> str:
    "nbdev's page name of a notebook: its stem without the number prefix (`06_baselines` -> `baselines`)."
    return re.sub(r"^\d+[a-zA-Z0-9]*_", "", notebook.stem)


def notebook_title(notebook: Path) -> str:
    "The text of the notebook's first `# ` heading."
    for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] == "markdown":
            match = re.search(r"^#\s+(.+)$", "".join(cell["source"]), re.MULTILINE)
            if match:
                return match.group(1).strip()
    return notebook.stem


def chapters() -> list[Path]:
    "The chapter notebooks in reading order (the front page and the design page apart)."
    return [p for p in sorted(NBS.glob("*.ipynb")) if p.stem not in ("index", "design")]


def experiment_notebooks() -> list[Path]:
    return sorted((NBS / "experiments").glob("*.ipynb"))


def all_notebooks() -> list[Path]:
    return [*chapters(), *experiment_notebooks()]


def modules() -> list[str]:
    "The package's modules that nbdev exports, in the order of their chapters."
    index = importlib.import_module(f"{LIB}._modidx").d
    return sorted(index["syms"], key=lambda m: _module_chapter(m) or m)


def doc_name(notebook: str) -> str:
    "The page of a notebook given relative to `nbs/` (`experiments/level_sets.ipynb` -> `experiments/level_sets`)."
    path = Path(notebook)
    return (path.parent / page_name(path)).as_posix()


def _notebook_of(header: str, module_file: Path) -> str:
    "A cell header's notebook (relative to the module file) as a path relative to `nbs/`."
    return (module_file.parent / header).resolve().relative_to(NBS.resolve()).as_posix()


def _module_chapter(module: str) -> str | None:
    "The notebook, relative to `nbs/`, that a module is exported from (its first cell header)."
    path = ROOT / (module.replace(".", "/") + ".py")
    match = CELL_HEADER.search(path.read_text(encoding="utf-8")) if path.is_file() else None
    return _notebook_of(match.group(1), path) if match else None


def symbol_cells() -> dict[str, tuple[str, str]]:
    "{'topk_nb.mod.name': (notebook relative to nbs/, cell id)} for every top-level name an exported cell defines."
    found = {}
    for path in sorted((ROOT / LIB).rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        parts = CELL_HEADER.split(path.read_text(encoding="utf-8"))
        for notebook, cell_id, code in zip(parts[1::3], parts[2::3], parts[3::3]):
            if not cell_id:
                continue
            try:
                tree = ast.parse(code)
            except SyntaxError:
                continue
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    names = [node.name]
                elif isinstance(node, ast.Assign):
                    names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names = [node.target.id]
                else:
                    names = []
                for name in names:
                    found.setdefault(f"{module}.{name}", (_notebook_of(notebook, path), cell_id))
    return found


def section_ids(notebook: Path) -> set[str]:
    "The ids docutils gives the sections of a notebook (from the text of its markdown headings)."
    ids = set()
    for cell in json.loads(notebook.read_text(encoding="utf-8"))["cells"]:
        if cell["cell_type"] == "markdown":
            ids.update(make_id(m.group(1)) for m in re.finditer(r"^#+\s+(.+)$", _source(cell), re.MULTILINE))
    return ids


def chapter_links() -> dict[str, tuple[str, str]]:
    "{'topk_nb.mod.name': (page, anchor)} from nbdev's `_modidx.py`, for top-level functions and classes."
    index = importlib.import_module(f"{LIB}._modidx").d
    links = {}
    for module, syms in index["syms"].items():
        for name, (url, _source) in syms.items():
            if name.count(".") != module.count(".") + 1:       # methods: the class's entry links them
                continue
            page, _, anchor = url.partition("#")
            links[name] = (page.removesuffix(".html"), anchor)
    return links


class Site:
    "What the build knows about the notebooks: the anchors to put in each, and the chapter link of each symbol."

    def __init__(self):
        self.links = chapter_links()
        sections = {doc_name(p.relative_to(NBS).as_posix()): section_ids(p) for p in all_notebooks()}
        for name, (page, anchor) in self.links.items():
            if anchor in sections.get(page, ()):            # a section of the chapter has that id already
                self.links[name] = (page, f"sym-{anchor}")
        cells = symbol_cells()
        self.anchors: dict[str, dict[str, list[str]]] = {}      # page -> {cell id or 'show_doc:name': [anchors]}
        self.names: dict[tuple[str, str], str] = {}             # (page, short name) -> full name
        for name, (page, anchor) in self.links.items():
            if name not in cells:
                continue
            notebook, cell_id = cells[name]
            if doc_name(notebook) != page:
                continue
            short = name.rsplit(".", 1)[1]
            self.names[(page, short)] = name
            spots = self.anchors.setdefault(page, {})
            spots.setdefault(f"show_doc:{short}", []).append(anchor)
            spots.setdefault(cell_id, []).append(anchor)
        self.placed: dict[str, set[str]] = {}                 # page -> anchors written
        self.linked: set[tuple[str, str]] = set()             # (page, anchor) the API pages link to

    def link(self, name: str) -> tuple[str, str] | None:
        "(page, anchor) of the chapter that defines `name`, if its anchor is on that page."
        where = self.links.get(name)
        if where and where[1] in self.anchors.get(where[0], {}).get(f"show_doc:{name.rsplit('.', 1)[1]}", []):
            return where
        return None

    def process(self, page: str, text: str) -> str:
        "The notebook JSON `text` of `page` as the site shows it (see the module docstring)."
        nb = json.loads(text)
        spots = self.anchors.get(page, {})
        shown = {m for cell in nb["cells"] if cell["cell_type"] == "code"
                 for m in SHOW_DOC.findall(_source(cell)) if "." not in m}
        placed = self.placed.setdefault(page, set())
        cells = []
        for cell in nb["cells"]:
            source = _source(cell)
            anchors = []
            if cell["cell_type"] == "code":
                lines = source.splitlines()
                flags = {m.group(1) for line in lines if (m := DIRECTIVE.match(line))}
                if flags & DROPPED:
                    continue
                source = "\n".join(line for line in lines if not DIRECTIVE.match(line)).strip("\n")
                if not source:
                    continue
                for name in SHOW_DOC.findall(source):
                    if "." not in name:
                        own = [a for a in spots.get(f"show_doc:{name}", []) if a not in placed]
                        cell, used = self.show_doc_output(page, name, cell, own[0] if own else None)
                        placed.update(own[:1] if used else [])
                        anchors += own[1:] if used else own
                    else:                                       # a method (`Class.method`): its output, no anchor
                        cell, _ = self.show_doc_output(page, name, cell, None)
                echo_off = any(re.match(r"^\s*#\s*\|\s*echo:\s*false\s*$", line) for line in lines)
                if SHOW_DOC_ONLY.fullmatch(source.strip()) or echo_off:   # `#| echo: false`: the output alone
                    metadata = cell.get("metadata", {})         # as on nbdev's pages: the output, not the call
                    cell = {**cell, "metadata": {**metadata, "tags": [*metadata.get("tags", []), "remove-input"]}}
                anchors += [a for a in spots.get(cell.get("id"), [])
                            if not any(a in spots.get(f"show_doc:{n}", []) for n in shown)]
                cell = {**cell, "source": source}
            anchors = [a for a in dict.fromkeys(anchors) if a not in placed]
            if anchors:
                placed.update(anchors)
                cells.append({"cell_type": "markdown", "metadata": {},
                              "source": "".join(f'<div id="{a}"></div>\n' for a in anchors)})
            cells.append(cell)
        if page == "index":
            cells.append({"cell_type": "markdown", "metadata": {}, "source": ROOT_TOCTREE})
        for cell in cells:
            cell.pop("id", None)
        nb["cells"] = cells
        nb["nbformat_minor"] = min(nb.get("nbformat_minor", 4), 4)    # cell ids removed
        return json.dumps(nb)

    def show_doc_output(self, page: str, name: str, cell: dict, anchor: str | None) -> tuple[dict, bool]:
        """A show_doc output as the page shows it: no leading rule (docutils allows none in an output), the
        heading as HTML with the symbol's anchor as its id (a markdown heading in an output would become a
        rubric with an id of its own), nbdev's `[source](url){attributes}` line as HTML with a link to the API
        entry. Returns the cell and whether the anchor was used."""
        full = self.names.get((page, name))
        up = "../" * page.count("/")
        api = f' · <a href="{up}reference/{full.rsplit(".", 1)[0]}.html#{full}">API</a>' if full else ""
        outputs, used = [], False
        for output in cell.get("outputs", []):
            markdown = output.get("data", {}).get("text/markdown")
            if markdown is not None:
                text = LEADING_RULE.sub("", _source({"source": markdown}))
                text = SOURCE_LINK.sub(lambda m: f'<p class="showdoc-links"><a href="{m.group(1)}">source</a>{api}</p>', text)
                ident = f' id="{anchor}"' if anchor and not used else ""
                text, found = HEADING.subn(lambda m: f'<h{len(m.group(1))} class="showdoc-name"{ident}>'
                                                     f'{html.escape(m.group(2).strip())}</h{len(m.group(1))}>', text, count=1)
                used = used or bool(found and ident)
                output = {**output, "data": {**output["data"], "text/markdown": text}}
            outputs.append(output)
        return {**cell, "outputs": outputs}, used


HEADING = re.compile(r"^(#{1,6})[ \t]+(.+)$", re.MULTILINE)
LEADING_RULE = re.compile(r"\A\s*---[ \t]*\n")
SOURCE_LINK = re.compile(r"^\[source\]\((\S+?)\)\{[^}\n]*\}[ \t]*$", re.MULTILINE)


def _source(cell) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


ROOT_TOCTREE = """```{toctree}
:hidden:

chapters
experiments/index
reference/index
design
```
"""


# --- the generated pages ------------------------------------------------------------------------------------

def write(path: Path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")


def chapters_page() -> str:
    rows = "\n".join(f"| {{doc}}`{page_name(p)}` | `nbs/{p.name}` |" for p in chapters())
    toc = "\n".join(page_name(p) for p in chapters())
    return f"""# Chapters

The notebooks in `nbs/` in reading order: each derives part of the package, implements it in its exported
cells and checks it. Each exported function and class is also listed in the {{doc}}`API reference <reference/index>`.

| chapter | notebook |
|---|---|
{rows}

```{{toctree}}
:hidden:
:maxdepth: 1

{toc}
```
"""


def api_index_page() -> str:
    rows = []
    for module in modules():
        mod = importlib.import_module(module)
        summary = (mod.__doc__ or "").strip().split("\n")[0]
        chapter = _module_chapter(module)
        link = f"{{doc}}`../{doc_name(chapter)}`" if chapter else ""
        rows.append(f"| {{doc}}`{module} <{module}>` | {summary} | {link} |")
    toc = "\n".join(modules())
    return f"""# API reference

One page per module of the package, made from the exported code: signatures, docstrings, and the parameter
comments in the signatures. Each entry links to the chapter that derives it.

| module | what it holds | chapter |
|---|---|---|
{chr(10).join(rows)}

```{{toctree}}
:hidden:
:maxdepth: 1

{toc}
```
"""


def api_module_page(module: str) -> str:
    "automodule for the module's docstring, a table of its functions and classes, then each name of `__all__`."
    mod = importlib.import_module(module)
    names = list(getattr(mod, "__all__", []))
    routines = [n for n in names if callable(getattr(mod, n, None))]
    constants = [n for n in names if n not in routines]
    chapter = _module_chapter(module)
    lines = [module, "=" * len(module), "", f".. automodule:: {module}", "   :no-members:", ""]
    if chapter:
        lines += [f"Derived in the notebook :doc:`../{doc_name(chapter)}` (``nbs/{chapter}``).", ""]
    if routines:
        lines += [".. list-table::", "   :widths: 30 70", ""]
        for name in routines:
            doc = inspect.getdoc(getattr(mod, name)) or ""
            summary = _rst_escape(doc.strip().split("\n")[0]) if doc else ""
            lines += [f"   * - :py:obj:`{name}`", f"     - {summary}"]
        lines += [""]
    if constants:
        lines += ["Constants: " + ", ".join(f":py:data:`{n}`" for n in constants) + ".", ""]
    for name in names:
        kind = "autoclass" if isinstance(getattr(mod, name, None), type) else \
               "autofunction" if callable(getattr(mod, name, None)) else "autodata"
        lines += [f".. {kind}:: {module}.{name}", ""]
    return "\n".join(lines)


def _fmt_value(value) -> str:
    return repr(value).replace("|", "\\|")


def _preset_line(name: str, grid, data_presets) -> str:
    from topk_nb.runner.grid import expand_grid
    grids = grid if isinstance(grid, list) else [grid]
    runs = len(expand_grid(grid))
    params = " + ".join("`" + ", ".join(f"{k}={_fmt_value(v)}" for k, v in g.items()) + "`" for g in grids)
    data = "; needs the real data (`--data-root`)" if name in data_presets else ""
    return f"* **{name}** ({runs} run{'s' if runs != 1 else ''}{data}): {params}"


def catalogue_page() -> str:
    from topk_nb.runner.grid import EXPERIMENTS
    parts = ["""# Experiments

The experiment catalogue (`EXPERIMENTS` in `topk_nb.runner.grid`): each entry is a parameterised notebook of
`nbs/experiments/`, run over the grid of one of its presets by

```sh
topk-nb run NAME --preset PRESET --out runs      # then: topk-nb report NAME --out runs
```

Each run executes the notebook once per grid cell and records its results; the report compares them with
the numbers and claims of the papers listed for the experiment. The pages below show each notebook with the
outputs of its default (smoke) parameters.
"""]
    for exp in EXPERIMENTS.values():
        page = Path(exp.notebook).stem
        sources = sorted({v.source for v in exp.paper} | {f.source for f in exp.findings})
        checked = []
        if exp.paper:
            checked.append(f"{len(exp.paper)} reported number{'s' if len(exp.paper) != 1 else ''}")
        if exp.findings:
            checked.append(f"{len(exp.findings)} claim{'s' if len(exp.findings) != 1 else ''}")
        parts.append(f"## `{exp.name}`\n\n{_escape_md(exp.description)}\n")
        parts.append(f"Notebook: {{doc}}`{page}` (`nbs/experiments/{exp.notebook}`)\n")
        parts.append("Presets:\n\n" + "\n".join(_preset_line(n, g, exp.data_presets)
                                                  for n, g in exp.presets.items()) + "\n")
        if sources:
            parts.append(f"Paper ({' and '.join(checked)} checked by the report): "
                         + "; ".join(_escape_md(s) for s in sources) + ".\n")
        else:
            parts.append("Paper: none; the report gives the measurements.\n")
    pages = [Path(e.notebook).stem for e in EXPERIMENTS.values()]
    pages += [p.stem for p in experiment_notebooks() if p.stem not in pages]
    parts.append("```{toctree}\n:hidden:\n:maxdepth: 1\n\n" + "\n".join(pages) + "\n```\n")
    return "\n".join(parts)


def _escape_md(text: str) -> str:
    return re.sub(r"([*_\\<>\[\]])", r"\\\1", text)


def stage(app):
    "Fill the source folder: the notebooks under their page names, the API pages and the catalogue."
    src = Path(app.srcdir)
    for notebook in [NBS / "index.ipynb", NBS / "design.ipynb", *chapters()]:
        write(src / f"{page_name(notebook)}.ipynb", notebook.read_text(encoding="utf-8"))
    for notebook in experiment_notebooks():
        write(src / "experiments" / notebook.name, notebook.read_text(encoding="utf-8"))
    write(src / "chapters.md", chapters_page())
    write(src / "reference" / "index.md", api_index_page())
    for module in modules():
        write(src / "reference" / f"{module}.rst", api_module_page(module))
    write(src / "experiments" / "index.md", catalogue_page())


# --- events -------------------------------------------------------------------------------------------------

def on_builder_inited(app):
    app.topk_site = Site()
    stage(app)


def on_source_read(app, docname, source):
    if app.env.doc2path(docname).suffix == ".ipynb":
        source[0] = app.topk_site.process(docname, source[0])


def on_process_docstring(app, what, name, obj, options, lines):
    "Link to the defining chapter, then nbdev's docments as `:param:` / `:returns:` fields."
    if what in ("data", "attribute") and lines and _is_type_doc(obj, lines):
        lines.clear()                                      # a constant has no docstring of its own
    lines[:] = [_rst_escape(line) for line in lines]       # the docstrings are markdown-flavoured text
    extra = []
    where = app.topk_site.link(name) if what in ("function", "class", "data") else None
    if where:
        page, anchor = where
        extra += ["", f"Defined in the chapter `{_rst_escape(CHAPTER_TITLES.get(page, page))} "
                      f"<../{page}.html#{anchor}>`__."]
        app.topk_site.linked.add((page, anchor))
    if what in ("function", "method", "class"):
        try:
            docs = docments(obj, full=True)
        except Exception:                                  # builtins, C extensions: nothing to add
            docs = {}
        fields = []
        for param, info in docs.items():
            text = (info.get("docment") or "").strip()
            if not text:
                continue
            if param == "return":
                fields.append(f":returns: {_rst_escape(text)}")
            elif not any(line.lstrip().startswith(f":param {param}:") for line in lines):
                fields.append(f":param {param}: {_rst_escape(text)}")
                anno = _annotation(info.get("anno"))
                if anno:
                    fields.append(f":type {param}: {_rst_escape(anno)}")
        if fields:
            extra += ["", *fields]
    if extra:
        lines.extend(extra + [""])


def on_process_signature(app, what, name, obj, options, signature, return_annotation):
    "A loss module's signature is its `__init__`'s (autodoc would take the generic `__new__` of `LossModule`)."
    if what != "class" or signature is None or not signature.startswith("(*args, **kwargs)"):
        return None
    try:
        sig = sphinx_signature(obj.__init__, bound_method=True)
    except (TypeError, ValueError):
        return None
    return stringify_signature(sig, show_return_annotation=False), return_annotation


def _annotation(anno) -> str:
    "An annotation as text: the string of a postponed annotation, a class's name, else its repr."
    if anno is None or anno is inspect.Parameter.empty:
        return ""
    if isinstance(anno, str):
        return anno
    return anno.__name__ if isinstance(anno, type) else repr(anno).replace("typing.", "")


def _is_type_doc(obj, lines) -> bool:
    "Whether `lines` is the docstring of the type of `obj` (what autodoc finds for a constant)."
    doc = inspect.getdoc(type(obj)) or ""
    return bool(doc) and doc.splitlines()[0].strip() == lines[0].strip()


def _rst_escape(text: str) -> str:
    "Markdown-flavoured text for reStructuredText: backquoted code stays, stray `*`, `|` and `_` are escaped."
    parts = re.split(r"(`[^`]+`)", text)
    return "".join(p if p.startswith("`") else re.sub(r"([*|\\]|_(?=\W|$))", r"\\\1", p) for p in parts)


CHAPTER_TITLES: dict[str, str] = {}


def on_build_finished(app, exception):
    "Every chapter link of the API pages points at an anchor placed in that chapter; every page's links resolve."
    if exception is not None:
        return
    site = app.topk_site
    for page, anchor in sorted(site.linked):
        if anchor not in site.placed.get(page, set()):
            logger.warning(f"API link to {page}.html#{anchor}: no such anchor was placed in the chapter")
    if app.builder.format == "html":
        check_html(Path(app.outdir))


def check_html(outdir: Path):
    "Warn about an id used twice in a page, and a relative link to a page or an anchor that does not exist."
    pages = {path: path.read_text(encoding="utf-8") for path in sorted(outdir.rglob("*.html"))}
    ids = {path: re.findall(r'\sid="([^"]+)"', text) for path, text in pages.items()}
    for path, text in pages.items():
        where = path.relative_to(outdir)
        twice = sorted({i for i in ids[path] if ids[path].count(i) > 1})
        if twice:
            logger.warning(f"{where}: ids used twice: {', '.join(twice)}")
        for href in sorted(set(re.findall(r'\shref="([^"]+)"', text))):
            if re.match(r"^[a-z][a-z0-9+.-]*:|^//", href) or not (href.split("#")[0].endswith(".html") or href.startswith("#")):
                continue                                  # other sites, and files that are not pages
            target, _, anchor = html.unescape(href).partition("#")
            target_path = (path.parent / target).resolve() if target else path
            if target_path not in pages:
                logger.warning(f"{where}: link to a missing page {href}")
            elif anchor and anchor not in ids[target_path]:
                logger.warning(f"{where}: link to a missing anchor {href}")


def setup(app):
    CHAPTER_TITLES.update({doc_name(p.relative_to(NBS).as_posix()): notebook_title(p) for p in all_notebooks()})
    app.connect("builder-inited", on_builder_inited)
    app.connect("source-read", on_source_read)
    app.connect("autodoc-process-docstring", on_process_docstring)
    app.connect("autodoc-process-signature", on_process_signature)
    app.connect("build-finished", on_build_finished)
    return {"version": "1", "parallel_read_safe": False, "parallel_write_safe": True}
