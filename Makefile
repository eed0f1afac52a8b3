# The two entry points the README opens with. Both set up .venv/ first (idempotent).
.PHONY: setup demo test lint docs

setup:
	bash scripts/setup.sh

demo: setup
	.venv/bin/versioned-lora demo

test: setup
	bash scripts/test.sh

lint: setup
	.venv/bin/ruff check versioned_lora tests model_checks gpu_validation scripts
	.venv/bin/mypy --strict versioned_lora/spec versioned_lora/lifecycle versioned_lora/runtime versioned_lora/adapters \
		versioned_lora/capabilities.py

docs: setup
	.venv/bin/python -m versioned_lora.spec.docs
