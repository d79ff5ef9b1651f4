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

.PHONY: all deps build run test test-cpp format-check format clean

all: build

deps:
	@scripts/install_deps.sh

$(BUILD_DIR)/build.ninja:
	cmake -S . -B $(BUILD_DIR) -G Ninja $(CMAKE_FLAGS)

build: deps $(BUILD_DIR)/build.ninja
	cmake --build $(BUILD_DIR) -j $(JOBS)

run: build
	./$(BUILD_DIR)/attnkit check
	./$(BUILD_DIR)/attnkit info

test-cpp: build
	cd $(BUILD_DIR) && ctest --output-on-failure -j $(JOBS)

format-check: deps
	@scripts/format.sh --check

format:
	@scripts/format.sh

test: format-check test-cpp

clean:
	rm -rf $(BUILD_DIR)
