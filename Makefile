# Developer tasks. `make test` is the test command of the README and of CI.
PYTHON ?= python

.PHONY: test sync nbtest pytest export clean readme run outputs gpu-check gpu-test docs docs-check

# The export check first (a stale export stops here); then the notebooks, the tests and the documentation side by side:
# each of them waits at times (kernels starting, subprocesses, the Slurm queue) and the cores stay busy. Each one's
# output is printed whole when it ends.
test: sync
	$(MAKE) --no-print-directory -j3 --output-sync=target nbtest pytest docs

sync:     ## fail if nbdev_export / nbdev_clean would change files, or README.md is stale
	$(PYTHON) tools/check_sync.py

# One CPU thread a process for the test command: its processes already share the cores, and PyTorch's OpenMP threads,
# two a process where five processes share two cores, spin waiting for one another (chapter 05b's million-class memory
# check took 81 s so, 23 s with one thread). TEST_THREADS=0 keeps PyTorch's default.
TEST_THREADS ?= 1
THREADS = $(if $(filter 0,$(TEST_THREADS)),,OMP_NUM_THREADS=$(TEST_THREADS))

nbtest:   ## execute every notebook (cells flagged slow or gpu are skipped), then list each one's seconds, slowest first
	$(THREADS) nbdev_test --n_workers 2 --timing

# pytest-xdist (part of the dev install): the tests on every core, PYTEST_WORKERS processes (auto: one a core), in the
# groups tests/conftest.py names; without it, in one process. The 20 slowest tests are listed at the end.
PYTEST_WORKERS ?= auto
XDIST = $(shell $(PYTHON) -c "import xdist" 2>/dev/null && echo yes)

pytest:
	$(THREADS) $(PYTHON) -m pytest tests $(if $(XDIST),-n $(PYTEST_WORKERS) --dist loadgroup) --durations=20

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

gpu-test: ## on a CUDA machine, from a source checkout with torch and pytest: the kernel tests compiled for the GPU and the CUDA-only checks, one line per test (a run cut short still names what ran), on 8 processes where pytest-xdist is installed (the kernels compile side by side); the CPU's compile-for-sm_90 tests are left to the CPU, since here every kernel compiles for the real GPU
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m pytest tests/test_kernels.py tests/test_cuda.py $(if $(XDIST),-n 8) -v -rf -p no:cacheprovider --deselect tests/test_kernels.py::test_svm_kernels_compile_for_a_gpu --deselect tests/test_kernels.py::test_row_kernels_compile_for_a_gpu

gpu-check: ## on a CUDA machine: every loss's float32 correctness, host syncs, speed vs cross-entropy, epoch overhead, torch.compile, CUDA graphs; writes results/gpu/<device>-<date>.json and .md (GPU_CHECK_FLAGS=--quick for a short run)
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m topk_nb.perf.gpucheck --out results/gpu $(GPU_CHECK_FLAGS)

MATHJAX_VERSION = 3.2.2
MATHJAX = _proc/static/mathjax

docs: $(MATHJAX)/tex-chtml.js  ## the documentation site in _docs/ (Sphinx, myst-nb; notebooks with their committed outputs, nothing executed; sources: docs/)
	rm -rf _proc/docs _proc/doctrees _proc/html _proc/jupyter_execute && mkdir -p _proc/docs
	$(PYTHON) -m sphinx -b html -W --keep-going -q -c docs -d _proc/doctrees _proc/docs _proc/html
	rm -rf _docs && mv _proc/html _docs

$(MATHJAX)/tex-chtml.js:  # MathJax 3 from the npm registry: the TeX-to-HTML bundle and what it loads, served by the site itself
	rm -rf _proc/mathjax-npm $(MATHJAX) && mkdir -p _proc/mathjax-npm $(MATHJAX)
	cd _proc/mathjax-npm && npm pack --silent mathjax@$(MATHJAX_VERSION) >/dev/null && tar -xzf mathjax-$(MATHJAX_VERSION).tgz
	cd _proc/mathjax-npm/package/es5 && cp -r tex-chtml.js input output a11y adaptors sre ui ../../../../$(MATHJAX)/
	cp _proc/mathjax-npm/package/LICENSE $(MATHJAX)/
	rm -rf _proc/mathjax-npm

docs-check: docs  ## headless Chromium on the built site: pages load without console errors, equations typeset; screenshots in _docs_shots/
	$(PYTHON) docs/check_site.py _docs --shots _docs_shots
