# Developer tasks. `make test` is the test command of the README and of CI.
PYTHON ?= python

.PHONY: test sync nbtest pytest export clean readme run

test: sync nbtest pytest

sync:     ## fail if nbdev_export / nbdev_clean would change files, or README.md is stale
	$(PYTHON) tools/check_sync.py

nbtest:   ## execute every notebook (cells flagged slow or gpu are skipped)
	nbdev_test --n_workers 2

pytest:
	$(PYTHON) -m pytest tests

export:
	nbdev_export

clean:
	nbdev_clean

readme:
	$(PYTHON) tools/build_readme.py

run:      ## the main job, on its embedded default data (no download); executed notebooks land in runs/
	mkdir -p runs
	papermill nbs/01_esp.ipynb runs/01_esp.ipynb
