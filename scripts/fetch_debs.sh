#!/usr/bin/env bash
# Downloads, on a machine with access to Debian's archive, the .deb files the
# build needs, so that a machine without network can build from them:
#   scripts/fetch_debs.sh DIR
#   (copy DIR and the source tree over)
#   FSDP2CPP_DEBS=DIR FSDP2CPP_PYTHON=/path/to/python-with-torch make build
# bootstrap.sh unpacks them into .deps/ (never into /); see docs/gpu.md.
#
# The packages: Abseil, spdlog + fmt, GoogleTest + GMock, gloo's headers,
# nlohmann JSON (and ccache with FSDP2CPP_FETCH_CCACHE=1: the build does not
# use an unpacked ccache by itself, see docs/gpu.md), with the
# dependencies they pull in, except what any Debian-based CUDA image already
# has (Essential, required and important packages, and the C/C++ runtime,
# below). Dependencies of those base packages are not followed. Of a choice
# ("a | b") the first is taken. The versions are this machine's apt sources':
# build on the GPU machine with the same distribution release (or a newer
# glibc): the unpacked Abseil, spdlog and fmt are shared libraries.
#
# Idempotent: files already in DIR are kept. Prints the list and the size.
set -euo pipefail

say() { echo "fetch_debs: $*"; }
[[ $# == 1 && -n "$1" ]] || { echo "usage: $0 DIR" >&2; exit 2; }
command -v apt-get >/dev/null && command -v apt-cache >/dev/null ||
  { say "needs apt-get and apt-cache (a Debian or Ubuntu machine)"; exit 1; }

DIR=$1
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)

ROOTS=(libabsl-dev libspdlog-dev libfmt-dev libgtest-dev libgmock-dev libgloo-dev nlohmann-json3-dev)
[[ "${FSDP2CPP_FETCH_CCACHE:-0}" == 1 ]] && ROOTS+=(ccache)

# The C/C++ runtime every image with a compiler has, whatever its priority.
BASE=" libc6 libc6-dev libgcc-s1 libstdc++6 libstdc++-12-dev gcc-12-base zlib1g libzstd1 liblzma5 libbz2-1.0 \
libcrypt1 libselinux1 libpcre2-8-0 libtinfo6 libmd0 libacl1 libaudit1 libcap-ng0 libdb5.3 debconf dpkg tar \
adduser passwd install-info libpam0g libpam-modules libpam-modules-bin libsemanage2 libsepol2 readline-common \
libreadline8 "

# apt-cache loads its whole cache on every call (seconds on a busy machine),
# so the closure is walked one level at a time, one call per level.
# Prints "name base|keep" for each of the given packages.
classify() {
  apt-cache show --no-all-versions "$@" 2>/dev/null |
    awk -v base="$BASE" '
      function done_pkg() { if (name != "") print name, (keep ? "keep" : "base") }
      /^Package:/ { done_pkg(); name = $2; keep = index(base, " " name " ") == 0 }
      /^Essential: yes/ || /^Priority: (required|important)/ { keep = 0 }
      END { done_pkg() }'
}

# Depends and Pre-Depends of the given packages; of "a | b" only a; virtual
# packages (<name>) are left to the base system.
direct_deps() {
  apt-cache depends --no-recommends --no-suggests --no-conflicts --no-breaks --no-replaces --no-enhances "$@" |
    awk '/^ *\|?(Pre)?Depends:/ {
           alt = ($1 ~ /^\|/); name = $2
           if (!skip && name !~ /^</) print name
           skip = alt; next }
         { skip = 0 }' | sort -u
}

declare -A seen=()
level=("${ROOTS[@]}")
wanted=()
while ((${#level[@]})); do
  for p in "${level[@]}"; do seen[$p]=1; done
  declare -A known=()
  keep=()
  while read -r name kind; do
    known[$name]=1
    [[ $kind == keep ]] && keep+=("$name")
  done < <(classify "${level[@]}")
  for p in "${level[@]}"; do
    [[ -n "${known[$p]:-}" ]] || { say "package $p is not known to apt here (run apt-get update?)"; exit 1; }
  done
  unset known
  wanted+=("${keep[@]}")
  next=()
  if ((${#keep[@]})); then
    while read -r d; do
      [[ -n "$d" && -z "${seen[$d]:-}" ]] && { next+=("$d"); seen[$d]=1; }
    done < <(direct_deps "${keep[@]}")
  fi
  level=("${next[@]}")
done

say "${#wanted[@]} packages: ${wanted[*]}"
cd "$DIR"
todo=()
for p in "${wanted[@]}"; do
  compgen -G "${p}_*.deb" >/dev/null || todo+=("$p")
done
if ((${#todo[@]})); then
  # apt-get download drops privileges to _apt where it can; a folder that
  # user cannot write only costs a warning.
  apt-get download -q "${todo[@]}" 2>&1 | grep -v -e '^Get:' -e 'unsandboxed' || true
fi
missing=()
for p in "${wanted[@]}"; do
  compgen -G "${p}_*.deb" >/dev/null || missing+=("$p")
done
((${#missing[@]} == 0)) || { say "could not download: ${missing[*]}"; exit 1; }
printf '%s\n' "${wanted[@]}" >"$DIR/PACKAGES"
say "$(ls "$DIR"/*.deb | wc -l) .deb files in $DIR, $(du -sh "$DIR" | cut -f1) in all"
