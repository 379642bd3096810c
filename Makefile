# Two commands do all set-up on a fresh machine:
#   make demo   bootstrap, build, train the sharded transformer on 2 local ranks
#   make test   bootstrap, build, run every test through CTest
BUILD     ?= build
JOBS      ?= $(shell nproc)
CTEST_JOBS ?= $(JOBS)
CMAKE_ARGS ?=
# Fresh clones in other directories reuse the compiler cache.
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1

.PHONY: all bootstrap configure build test demo format lint tidy clean sanitize gpu-check

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
	$(BUILD)/tools/train/fsdp_train --nproc 2

# The unit and distributed tests built with AddressSanitizer and
# UndefinedBehaviorSanitizer in their own build directory (docs/build.md,
# "Sanitizers"). LibTorch is not instrumented; SANITIZE_ASAN_OPTIONS are
# precautions for that (docs/build.md says which were shown to be needed):
#   detect_leaks=0         LibTorch allocations still live at exit are not
#                          ours to report (set detect_leaks=1 to look anyway);
#   protect_shadow_gap=0   the CUDA driver maps memory where ASan's shadow
#                          gap is (only matters on a machine with a GPU);
#   alloc_dealloc_mismatch=0  memory allocated and freed on different sides
#                          of the instrumented/uninstrumented boundary.
# UBSan stops at the first report (-fno-sanitize-recover), so a finding fails
# the test that triggered it. The build runs with the same options because
# gtest_discover_tests runs every test binary once to list its tests.
SANITIZE_BUILD  ?= build-sanitize
SANITIZE_FLAGS  ?= -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
SANITIZE_LABELS ?= unit|distributed
SANITIZE_ASAN_OPTIONS ?= detect_leaks=0:protect_shadow_gap=0:alloc_dealloc_mismatch=0
SANITIZE_ENV = ASAN_OPTIONS=$(SANITIZE_ASAN_OPTIONS) UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
sanitize:
	@$(MAKE) --no-print-directory bootstrap
	cmake -S . -B $(SANITIZE_BUILD) $(CMAKE_ARGS) "-DCMAKE_CXX_FLAGS=$(SANITIZE_FLAGS)" \
	  "-DCMAKE_EXE_LINKER_FLAGS=$(SANITIZE_FLAGS)" "-DCMAKE_SHARED_LINKER_FLAGS=$(SANITIZE_FLAGS)"
	$(SANITIZE_ENV) cmake --build $(SANITIZE_BUILD) -j $(JOBS)
	$(SANITIZE_ENV) ctest --test-dir $(SANITIZE_BUILD) -L '$(SANITIZE_LABELS)' --output-on-failure -j $(CTEST_JOBS)

# Builds with CUDA on, runs the `gpu` tests and the GPU benchmarks, prints one
# report (scripts/gpu_check.sh, docs/gpu.md). Fails clearly without a GPU.
gpu-check:
	@scripts/gpu_check.sh

FORMAT_FILES = $(shell git ls-files '*.h' '*.cc' '*.cpp')
format:
	clang-format -i $(FORMAT_FILES)

# clang-tidy with the checks in .clang-tidy and the build's own flags
# (compile_commands.json, switched on here). TIDY_FILES are regular
# expressions over the (absolute) source paths in the compilation database;
# only files the build compiles are checked. A file that includes LibTorch
# headers takes 15-25 s, so `make tidy` over everything takes about 10 minutes
# and `make lint` only checks the sources that differ from HEAD.
TIDY_FILES ?= $(addprefix $(CURDIR)/,common/src/ collectives/src/ device_mesh/src/ checkpoint/src/ fsdp2/src/ launch/src/ testing/src/ tools/)
TIDY_JOBS  ?= 1
LINT_TIDY_FILES = $(addprefix $(CURDIR)/,$(wildcard $(filter %.cc,$(shell git diff --name-only HEAD 2>/dev/null; \
                    git ls-files --others --exclude-standard 2>/dev/null))))
define run_tidy
	@command -v run-clang-tidy >/dev/null || { echo "tidy: clang-tidy is not installed (apt-get install clang-tidy)"; exit 1; }
	@cmake -S . -B $(BUILD) -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >/dev/null
	@bash -o pipefail -c 'run-clang-tidy -p $(BUILD) -j $(TIDY_JOBS) -quiet $(1) 2>&1 | { grep -v -e "warnings generated" -e "^clang-tidy-[0-9]* " || true; }'
endef

tidy: $(BUILD)/CMakeCache.txt
	$(call run_tidy,$(TIDY_FILES))
	@echo "tidy: clang-tidy clean"

lint: $(BUILD)/CMakeCache.txt
	clang-format --dry-run -Werror $(FORMAT_FILES)
	@echo "lint: clang-format clean"
ifneq ($(strip $(LINT_TIDY_FILES)),)
	$(call run_tidy,$(LINT_TIDY_FILES))
	@echo "lint: clang-tidy clean on the changed sources the build compiles"
else
	@echo "lint: no changed .cc files for clang-tidy (make tidy checks them all)"
endif

clean:
	rm -rf $(BUILD)
