# Two commands do all set-up on a fresh machine:
#   make demo   bootstrap, build the trainer, train the sharded transformer on 2 local ranks
#   make test   bootstrap, build, run every test through CTest
# The torch to build against (docs/build.md, "Torch versions"): 2.11.0, the
# version the GPU machines carry, unless TORCH_VERSION names another of
# 2.11-2.15. Another version gets its own virtual env and build directories
# (TORCH_VERSION=2.15.0 make test: .venv-torch2.15.0, build-torch2.15.0), so
# the default ones are untouched and switching back costs no rebuild.
DEFAULT_TORCH_VERSION := 2.11.0
TORCH_VERSION ?= $(DEFAULT_TORCH_VERSION)
ifeq ($(TORCH_VERSION),$(DEFAULT_TORCH_VERSION))
TORCH_SUFFIX :=
else
TORCH_SUFFIX := -torch$(TORCH_VERSION)
endif
FSDP2CPP_VENV ?= .venv$(TORCH_SUFFIX)
BUILD     ?= build$(TORCH_SUFFIX)
# bootstrap.sh reads both; CMake is told where the virtual env is.
export TORCH_VERSION FSDP2CPP_VENV
CMAKE_TORCH_ARGS = -DFSDP2CPP_VENV=$(abspath $(FSDP2CPP_VENV))
JOBS      ?= $(shell nproc)
CTEST_JOBS ?= $(JOBS)
CMAKE_ARGS ?=
# Fresh clones in other directories reuse the compiler cache.
export CCACHE_BASEDIR := $(CURDIR)
export CCACHE_NOHASHDIR := 1

.PHONY: all bootstrap configure build test demo format lint tidy clean sanitize gpu-check sanitize-core tsan

all: build

bootstrap:
	@scripts/bootstrap.sh

$(BUILD)/CMakeCache.txt:
	@$(MAKE) --no-print-directory bootstrap
	cmake -S . -B $(BUILD) $(CMAKE_TORCH_ARGS) $(CMAKE_ARGS)

configure: bootstrap
	cmake -S . -B $(BUILD) $(CMAKE_TORCH_ARGS) $(CMAKE_ARGS)

build: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS)

test: build
	ctest --test-dir $(BUILD) --output-on-failure -j $(CTEST_JOBS)

# Builds only the trainer and the libraries it links, not the tests.
demo: $(BUILD)/CMakeCache.txt
	cmake --build $(BUILD) -j $(JOBS) --target fsdp_train
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
# SANITIZE_OPT replaces RelWithDebInfo's -O2 -g: a sanitized translation unit
# compiles in about half the time at -O1 -g1 (line tables only, enough for
# the file:line of every frame in a report), and -O1 is what the sanitizers'
# own documentation recommends (docs/build.md, "Sanitizers").
SANITIZE_BUILD  ?= build-sanitize$(TORCH_SUFFIX)
SANITIZE_FLAGS  ?= -fsanitize=address,undefined -fno-sanitize-recover=undefined -fno-omit-frame-pointer
SANITIZE_OPT    ?= -O1 -g1 -DNDEBUG
SANITIZE_LABELS ?= unit|distributed
SANITIZE_ASAN_OPTIONS ?= detect_leaks=0:protect_shadow_gap=0:alloc_dealloc_mismatch=0
SANITIZE_ENV = ASAN_OPTIONS=$(SANITIZE_ASAN_OPTIONS) UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
# $(call sanitized_configure,DIR,FLAGS)
define sanitized_configure
	cmake -S . -B $(1) $(CMAKE_TORCH_ARGS) $(CMAKE_ARGS) "-DCMAKE_CXX_FLAGS=$(2)" "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=$(SANITIZE_OPT)" \
	  "-DCMAKE_EXE_LINKER_FLAGS=$(2)" "-DCMAKE_SHARED_LINKER_FLAGS=$(2)"
endef
# $(call sanitized_ctest,ENV,DIR,TEST-SUBDIRS): ctest in each tests/ subfolder
# of the build, so only that layer's tests are candidates; the label filter
# then keeps the tests of the binaries that were built (a gtest binary that
# was not built only stands as an unlabelled <target>_NOT_BUILT test).
define sanitized_ctest
	set -e; for d in $(3); do $(1) ctest --test-dir $(2)/tests/$$d -L '$(SANITIZE_LABELS)' \
	  --output-on-failure -j $(CTEST_JOBS); done
endef
sanitize:
	@$(MAKE) --no-print-directory bootstrap
	$(call sanitized_configure,$(SANITIZE_BUILD),$(SANITIZE_FLAGS))
	$(SANITIZE_ENV) cmake --build $(SANITIZE_BUILD) -j $(JOBS)
	$(SANITIZE_ENV) ctest --test-dir $(SANITIZE_BUILD) -L '$(SANITIZE_LABELS)' --output-on-failure -j $(CTEST_JOBS)

# The same sanitizers over the core layers only (docs/build.md, "Sanitizers",
# has its times; .ci/run runs it after make test when time allows): every collectives and device_mesh test and
# three fsdp2 binaries (the two unit ones and the end-to-end training test).
# Builds only these targets and the libraries they need (common,
# stream_check, collectives, device_mesh, fsdp2, testing).
SANITIZE_CORE_TARGETS ?= collectives_unit_test flight_recorder_test collectives_distributed_test collectives_srun_test \
                         device_mesh_unit_test device_mesh_distributed_test \
                         fsdp2_module_call_test fsdp2_reduce_ops_test fsdp2_training_test
SANITIZE_CORE_DIRS    ?= collectives device_mesh fsdp2
sanitize-core:
	@$(MAKE) --no-print-directory bootstrap
	$(call sanitized_configure,$(SANITIZE_BUILD),$(SANITIZE_FLAGS))
	$(SANITIZE_ENV) cmake --build $(SANITIZE_BUILD) -j $(JOBS) --target $(SANITIZE_CORE_TARGETS)
	$(call sanitized_ctest,$(SANITIZE_ENV),$(SANITIZE_BUILD),$(SANITIZE_CORE_DIRS))

# ThreadSanitizer over the multi-process collectives and fsdp2 tests, in its
# own build directory. Every rank of these tests is a process, but each runs
# threads: the runtime's divergence watchdog, Gloo's and c10d's worker
# threads, the harness's. LibTorch, c10d and gloo are not instrumented: TSan
# sees their mutexes (pthread calls are intercepted everywhere) but not their
# memory accesses or atomics (reference counts above all), so
# scripts/tsan.supp silences the reports that involve a LibTorch frame and
# libstdc++'s exception_ptr, each entry with its reason (docs/build.md).
TSAN_BUILD   ?= build-tsan$(TORCH_SUFFIX)
TSAN_FLAGS   ?= -fsanitize=thread -fno-omit-frame-pointer
TSAN_TARGETS ?= collectives_distributed_test fsdp2_training_test fsdp2_divergence_test
TSAN_DIRS    ?= collectives fsdp2
TSAN_ENV = TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 suppressions=$(CURDIR)/scripts/tsan.supp"
tsan:
	@$(MAKE) --no-print-directory bootstrap
	$(call sanitized_configure,$(TSAN_BUILD),$(TSAN_FLAGS))
	$(TSAN_ENV) cmake --build $(TSAN_BUILD) -j $(JOBS) --target $(TSAN_TARGETS)
	$(call sanitized_ctest,$(TSAN_ENV),$(TSAN_BUILD),$(TSAN_DIRS))

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
	@cmake -S . -B $(BUILD) $(CMAKE_TORCH_ARGS) -DCMAKE_EXPORT_COMPILE_COMMANDS=ON >/dev/null
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
