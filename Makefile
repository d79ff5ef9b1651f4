# The two commands of the README:
#   make run   builds and runs the main job (attnkit on the best available backend)
#   make test  builds and runs every test (C++ cpu + gpu labels, Python, clang-format check)
# Both install what is missing first (Debian packages, PyPI packages).

BUILD_DIR ?= build
JOBS ?= $(shell nproc)
# CUDA is built whenever nvcc is found; CI compiles the documented kernel subset.
CMAKE_FLAGS ?=
ifeq ($(CI),true)
CMAKE_FLAGS += -DATTNKIT_KERNEL_SUBSET=ON
endif

.PHONY: all deps build run test test-cpp test-python format-check format clean

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

clean:
	rm -rf $(BUILD_DIR)
