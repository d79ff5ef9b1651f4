# The two commands of the README:
#   make run   builds and runs the main job (attnkit on the best available backend)
#   make test  builds and runs every test (C++ cpu + gpu labels, Python, clang-format check)
# Both install what is missing first (Debian packages, PyPI packages). CI also runs
#   make test-sanitize  the cpu tests of an ASan + UBSan build without CUDA (clang, build-sanitize/)
#   make fuzz-smoke     the libFuzzer targets of that build, FUZZ_SECONDS (60) each
# (docs/safety.md), and
#   make test-pip       a CPU-only `pip install .` into a fresh virtual environment, then the
#                       installed `attnkit` command and Python package (scripts/pip_check.sh)

BUILD_DIR ?= build
JOBS ?= $(shell nproc)
# CUDA is built whenever nvcc is found; CI compiles the documented kernel subset.
CMAKE_FLAGS ?=
ifeq ($(CI),true)
CMAKE_FLAGS += -DATTNKIT_KERNEL_SUBSET=ON
endif

.PHONY: all deps build run test test-cpp test-python format-check format clean test-sanitize \
	fuzz-smoke test-pip

all: build

deps:
	@scripts/install_deps.sh

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja $(CMAKE_FLAGS)

build: deps $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(JOBS)

# The main job: self-test, device report, then the serving-trace replay (docs/replay.md; the
# reference backend at a reduced size without a GPU). REPLAY_ARGS passes options to it.
REPLAY_ARGS ?=
run: build
	./$(BUILD_DIR)/attnkit check
	./$(BUILD_DIR)/attnkit info
	./$(BUILD_DIR)/attnkit replay $(REPLAY_ARGS)

test-cpp: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

# The pytest suite over the extension built into $(BUILD_DIR)/python/attnkit (no pip needed). A
# build directory configured before nanobind was installed is reconfigured to add the extension.
test-python: build
	@ls $(BUILD_DIR)/python/attnkit/_attnkit*.so >/dev/null 2>&1 || \
	  { cmake -S . -B $(BUILD_DIR) -DATTNKIT_BUILD_PYTHON=ON && cmake --build $(BUILD_DIR) -j $(JOBS); }
	PYTHONPATH=$(BUILD_DIR)/python python3 -m pytest -q python/tests

format-check: deps
	@scripts/format.sh --check

format:
	@scripts/format.sh

test: format-check test-cpp
	$(MAKE) --no-print-directory test-python

# Host code under AddressSanitizer + UndefinedBehaviorSanitizer, CPU only, in one clang build
# (docs/safety.md): the library, the attnkit program, the C++ cpu tests and the libFuzzer targets.
# test-sanitize runs the cpu tests there (every sanitizer report fails its test); fuzz-smoke runs
# each fuzz target for FUZZ_SECONDS over a scratch copy of its committed corpus.
SANITIZE_BUILD_DIR ?= build-sanitize
SANITIZE_CXX ?= clang++
FUZZ_SECONDS ?= 60
SANITIZE_ENV = ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:strict_init_order=1 \
	UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1

$(SANITIZE_BUILD_DIR)/build.ninja:
	cmake -S . -B $(SANITIZE_BUILD_DIR) -G Ninja -DCMAKE_BUILD_TYPE=Debug \
	  -DCMAKE_CXX_COMPILER=$(SANITIZE_CXX) -DATTNKIT_WITH_CUDA=OFF \
	  -DATTNKIT_SANITIZE=address,undefined \
	  -DATTNKIT_BUILD_FUZZERS=$(if $(findstring clang,$(SANITIZE_CXX)),ON,OFF) \
	  -DATTNKIT_BUILD_PYTHON=OFF -DATTNKIT_BUILD_BENCH=OFF

test-sanitize: deps $(SANITIZE_BUILD_DIR)/build.ninja
	cmake --build $(SANITIZE_BUILD_DIR) -j $(JOBS)
	cd $(SANITIZE_BUILD_DIR) && $(SANITIZE_ENV) ctest --output-on-failure -j $(JOBS) -L cpu

fuzz-smoke: deps $(SANITIZE_BUILD_DIR)/build.ninja
	cmake --build $(SANITIZE_BUILD_DIR) -j $(JOBS) --target attnkit_fuzz_config attnkit_fuzz_entry
	$(SANITIZE_ENV) scripts/fuzz_smoke.sh $(SANITIZE_BUILD_DIR) $(FUZZ_SECONDS)

PIP_BUILD_DIR ?= build-pip
test-pip: deps
	scripts/pip_check.sh $(PIP_BUILD_DIR)

clean:
	rm -rf $(BUILD_DIR) $(SANITIZE_BUILD_DIR) $(PIP_BUILD_DIR)
