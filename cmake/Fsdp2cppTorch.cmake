# Locates LibTorch inside a Python environment and defines:
#   fsdp2cpp::torch       LibTorch (CPU), its headers and c10d
#   fsdp2cpp::torch_cuda  libtorch_cuda, c10_cuda and the NCCL that torch loads
#                         (only when FSDP2CPP_WITH_CUDA is true)
#
# The torch install is found through `torch.utils.cmake_prefix_path` of
# FSDP2CPP_PYTHON. We do not call find_package(Torch): the wheel's Caffe2
# config insists on a complete CUDA toolkit (nvcc, the CUDA language, a test
# program that must run, nvrtc) at configure time, even for a CPU-only build
# (docs/build.md).
# Targets over the wheel's own libraries are small and exact.
include_guard(GLOBAL)

# How to point fsdp2cpp at a torch, for the error messages below.
string(CONCAT _fsdp2cpp_torch_hint
  "Point it at a torch package (the one fsdp2cpp was built with, or the same version) with one of:\n"
  "  -DTorch_DIR=<site-packages>/torch/share/cmake/Torch\n"
  "      (python -c \"import torch.utils; print(torch.utils.cmake_prefix_path + '/Torch')\" prints it)\n"
  "  -DFSDP2CPP_PYTHON=<a python that can import torch> (or the environment variable FSDP2CPP_PYTHON)\n"
  "  -DFSDP2CPP_TORCH_ROOT=<site-packages>/torch\n"
  "or put <site-packages>/torch/share/cmake on CMAKE_PREFIX_PATH.")

# Whether `dir` is the root of a torch package (holds include/ and lib/).
function(_fsdp2cpp_is_torch_root dir out)
  if(dir AND EXISTS "${dir}/lib/libtorch_cpu.so" AND EXISTS "${dir}/include/ATen/ATen.h")
    set(${out} TRUE PARENT_SCOPE)
  else()
    set(${out} FALSE PARENT_SCOPE)
  endif()
endfunction()

# torch.__version__ of the package at `dir` (read from its version.py), else
# MAJOR.MINOR.PATCH from its C++ version header (a LibTorch archive has no
# version.py), or "".
function(_fsdp2cpp_torch_version dir out)
  set(version "")
  if(EXISTS "${dir}/version.py")
    file(STRINGS "${dir}/version.py" lines REGEX "^__version__ *=")
    if(lines MATCHES "['\"]([^'\"]+)['\"]")
      set(version "${CMAKE_MATCH_1}")
    endif()
  endif()
  foreach(header "${dir}/include/torch/headeronly/version.h" "${dir}/include/torch/csrc/api/include/torch/version.h")
    if(NOT version AND EXISTS "${header}")
      file(STRINGS "${header}" lines REGEX "^#define TORCH_VERSION_(MAJOR|MINOR|PATCH) ")
      if(lines MATCHES "MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+)")
        set(version "${CMAKE_MATCH_1}.${CMAKE_MATCH_2}.${CMAKE_MATCH_3}")
      endif()
    endif()
  endforeach()
  set(${out} "${version}" PARENT_SCOPE)
endfunction()

# [Note: supported torch versions] The build accepts torch 2.11 to 2.15
# (docs/build.md, "Torch versions", says what was built and run against
# which): 2.11 is what the GPU machines carry, 2.15 the newest on PyPI when
# the range was set. LibTorch's C++ API changes between minor versions
# (collectives/src/torch_compat.h has the differences within the range), so a
# version outside it is refused rather than tried.
set(FSDP2CPP_TORCH_MIN_VERSION 2.11)
set(FSDP2CPP_TORCH_MAX_VERSION 2.15)

# Asks `python` where its torch is: sets <prefix>_ROOT, <prefix>_VERSION and
# <prefix>_ABI, or <prefix>_ERROR when it cannot import torch.
function(_fsdp2cpp_torch_from_python python prefix)
  execute_process(
    COMMAND "${python}" -c
      "import torch.utils, torch; print(torch.utils.cmake_prefix_path); print(torch.__version__); print(int(torch.compiled_with_cxx11_abi()))"
    OUTPUT_VARIABLE out RESULT_VARIABLE rc ERROR_VARIABLE err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT rc EQUAL 0)
    string(STRIP "${err}" err)
    set(${prefix}_ERROR "'${python}' cannot import torch (${rc}: ${err})" PARENT_SCOPE)
    return()
  endif()
  string(REPLACE "\n" ";" out "${out}")
  list(GET out 0 cmake_prefix)
  list(GET out 1 version)
  list(GET out 2 abi)
  get_filename_component(root "${cmake_prefix}/../.." ABSOLUTE)
  set(${prefix}_ROOT "${root}" PARENT_SCOPE)
  set(${prefix}_VERSION "${version}" PARENT_SCOPE)
  set(${prefix}_ABI "${abi}" PARENT_SCOPE)
  set(${prefix}_ERROR "" PARENT_SCOPE)
endfunction()

if(NOT FSDP2CPP_PYTHON AND DEFINED ENV{FSDP2CPP_PYTHON})
  set(FSDP2CPP_PYTHON "$ENV{FSDP2CPP_PYTHON}")
endif()

if(DEFINED FSDP2CPP_TORCH_RECORDED_ROOT AND NOT FSDP2CPP_TORCH_ROOT)
  # [Note: finding torch from the installed package] The package records the
  # torch it was built with, but that torch may be gone (it often lives in
  # the .venv of the clone that was installed from). In order, the first
  # that is given wins, and a location given explicitly must be a torch:
  #   FSDP2CPP_TORCH_ROOT (variable or environment), Torch_DIR (variable or
  #   environment), FSDP2CPP_PYTHON (variable or environment); then the
  #   recorded root if it still exists; then a Torch/TorchConfig.cmake on
  #   CMAKE_PREFIX_PATH; then the torch of `python3` on PATH.
  set(_root "")
  set(_how "")
  if(DEFINED ENV{FSDP2CPP_TORCH_ROOT} AND NOT "$ENV{FSDP2CPP_TORCH_ROOT}" STREQUAL "")
    set(_root "$ENV{FSDP2CPP_TORCH_ROOT}")
    set(_how "the environment variable FSDP2CPP_TORCH_ROOT=${_root}")
  endif()
  if(NOT _root)
    set(_torch_dir "")
    if(Torch_DIR)
      set(_torch_dir "${Torch_DIR}")
      set(_how "Torch_DIR=${Torch_DIR}")
    elseif(DEFINED ENV{Torch_DIR} AND NOT "$ENV{Torch_DIR}" STREQUAL "")
      set(_torch_dir "$ENV{Torch_DIR}")
      set(_how "the environment variable Torch_DIR=${_torch_dir}")
    endif()
    if(_torch_dir)
      if(NOT EXISTS "${_torch_dir}/TorchConfig.cmake")
        message(FATAL_ERROR "fsdp2cpp: ${_how} has no TorchConfig.cmake: it is not the share/cmake/Torch "
                            "directory of a torch package.\n${_fsdp2cpp_torch_hint}")
      endif()
      get_filename_component(_root "${_torch_dir}/../../.." ABSOLUTE)
    endif()
  endif()
  if(NOT _root AND FSDP2CPP_PYTHON)
    _fsdp2cpp_torch_from_python("${FSDP2CPP_PYTHON}" _py)
    if(_py_ERROR)
      message(FATAL_ERROR "fsdp2cpp: FSDP2CPP_PYTHON: ${_py_ERROR}.\n${_fsdp2cpp_torch_hint}")
    endif()
    set(_root "${_py_ROOT}")
    set(_how "FSDP2CPP_PYTHON=${FSDP2CPP_PYTHON}")
  endif()
  if(_root)
    _fsdp2cpp_is_torch_root("${_root}" _ok)
    if(NOT _ok)
      message(FATAL_ERROR "fsdp2cpp: ${_how} does not lead to a torch package: ${_root} has no "
                          "lib/libtorch_cpu.so and include/ATen/ATen.h.\n${_fsdp2cpp_torch_hint}")
    endif()
  else()
    _fsdp2cpp_is_torch_root("${FSDP2CPP_TORCH_RECORDED_ROOT}" _ok)
    if(_ok)
      set(_root "${FSDP2CPP_TORCH_RECORDED_ROOT}")
      set(_how "the torch recorded at installation")
    endif()
  endif()
  if(NOT _root)
    # As find_package(Torch) would look: <prefix>/Torch or
    # <prefix>/share/cmake/Torch (torch.utils.cmake_prefix_path is <torch>/share/cmake).
    set(_prefixes ${CMAKE_PREFIX_PATH})
    if(DEFINED ENV{CMAKE_PREFIX_PATH})
      string(REPLACE ":" ";" _env_prefixes "$ENV{CMAKE_PREFIX_PATH}")
      list(APPEND _prefixes ${_env_prefixes})
    endif()
    foreach(_prefix IN LISTS _prefixes)
      foreach(_config_dir "${_prefix}/Torch" "${_prefix}/share/cmake/Torch")
        if(EXISTS "${_config_dir}/TorchConfig.cmake")
          get_filename_component(_candidate "${_config_dir}/../../.." ABSOLUTE)
          _fsdp2cpp_is_torch_root("${_candidate}" _ok)
          if(_ok)
            set(_root "${_candidate}")
            set(_how "CMAKE_PREFIX_PATH (${_config_dir})")
            break()
          endif()
        endif()
      endforeach()
      if(_root)
        break()
      endif()
    endforeach()
  endif()
  if(NOT _root)
    find_program(_fsdp2cpp_python3 NAMES python3 NO_CACHE)
    if(_fsdp2cpp_python3)
      _fsdp2cpp_torch_from_python("${_fsdp2cpp_python3}" _py)
      if(NOT _py_ERROR)
        _fsdp2cpp_is_torch_root("${_py_ROOT}" _ok)
        if(_ok)
          set(_root "${_py_ROOT}")
          set(_how "${_fsdp2cpp_python3} on PATH")
        endif()
      endif()
    endif()
  endif()
  if(NOT _root)
    message(FATAL_ERROR "fsdp2cpp: cannot find torch. The package was built with torch "
                        "${FSDP2CPP_TORCH_RECORDED_VERSION} at ${FSDP2CPP_TORCH_RECORDED_ROOT}, which is no "
                        "longer there, and no other was given.\n${_fsdp2cpp_torch_hint}")
  endif()
  # The libraries were built against one torch: another minor or patch
  # version is an ABI break, another build of the same version (+cpu, +cu1xx)
  # may lack what the package needs.
  _fsdp2cpp_torch_version("${_root}" _found_version)
  string(REGEX MATCH "^[0-9]+\\.[0-9]+\\.[0-9]+" _found_release "${_found_version}")
  string(REGEX MATCH "^[0-9]+\\.[0-9]+\\.[0-9]+" _recorded_release "${FSDP2CPP_TORCH_RECORDED_VERSION}")
  if(_found_release AND _recorded_release AND NOT _found_release STREQUAL _recorded_release)
    message(FATAL_ERROR "fsdp2cpp: the torch found through ${_how} (${_root}) is ${_found_version}, but fsdp2cpp "
                        "was built with torch ${FSDP2CPP_TORCH_RECORDED_VERSION}: LibTorch has no stable ABI "
                        "across versions. Rebuild fsdp2cpp against it, or point the package at a torch "
                        "${_recorded_release}.\n${_fsdp2cpp_torch_hint}")
  elseif(_found_version AND NOT _found_version STREQUAL FSDP2CPP_TORCH_RECORDED_VERSION)
    message(WARNING "fsdp2cpp: using torch ${_found_version} at ${_root}; fsdp2cpp was built with "
                    "${FSDP2CPP_TORCH_RECORDED_VERSION}")
  endif()
  set(FSDP2CPP_TORCH_ROOT "${_root}")
  set(FSDP2CPP_TORCH_VERSION "${_found_version}")
  message(STATUS "fsdp2cpp: torch ${FSDP2CPP_TORCH_VERSION} at ${FSDP2CPP_TORCH_ROOT} (from ${_how})")
elseif(NOT FSDP2CPP_TORCH_ROOT)
  # The build: the torch of FSDP2CPP_PYTHON, default the python of the
  # virtual env FSDP2CPP_VENV (default .venv; the Makefile passes
  # .venv-torch<version> for TORCH_VERSION=<version>), else python3.
  if(NOT FSDP2CPP_VENV)
    set(FSDP2CPP_VENV "${CMAKE_SOURCE_DIR}/.venv")
  endif()
  if(NOT FSDP2CPP_PYTHON)
    if(EXISTS "${FSDP2CPP_VENV}/bin/python")
      set(FSDP2CPP_PYTHON "${FSDP2CPP_VENV}/bin/python")
    else()
      find_program(FSDP2CPP_PYTHON NAMES python3 python REQUIRED)
    endif()
  endif()
  _fsdp2cpp_torch_from_python("${FSDP2CPP_PYTHON}" _py)
  if(_py_ERROR)
    message(FATAL_ERROR "fsdp2cpp: ${_py_ERROR}. "
                        "Run scripts/bootstrap.sh, or pass -DFSDP2CPP_PYTHON=<python with torch 2.11 to 2.15>.")
  endif()
  set(FSDP2CPP_TORCH_ROOT "${_py_ROOT}" CACHE PATH "Root of the torch package (holds include/ and lib/)")
  set(FSDP2CPP_TORCH_CXX11_ABI "${_py_ABI}" CACHE STRING "torch's _GLIBCXX_USE_CXX11_ABI")
  set(FSDP2CPP_TORCH_VERSION "${_py_VERSION}")
elseif(DEFINED FSDP2CPP_TORCH_RECORDED_ROOT)
  # The installed package, given FSDP2CPP_TORCH_ROOT.
  _fsdp2cpp_is_torch_root("${FSDP2CPP_TORCH_ROOT}" _ok)
  if(NOT _ok)
    message(FATAL_ERROR "fsdp2cpp: FSDP2CPP_TORCH_ROOT=${FSDP2CPP_TORCH_ROOT} is not a torch package: it has no "
                        "lib/libtorch_cpu.so and include/ATen/ATen.h.\n${_fsdp2cpp_torch_hint}")
  endif()
  message(STATUS "fsdp2cpp: torch at ${FSDP2CPP_TORCH_ROOT} (from FSDP2CPP_TORCH_ROOT)")
endif()
if(NOT FSDP2CPP_TORCH_VERSION)
  _fsdp2cpp_torch_version("${FSDP2CPP_TORCH_ROOT}" FSDP2CPP_TORCH_VERSION)
endif()
if(NOT DEFINED FSDP2CPP_TORCH_RECORDED_ROOT)
  # The build (the installed package checks the version it was built with,
  # above): refuse a torch outside the supported range.
  string(REGEX MATCH "^[0-9]+\\.[0-9]+" _fsdp2cpp_torch_minor "${FSDP2CPP_TORCH_VERSION}")
  set(_fsdp2cpp_root "${FSDP2CPP_TORCH_ROOT}")
  string(CONCAT _fsdp2cpp_range_hint
    "fsdp2cpp builds against torch ${FSDP2CPP_TORCH_MIN_VERSION} to ${FSDP2CPP_TORCH_MAX_VERSION}. "
    "Use one of those: `TORCH_VERSION=2.15.0 make test` (or any version of the range) makes a "
    "virtual env with it, or point the build at your own with -DFSDP2CPP_PYTHON=<a python whose "
    "torch is in the range> or -DFSDP2CPP_TORCH_ROOT=<its site-packages/torch> "
    "(docs/build.md, \"Torch versions\").")
  # Refused, the torch is not kept in the cache: the next configure looks again.
  if(NOT _fsdp2cpp_torch_minor OR _fsdp2cpp_torch_minor VERSION_LESS FSDP2CPP_TORCH_MIN_VERSION OR
     _fsdp2cpp_torch_minor VERSION_GREATER FSDP2CPP_TORCH_MAX_VERSION)
    unset(FSDP2CPP_TORCH_ROOT CACHE)
    unset(FSDP2CPP_TORCH_CXX11_ABI CACHE)
  endif()
  if(NOT _fsdp2cpp_torch_minor)
    message(FATAL_ERROR "fsdp2cpp: cannot tell the version of the torch at ${_fsdp2cpp_root} (no version.py, "
                        "no include/torch/headeronly/version.h).\n${_fsdp2cpp_range_hint}")
  endif()
  if(_fsdp2cpp_torch_minor VERSION_LESS FSDP2CPP_TORCH_MIN_VERSION OR
     _fsdp2cpp_torch_minor VERSION_GREATER FSDP2CPP_TORCH_MAX_VERSION)
    message(FATAL_ERROR "fsdp2cpp: the torch at ${_fsdp2cpp_root} is ${FSDP2CPP_TORCH_VERSION}, outside "
                        "the supported range.\n${_fsdp2cpp_range_hint}")
  endif()
  message(STATUS "fsdp2cpp: torch ${FSDP2CPP_TORCH_VERSION} at ${FSDP2CPP_TORCH_ROOT} (supported: "
                 "${FSDP2CPP_TORCH_MIN_VERSION} to ${FSDP2CPP_TORCH_MAX_VERSION})")
endif()
# The Python whose torch the build uses, for the tests and benchmarks that run
# PyTorch itself (interop checks, PyTorch FSDP2 baselines): FSDP2CPP_PYTHON
# when this configure run was given it or found it, else the venv that holds
# FSDP2CPP_TORCH_ROOT (<venv>/lib/python3.X/site-packages/torch).
if(NOT FSDP2CPP_PYTHON_EXECUTABLE)
  if(FSDP2CPP_PYTHON)
    set(_fsdp2cpp_python "${FSDP2CPP_PYTHON}")
  else()
    get_filename_component(_fsdp2cpp_venv "${FSDP2CPP_TORCH_ROOT}/../../../.." ABSOLUTE)
    set(_fsdp2cpp_python "${_fsdp2cpp_venv}/bin/python")
  endif()
  set(FSDP2CPP_PYTHON_EXECUTABLE "${_fsdp2cpp_python}" CACHE FILEPATH
      "Python with the torch the build uses (interop tests, PyTorch baselines)")
endif()
if(NOT DEFINED FSDP2CPP_TORCH_CXX11_ABI)
  set(FSDP2CPP_TORCH_CXX11_ABI 1)
endif()

function(_fsdp2cpp_require_lib var name dir)
  # Not cached: a later configure with another torch root finds its own.
  find_library(${var} NAMES ${name} PATHS "${dir}" NO_DEFAULT_PATH NO_CACHE)
  if(NOT ${var})
    message(FATAL_ERROR "fsdp2cpp: ${name} not found under ${dir}")
  endif()
  set(${var} "${${var}}" PARENT_SCOPE)
endfunction()

if(NOT TARGET fsdp2cpp::torch)
  _fsdp2cpp_require_lib(FSDP2CPP_LIBTORCH torch "${FSDP2CPP_TORCH_ROOT}/lib")
  _fsdp2cpp_require_lib(FSDP2CPP_LIBTORCH_CPU torch_cpu "${FSDP2CPP_TORCH_ROOT}/lib")
  _fsdp2cpp_require_lib(FSDP2CPP_LIBC10 c10 "${FSDP2CPP_TORCH_ROOT}/lib")
  add_library(fsdp2cpp::torch INTERFACE IMPORTED)
  # [Note: libstdc++ before libtorch] The wheel's libtorch.so and
  # libtorch_cpu.so were built by Red Hat's GCC 13 toolset on a GCC 8 system,
  # whose libstdc++_nonshared.a links what GCC 8's libstdc++ lacks (all of
  # std::filesystem, GLIBCXX_3.4.26) into each library and exports it unversioned (`nm -D libtorch.so` lists
  # remove_all, equivalent, create_directories, ... as `T`, no @GLIBCXX).
  # libtorch.so has no NEEDED libstdc++.so.6. When it comes before
  # libstdc++.so.6 in a program's NEEDED list (the compiler driver appends
  # -lstdc++ last), the program's std::filesystem calls bind to libtorch.so's
  # copies, and its remove_all calls GCC 13's
  # recursive_directory_iterator::__erase through a weak reference that the
  # system's GCC 12 libstdc++ does not define: a jump to address 0.
  # Linking libstdc++ first (an option, so it precedes every library on the
  # link line; --no-as-needed so it is kept there) makes it the first NEEDED
  # entry: the calls bind to libstdc++, with their GLIBCXX versions, for this
  # program and for every library it loads. docs/build.md has the evidence.
  # [Note: the C++ standard torch needs] torch 2.11's headers are C++17;
  # torch 2.15's use C++20 (std::bit_width in c10/core/DispatchKeySet.h,
  # std::strong_ordering in c10/util/intrusive_ptr.h, `requires` in
  # ATen/core/TensorBase.h) and its TorchConfig.cmake asks for it with
  # target_compile_features(torch INTERFACE cxx_std_20). We ask for what the
  # torch's own config asks for, read from that file, so every target that
  # links fsdp2cpp::torch (ours and an installed package's consumers) compiles
  # with at least that standard; the project's CMAKE_CXX_STANDARD (17) stays
  # the floor.
  set(_fsdp2cpp_torch_cxx_std cxx_std_17)
  if(EXISTS "${FSDP2CPP_TORCH_ROOT}/share/cmake/Torch/TorchConfig.cmake")
    file(STRINGS "${FSDP2CPP_TORCH_ROOT}/share/cmake/Torch/TorchConfig.cmake" _lines
         REGEX "target_compile_features\\(torch INTERFACE cxx_std_[0-9]+\\)")
    if(_lines MATCHES "cxx_std_([0-9]+)")
      set(_fsdp2cpp_torch_cxx_std "cxx_std_${CMAKE_MATCH_1}")
    endif()
  endif()
  set(_fsdp2cpp_torch_link_options "LINKER:-rpath,${FSDP2CPP_TORCH_ROOT}/lib")
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang" AND CMAKE_SYSTEM_NAME STREQUAL "Linux")
    # By path where the compiler can name the shared library: on the GPU
    # machines (CXX=/opt/gcc/bin/g++, GCC 13.3 on Ubuntu 24.04) the option
    # -lstdc++ left no NEEDED libstdc++.so.6 in the programs, and every gpu
    # test's parent jumped to address 0 once its ranks had passed, where the
    # harness removes its scratch directory (the backtrace stopped there);
    # linked by path, the entry is there and they pass (docs/gpu.md, 2).
    execute_process(COMMAND ${CMAKE_CXX_COMPILER} -print-file-name=libstdc++.so.6
                    OUTPUT_VARIABLE _fsdp2cpp_libstdcxx OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(NOT IS_ABSOLUTE "${_fsdp2cpp_libstdcxx}" OR NOT EXISTS "${_fsdp2cpp_libstdcxx}"
       OR _fsdp2cpp_libstdcxx MATCHES ",")
      set(_fsdp2cpp_libstdcxx "-lstdc++")
    endif()
    list(APPEND _fsdp2cpp_torch_link_options "LINKER:--push-state,--no-as-needed,${_fsdp2cpp_libstdcxx},--pop-state")
  endif()
  # Torch headers are SYSTEM so that our warning flags do not fire inside them.
  set_target_properties(fsdp2cpp::torch PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${FSDP2CPP_TORCH_ROOT}/include;${FSDP2CPP_TORCH_ROOT}/include/torch/csrc/api/include"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${FSDP2CPP_TORCH_ROOT}/include;${FSDP2CPP_TORCH_ROOT}/include/torch/csrc/api/include"
    INTERFACE_COMPILE_DEFINITIONS "_GLIBCXX_USE_CXX11_ABI=${FSDP2CPP_TORCH_CXX11_ABI}"
    INTERFACE_COMPILE_FEATURES "${_fsdp2cpp_torch_cxx_std}"
    # --no-as-needed: the program itself needs the three libraries, so the
    # loader finds them through the program's -rpath (the torch this
    # configure found) before our libraries, whose RUNPATH names the torch
    # they were built with, ask for them by soname.
    INTERFACE_LINK_LIBRARIES
      "-Wl,--push-state,--no-as-needed;${FSDP2CPP_LIBTORCH};${FSDP2CPP_LIBTORCH_CPU};${FSDP2CPP_LIBC10};-Wl,--pop-state"
    INTERFACE_LINK_OPTIONS "${_fsdp2cpp_torch_link_options}")
endif()

# --- CUDA ------------------------------------------------------------------
if(NOT DEFINED FSDP2CPP_CUDA)
  set(FSDP2CPP_CUDA AUTO)
endif()
set(FSDP2CPP_WITH_CUDA OFF)
if(FSDP2CPP_CUDA STREQUAL "AUTO")
  find_package(CUDAToolkit QUIET)
  set(FSDP2CPP_WITH_CUDA ${CUDAToolkit_FOUND})
elseif(FSDP2CPP_CUDA)
  find_package(CUDAToolkit REQUIRED)
  set(FSDP2CPP_WITH_CUDA ON)
endif()
if(FSDP2CPP_WITH_CUDA AND NOT EXISTS "${FSDP2CPP_TORCH_ROOT}/lib/libtorch_cuda.so")
  message(STATUS "fsdp2cpp: this torch has no CUDA build; building CPU-only")
  set(FSDP2CPP_WITH_CUDA OFF)
endif()

if(FSDP2CPP_WITH_CUDA AND NOT TARGET fsdp2cpp::torch_cuda)
  _fsdp2cpp_require_lib(FSDP2CPP_LIBTORCH_CUDA torch_cuda "${FSDP2CPP_TORCH_ROOT}/lib")
  _fsdp2cpp_require_lib(FSDP2CPP_LIBC10_CUDA c10_cuda "${FSDP2CPP_TORCH_ROOT}/lib")
  # One NCCL per process: link the libnccl that libtorch_cuda itself loads
  # (the nvidia-nccl wheel beside torch), falling back to the toolkit's.
  get_filename_component(_site "${FSDP2CPP_TORCH_ROOT}/.." ABSOLUTE)
  # NAMES_PER_DIR: the wheel's directory (which only has libnccl.so.2) wins
  # over the toolkit's libnccl.so.
  find_library(FSDP2CPP_LIBNCCL NAMES nccl libnccl.so.2 NAMES_PER_DIR
    PATHS "${_site}/nvidia/nccl/lib" "${CUDAToolkit_LIBRARY_DIR}" NO_DEFAULT_PATH)
  find_path(FSDP2CPP_NCCL_INCLUDE nccl.h
    PATHS "${_site}/nvidia/nccl/include" "${CUDAToolkit_INCLUDE_DIRS}" NO_DEFAULT_PATH)
  if(NOT FSDP2CPP_LIBNCCL OR NOT FSDP2CPP_NCCL_INCLUDE)
    message(FATAL_ERROR "fsdp2cpp: NCCL not found beside torch (${_site}/nvidia/nccl) nor in the CUDA toolkit")
  endif()
  get_filename_component(_nccl_dir "${FSDP2CPP_LIBNCCL}" DIRECTORY)
  add_library(fsdp2cpp::torch_cuda INTERFACE IMPORTED)
  set_target_properties(fsdp2cpp::torch_cuda PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${CUDAToolkit_INCLUDE_DIRS};${FSDP2CPP_NCCL_INCLUDE}"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${CUDAToolkit_INCLUDE_DIRS};${FSDP2CPP_NCCL_INCLUDE}"
    INTERFACE_COMPILE_DEFINITIONS "USE_C10D_NCCL"
    # --no-as-needed keeps libtorch_cuda loaded, so its CUDA hooks register
    # even in programs that reach CUDA only through at:: dispatch.
    INTERFACE_LINK_LIBRARIES "-Wl,--no-as-needed;${FSDP2CPP_LIBTORCH_CUDA};${FSDP2CPP_LIBC10_CUDA};${FSDP2CPP_LIBNCCL};-Wl,--as-needed;fsdp2cpp::torch"
    INTERFACE_LINK_OPTIONS "LINKER:-rpath,${_nccl_dir}")
endif()
