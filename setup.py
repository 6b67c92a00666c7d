"""Packaging for topk_nb: every field comes from settings.ini, the nbdev project file."""
import shutil
from configparser import ConfigParser
from pathlib import Path

import setuptools
from setuptools.command.build_py import build_py

cfg = ConfigParser(delimiters=["="])
cfg.read("settings.ini", encoding="utf-8")
cfg = cfg["DEFAULT"]

licenses = {"apache2": "Apache-2.0"}   # SPDX identifiers
statuses = ["1 - Planning", "2 - Pre-Alpha", "3 - Alpha", "4 - Beta", "5 - Production/Stable"]
py_versions = ["3.10", "3.11", "3.12", "3.13", "3.14"]
min_python = cfg["min_python"]



class BuildWithExperiments(build_py):
    "Build the package with the experiment notebooks (nbs/experiments/*.ipynb) as its data, in topk_nb/experiments/."

    def run(self):
        super().run()
        if self.editable_mode:                     # an editable install reads them from nbs/experiments
            return
        target = Path(self.build_lib) / cfg["lib_path"] / "experiments"
        target.mkdir(parents=True, exist_ok=True)
        for notebook in sorted(Path(cfg["nbs_path"], "experiments").glob("*.ipynb")):
            shutil.copy2(notebook, target / notebook.name)


setuptools.setup(
    name=cfg["lib_name"],
    version=cfg["version"],
    description=cfg["description"],
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    author=cfg["author"],
    author_email=cfg["author_email"],
    url=cfg["git_url"],
    license=licenses[cfg["license"]],
    keywords=cfg["keywords"].split(),
    classifiers=[
        "Development Status :: " + statuses[int(cfg["status"]) - 1],
        "Intended Audience :: " + cfg["audience"],
        "Natural Language :: " + cfg["language"],
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ] + ["Programming Language :: Python :: " + v for v in py_versions[py_versions.index(min_python):]],
    python_requires=">=" + min_python,
    packages=setuptools.find_packages(include=[cfg["lib_path"], cfg["lib_path"] + ".*"]),
    py_modules=["topk_nb_entry"],   # the console script: its signal handlers come before the package's imports
    include_package_data=True,
    install_requires=cfg["requirements"].split(),
    extras_require={"dev": cfg["dev_requirements"].split() + cfg["experiments_requirements"].split()
                           + cfg["docs_requirements"].split(),
                    "experiments": cfg["experiments_requirements"].split(),
                    "docs": cfg["docs_requirements"].split()},
    entry_points={
        "console_scripts": cfg.get("console_scripts", "").split(),
        "nbdev": [f"{cfg['lib_path']}={cfg['lib_path']}._modidx:d"],
    },
    zip_safe=False,
    cmdclass={"build_py": BuildWithExperiments},
)
