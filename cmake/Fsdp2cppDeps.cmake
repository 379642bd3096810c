# Where the Debian -dev packages come from: the system (/usr, apt-get), or a
# project-local prefix that scripts/bootstrap.sh unpacked from a folder of
# .deb files for an offline machine (FSDP2CPP_DEBS, docs/gpu.md).
#
# FSDP2CPP_DEPS_PREFIX is that prefix (the `usr` directory of the unpacked
# packages): by default $FSDP2CPP_DEPS_DIR/usr when that variable is set (as
# for bootstrap.sh), else <source>/.deps/usr when it exists. It goes first in
# CMAKE_PREFIX_PATH, so find_package(absl/spdlog/fmt/GTest/nlohmann_json) and
# find_path(gloo) take the unpacked copies over any system ones. Their CMake
# files compute their prefix from their own location, so the /usr paths
# written in them do not apply there; the unpacked shared libraries (Abseil,
# spdlog, fmt), and their own dependencies, are found at run time through the
# build's RPATH and, once installed, through the install RPATH
# (CMAKE_INSTALL_RPATH_USE_LINK_PATH).
include_guard(GLOBAL)

if(NOT DEFINED FSDP2CPP_DEPS_PREFIX AND DEFINED ENV{FSDP2CPP_DEPS_DIR})
  set(FSDP2CPP_DEPS_PREFIX "$ENV{FSDP2CPP_DEPS_DIR}/usr")
endif()
if(NOT DEFINED FSDP2CPP_DEPS_PREFIX AND EXISTS "${PROJECT_SOURCE_DIR}/.deps/usr/include")
  set(FSDP2CPP_DEPS_PREFIX "${PROJECT_SOURCE_DIR}/.deps/usr")
endif()
set(FSDP2CPP_DEPS_PREFIX "${FSDP2CPP_DEPS_PREFIX}" CACHE PATH
    "Prefix of Debian packages unpacked by scripts/bootstrap.sh (FSDP2CPP_DEBS); empty: the system's")

if(FSDP2CPP_DEPS_PREFIX)
  get_filename_component(FSDP2CPP_DEPS_PREFIX "${FSDP2CPP_DEPS_PREFIX}" ABSOLUTE)
  if(NOT EXISTS "${FSDP2CPP_DEPS_PREFIX}/include")
    message(FATAL_ERROR "fsdp2cpp: FSDP2CPP_DEPS_PREFIX=${FSDP2CPP_DEPS_PREFIX} has no include/ directory; "
                        "run FSDP2CPP_DEBS=<folder of .debs> scripts/bootstrap.sh, or unset it to use the system's packages")
  endif()
  # find_package looks in <prefix>/lib/<multiarch>/cmake, where Debian puts
  # the packages' CMake files; find_path in <prefix>/include.
  list(PREPEND CMAKE_PREFIX_PATH "${FSDP2CPP_DEPS_PREFIX}")
  set(CMAKE_INSTALL_RPATH_USE_LINK_PATH ON)
  # DT_RPATH, not DT_RUNPATH: a RUNPATH only serves an object's own NEEDED
  # entries, so libabsl_strings.so's libabsl_strings_internal.so and
  # libspdlog.so's libfmt.so would be looked for in the system directories
  # only. A program's RPATH also serves the libraries it loads.
  add_link_options("LINKER:--disable-new-dtags")
  message(STATUS "fsdp2cpp: Debian packages from ${FSDP2CPP_DEPS_PREFIX}")
endif()
