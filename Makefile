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

run:      ## the main job: Sawada's synthetic experiments 1-3, full paper grid on a CPU; records, notebooks and report in runs/
	topk-nb run circles_tradeoffs --preset paper --jobs 2 --out runs
	topk-nb report circles_tradeoffs --out runs
