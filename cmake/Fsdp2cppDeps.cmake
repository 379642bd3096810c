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
# spdlog, fmt) are found at run time through the build's RUNPATH and, once
# installed, through the install RUNPATH (CMAKE_INSTALL_RPATH_USE_LINK_PATH).
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
  message(STATUS "fsdp2cpp: Debian packages from ${FSDP2CPP_DEPS_PREFIX}")
endif()
