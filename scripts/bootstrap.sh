#!/usr/bin/env bash
# Sets up everything the build needs, idempotently, and says what it did.
#   - Debian -dev packages (Abseil, spdlog+fmt, GoogleTest, gloo headers, nlohmann JSON, ccache)
#   - a project-local virtual env (.venv) with torch==2.11.0 from PyPI, which
#     carries LibTorch, c10d and the NCCL that torch loads, and the `safetensors`
#     wheel that torch.distributed.checkpoint's Hugging Face reader needs (the
#     checkpoint tests check our files against PyTorch itself).
# TORCH_VERSION chooses another torch of the supported range (2.11-2.15),
# which gets its own virtual env, .venv-torch$TORCH_VERSION (the Makefile
# gives it its own build directory too): TORCH_VERSION=2.15.0 make test.
# FSDP2CPP_VENV names the virtual env instead.
# On a machine without package access that already has torch 2.11 (our GPU
# machines), it uses that torch and installs nothing: set FSDP2CPP_PYTHON to
# its python, or let the script find `python3` with torch importable.
#
# Offline: FSDP2CPP_DEBS=DIR names a folder made by scripts/fetch_debs.sh on
# a networked machine. The .debs are unpacked (dpkg -x) into the project-local
# prefix FSDP2CPP_DEPS_DIR (default .deps/; never into /), which the CMake
# build then uses (cmake/Fsdp2cppDeps.cmake); nothing is installed with apt or
# pip. See docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."

# The default is the torch of the GPU machines; the Makefile has the same.
DEFAULT_TORCH_VERSION=2.11.0
TORCH_VERSION=${TORCH_VERSION:-$DEFAULT_TORCH_VERSION}
if [[ "$TORCH_VERSION" == "$DEFAULT_TORCH_VERSION" ]]; then
  VENV=${FSDP2CPP_VENV:-.venv}
else
  VENV=${FSDP2CPP_VENV:-.venv-torch$TORCH_VERSION}
fi
APT_PACKAGES=(cmake g++ make ccache libabsl-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev libgloo-dev nlohmann-json3-dev clang-format)

say() { echo "bootstrap: $*"; }

# The range cmake/Fsdp2cppTorch.cmake accepts.
if ! [[ "$TORCH_VERSION" =~ ^2\.(1[1-5])\.[0-9]+$ ]]; then
  say "TORCH_VERSION=$TORCH_VERSION is not a supported torch: fsdp2cpp builds against torch 2.11 to 2.15" \
      "(a full version such as 2.15.0; unset, $DEFAULT_TORCH_VERSION)"
  exit 1
fi
if [[ "$TORCH_VERSION" == "$DEFAULT_TORCH_VERSION" ]]; then
  say "torch $TORCH_VERSION, the default (TORCH_VERSION chooses another of 2.11-2.15)"
else
  say "torch $TORCH_VERSION, from TORCH_VERSION"
fi

# Unpacks every .deb of $FSDP2CPP_DEBS into $1, once per set of files.
unpack_debs() {
  local debs=$1 dest=$2 stamp list deb link target member
  [[ -d "$debs" ]] || { say "FSDP2CPP_DEBS=$debs is not a directory"; exit 1; }
  compgen -G "$debs/*.deb" >/dev/null || { say "FSDP2CPP_DEBS=$debs holds no .deb files (scripts/fetch_debs.sh makes them)"; exit 1; }
  list=$(cd "$debs" && ls -l --time-style=+%s ./*.deb | awk '{print $5, $6, $7}')
  stamp="$dest/.fsdp2cpp-debs"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$list" ]]; then
    say "Debian packages from $debs already unpacked in $dest"
    return
  fi
  # Only a folder this script made (or an empty one) is replaced.
  if [[ -e "$dest" && ! -f "$stamp" && -n "$(ls -A "$dest" 2>/dev/null)" ]]; then
    say "$dest exists and was not made by bootstrap.sh; set FSDP2CPP_DEPS_DIR to another path"; exit 1
  fi
  rm -rf "$dest"
  mkdir -p "$dest"
  for deb in "$debs"/*.deb; do
    if command -v dpkg-deb >/dev/null; then
      dpkg-deb -x "$deb" "$dest"
    else  # a .deb is an ar archive holding data.tar.{xz,zst,gz}
      member=$(ar t "$deb" | grep '^data\.tar')
      (cd "$dest" && ar x "$deb" "$member" && tar -xf "$member" && rm -f "$member")
    fi
  done
  # Absolute links (/usr/lib/...) would point into the system: make them
  # point into the prefix.
  while IFS= read -r link; do
    target=$(readlink "$link")
    ln -sfn "$dest$target" "$link"
  done < <(find "$dest" -type l -lname '/*')
  echo "$list" >"$stamp"
  say "unpacked $(ls "$debs"/*.deb | wc -l) Debian packages from $debs into $dest"
}

if [[ -n "${FSDP2CPP_DEBS:-}" ]]; then
  DEPS_DIR=${FSDP2CPP_DEPS_DIR:-.deps}
  mkdir -p "$DEPS_DIR"
  DEPS_DIR=$(cd "$DEPS_DIR" && pwd)
  unpack_debs "$(cd "$FSDP2CPP_DEBS" 2>/dev/null && pwd || echo "$FSDP2CPP_DEBS")" "$DEPS_DIR"
  absent=()
  for h in absl/base/config.h spdlog/spdlog.h fmt/format.h gtest/gtest.h gmock/gmock.h gloo/context.h nlohmann/json.hpp; do
    [[ -f "$DEPS_DIR/usr/include/$h" ]] || absent+=("$h")
  done
  ((${#absent[@]} == 0)) || { say "the unpacked packages lack ${absent[*]}; rerun scripts/fetch_debs.sh"; exit 1; }
  for tool in cmake make c++; do
    command -v $tool >/dev/null || say "no $tool on PATH: the build needs it (not in the .deb folder)"
  done
  # Offline: no apt, no pip.
  export FSDP2CPP_NO_APT=1 FSDP2CPP_NO_PIP=1
  APT_PACKAGES=()
fi

missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [[ -n "${FSDP2CPP_DEBS:-}" ]]; then
  say "Debian packages: the unpacked ones in $DEPS_DIR/usr (cmake uses them)"
elif ((${#missing[@]} == 0)); then
  say "Debian packages present"
elif [[ "${FSDP2CPP_NO_APT:-0}" == 1 ]] || ! command -v apt-get >/dev/null; then
  say "missing Debian packages (${missing[*]}) and no apt; the build may fail"
else
  SUDO=""
  [[ $(id -u) == 0 ]] || SUDO="sudo"
  say "installing ${missing[*]}"
  if ! $SUDO apt-get install -y -qq "${missing[@]}" >/tmp/fsdp2cpp-apt.log 2>&1; then
    say "apt-get install failed; refreshing the package lists and retrying"
    $SUDO apt-get update -qq >>/tmp/fsdp2cpp-apt.log 2>&1
    $SUDO DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >>/tmp/fsdp2cpp-apt.log 2>&1 ||
      { cat /tmp/fsdp2cpp-apt.log; exit 1; }
  fi
fi

# Whether python $1 imports torch $TORCH_VERSION (any local build: +cu130, +cpu).
has_torch() { "$1" -c "import torch, sys; sys.exit(0 if torch.__version__.split('+')[0] == '$TORCH_VERSION' else 1)" 2>/dev/null; }

if [[ -n "${FSDP2CPP_PYTHON:-}" ]]; then
  if ! has_torch "$FSDP2CPP_PYTHON"; then
    if found=$("$FSDP2CPP_PYTHON" -c "import torch; print(torch.__version__)" 2>/dev/null); then
      say "FSDP2CPP_PYTHON=$FSDP2CPP_PYTHON has torch $found, not $TORCH_VERSION (set TORCH_VERSION to the version it has)"
    else
      say "FSDP2CPP_PYTHON=$FSDP2CPP_PYTHON cannot import torch (wanted $TORCH_VERSION)"
    fi
    exit 1
  fi
  say "using torch $TORCH_VERSION from FSDP2CPP_PYTHON=$FSDP2CPP_PYTHON"
elif [[ -x $VENV/bin/python ]] && has_torch $VENV/bin/python; then
  say "virtual env $VENV has torch $TORCH_VERSION"
elif [[ "${FSDP2CPP_NO_PIP:-0}" != 1 ]] && python3 -m venv --help >/dev/null 2>&1 &&
     python3 -m pip download --help >/dev/null 2>&1; then
  say "creating $VENV with torch==$TORCH_VERSION (first time: a few minutes)"
  [[ -x $VENV/bin/python ]] || python3 -m venv $VENV
  # pip's cache (~/.cache/pip) makes later fresh clones fast.
  $VENV/bin/pip install -q "torch==$TORCH_VERSION" || {
    if has_torch python3; then
      say "pip failed; falling back to the system torch"; rm -rf $VENV
    else
      exit 1
    fi
  }
elif has_torch python3; then
  say "using the system python3's torch $TORCH_VERSION"
else
  say "no torch $TORCH_VERSION available and pip cannot install it"; exit 1
fi
# The checkpoint interop tests read and write files with PyTorch's own
# safetensors readers; without the wheel they fail and say so.
PY=${FSDP2CPP_PYTHON:-}
[[ -z "$PY" && -x $VENV/bin/python ]] && PY=$VENV/bin/python
[[ -z "$PY" ]] && PY=python3
if "$PY" -c "import safetensors" 2>/dev/null; then
  say "python safetensors present"
elif [[ "${FSDP2CPP_NO_PIP:-0}" != 1 ]] && "$PY" -m pip --version >/dev/null 2>&1; then
  say "installing the safetensors wheel into $PY"
  "$PY" -m pip install -q safetensors || say "pip could not install safetensors; the checkpoint interop tests will fail"
else
  say "python safetensors missing and pip unavailable; the checkpoint interop tests will fail"
fi
say "done"
