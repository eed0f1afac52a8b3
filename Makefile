# The two entry points the README opens with. Both set up .venv/ first (idempotent). .ci/run runs make test, then
# make lint.
.PHONY: setup demo test test-fast check-deep lint docs

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/versioned-lora demo

test: setup
	bash scripts/test.sh

# For development: the core, the model checks and the engine basics (scripts/test.sh), under 15 minutes.
test-fast: setup
	bash scripts/test.sh --fast

# The seed campaigns (mutants of the spec and of the drivers on seed 1) and the checker's every entry (model_checks/
# suite.py: make test checks SMOKE_BOUNDS, every entry but DEEP_ONLY), out of `make test`, which keeps a fixed-seed
# smoke of each. About 40 minutes on the 2-core host: run apart (not by .ci/run, whose 90 minutes make test and
# make lint would not leave it), its output committed under benchmarks/results/.
check-deep: setup
	.venv/bin/python -m pytest --tb=native -p no:cacheprovider -m deep tests/model_checks

lint: setup
	.venv/bin/ruff check versioned_lora tests model_checks gpu_validation scripts
	.venv/bin/mypy --strict versioned_lora/spec versioned_lora/lifecycle versioned_lora/runtime versioned_lora/adapters \
		versioned_lora/capabilities.py

docs: setup
	.venv/bin/python -m versioned_lora.spec.docs
