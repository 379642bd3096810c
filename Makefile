# Two commands do all set-up on a fresh machine:
#   make demo   bootstrap, build, run the main job on 2 local ranks
#   make test   bootstrap, build, run every test through CTest
BUILD     ?= build
JOBS      ?= $(shell nproc)
CTEST_JOBS ?= $(JOBS)
CMAKE_ARGS ?=
# Fresh clones in other directories reuse the compiler cache.
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1

.PHONY: all bootstrap configure build test demo format lint clean

all: build

bootstrap:
	@scripts/bootstrap.sh

$(BUILD)/CMakeCache.txt:
	@$(MAKE) --no-print-directory bootstrap
	cmake -S . -B $(BUILD) $(CMAKE_ARGS)

configure: bootstrap
	cmake -S . -B $(BUILD) $(CMAKE_ARGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(CTEST_JOBS)

demo: build
	$(BUILD)/tools/fsdp_demo

FORMAT_FILES = $(shell git ls-files '*.h' '*.cc' '*.cpp')
format:
	clang-format -i $(FORMAT_FILES)

lint: $(BUILD)/CMakeCache.txt
	clang-format --dry-run -Werror $(FORMAT_FILES)
	@echo "lint: clang-format clean"

clean:
	rm -rf $(BUILD)
