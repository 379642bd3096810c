#!/usr/bin/env bash
# The offline build path, end to end on this (networked) machine:
#   1. scripts/fetch_debs.sh downloads the .debs (kept in WORK between runs),
#   2. bootstrap.sh unpacks them into a prefix (FSDP2CPP_DEBS, no apt, no pip),
#   3. a fresh CPU-only configure of the project finds every Debian package
#      in that prefix (checked in the CMake cache) and builds the collectives
#      library (with fsdp2cpp_common, which links spdlog);
#   4. tests/offline/probe, a small project using the same prefix logic,
#      compiles and runs a test that uses Abseil, spdlog, fmt, GoogleTest,
#      GMock, gloo and nlohmann JSON.
# Both read those headers from the prefix only (checked in the compiler's
# dependency files: the system's copies in /usr/include are also on this
# machine) and load spdlog from it (ldd).
# usage: offline_build_test.sh SOURCE_DIR WORK_DIR
# The torch is FSDP2CPP_PYTHON's (CTest sets it to the build's, with TORCH_VERSION),
# else SOURCE_DIR/.venv's, else python3's.
set -euo pipefail
src=$1 work=$2
python=${FSDP2CPP_PYTHON:-}
[[ -z "$python" && -x "$src/.venv/bin/python" ]] && python=$src/.venv/bin/python
[[ -z "$python" ]] && python=python3
fail() { echo "offline test: FAIL: $*" >&2; exit 1; }
command -v apt-get >/dev/null || { echo "offline test: no apt-get here (not Debian/Ubuntu): skipped"; exit 77; }

debs=$work/debs deps=$work/deps build=$work/build
mkdir -p "$work"
start=$SECONDS
"$src/scripts/fetch_debs.sh" "$debs"
size_kib=$(du -sk "$debs" | cut -f1)
((size_kib < 40 * 1024)) || fail "the .deb folder is $size_kib KiB, over the 40 MiB budget"

# No apt and no pip: bootstrap must not try either.
FSDP2CPP_DEBS=$debs FSDP2CPP_DEPS_DIR=$deps FSDP2CPP_PYTHON=$python FSDP2CPP_NO_APT=1 "$src/scripts/bootstrap.sh"
prefix=$deps/usr

rm -rf "$build"
cmake -S "$src" -B "$build" -DFSDP2CPP_CUDA=OFF -DFSDP2CPP_BUILD_TOOLS=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DFSDP2CPP_PYTHON=$python" "-DFSDP2CPP_DEPS_PREFIX=$prefix" >"$work/configure.log" ||
  { cat "$work/configure.log"; fail "configure against $prefix failed"; }

for var in absl_DIR spdlog_DIR fmt_DIR GTest_DIR FSDP2CPP_GLOO_INCLUDE; do
  value=$(grep -E "^$var:[A-Z]+=" "$build/CMakeCache.txt" | cut -d= -f2- || true)
  [[ "$value" == "$prefix"/* ]] || fail "$var is '$value', not inside $prefix"
  echo "offline test: $var=$value"
done

cmake --build "$build" --target fsdp2cpp_collectives -j 2 >"$work/build.log" 2>&1 ||
  { tail -50 "$work/build.log"; fail "building the collectives library against $prefix failed"; }

# A small downstream project that uses every package (Abseil, spdlog, fmt,
# GoogleTest/GMock, gloo, nlohmann JSON) through the same prefix logic.
probe=$work/probe
rm -rf "$probe"
cmake -S "$src/tests/offline/probe" -B "$probe" "-DFSDP2CPP_SOURCE_DIR=$src" "-DFSDP2CPP_DEPS_PREFIX=$prefix" \
  >"$work/probe-configure.log" 2>&1 || { cat "$work/probe-configure.log"; fail "the probe project did not configure"; }
cmake --build "$probe" -j 2 >"$work/probe-build.log" 2>&1 ||
  { tail -50 "$work/probe-build.log"; fail "the probe project did not build against $prefix"; }

# Every header of these packages that a compile read came from the prefix.
depfiles=$(find "$build" "$probe" -name '*.o.d')
[[ -n "$depfiles" ]] || fail "no compiler dependency files under $build"
leaks=$(cat $depfiles | tr ' \\' '\n\n' | grep -E '^/usr/include/(absl|spdlog|fmt|gtest|gmock|gloo|nlohmann)/' | sort -u | head -5 || true)
[[ -z "$leaks" ]] || fail "compiled against the system's headers, not the prefix's: $leaks"
for pkg in absl spdlog fmt gtest gmock gloo nlohmann; do
  grep -q "$prefix/include/$pkg/" $depfiles || fail "no $pkg header from $prefix was compiled"
done

for bin in "$(find "$build" -name 'libfsdp2cpp_common.so' | head -1)" "$probe/probe"; do
  # Also the libraries these load in turn (libabsl_strings_internal for
  # libabsl_strings, libfmt for libspdlog): the system's copies must not be used.
  loaded=$(ldd "$bin" | awk '/lib(absl|spdlog|fmt)/ {print $3}')
  grep -q libspdlog <<<"$loaded" || fail "$bin does not load spdlog"
  outside=$(grep -v "^$prefix/" <<<"$loaded" || true)
  [[ -z "$outside" ]] || fail "$bin loads these from outside $prefix: $outside"
  echo "offline test: $(basename "$bin") loads $(wc -l <<<"$loaded") Abseil/spdlog/fmt libraries, all from $prefix"
done
"$probe/probe" --gtest_brief=1 || fail "the probe built offline failed"
echo "offline test: PASS in $((SECONDS - start)) s (.deb folder $((size_kib / 1024)) MiB)"
