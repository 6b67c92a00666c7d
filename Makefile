# Developer tasks. `make test` is the test command of the README and of CI.
PYTHON ?= python

.PHONY: test sync nbtest pytest export clean readme run outputs gpu-check

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

outputs:  ## re-execute NB="nbs/a.ipynb nbs/b.ipynb" in place (slow cells keep their outputs; SLOW=--slow runs them), then clean
	$(PYTHON) tools/refresh_outputs.py $(NB) $(SLOW)
	nbdev_clean

run:      ## the main job: Sawada's synthetic experiments 1-3, full paper grid on a CPU; records, notebooks and report in runs/
	topk-nb run circles_tradeoffs --preset paper --jobs 2 --out runs
	topk-nb report circles_tradeoffs --out runs

gpu-check: ## on a CUDA machine: every loss's float32 correctness, host syncs, speed vs cross-entropy, epoch overhead, torch.compile, CUDA graphs; writes results/gpu/<device>-<date>.json and .md (GPU_CHECK_FLAGS=--quick for a short run)
	$(PYTHON) -m topk_nb.gpucheck --out results/gpu $(GPU_CHECK_FLAGS)
