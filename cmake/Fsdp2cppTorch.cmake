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

if(NOT FSDP2CPP_TORCH_ROOT)
  if(NOT FSDP2CPP_PYTHON AND DEFINED ENV{FSDP2CPP_PYTHON})
    set(FSDP2CPP_PYTHON "$ENV{FSDP2CPP_PYTHON}")
  endif()
  if(NOT FSDP2CPP_PYTHON)
    if(EXISTS "${CMAKE_SOURCE_DIR}/.venv/bin/python")
      set(FSDP2CPP_PYTHON "${CMAKE_SOURCE_DIR}/.venv/bin/python")
    else()
      find_program(FSDP2CPP_PYTHON NAMES python3 python REQUIRED)
    endif()
  endif()
  execute_process(
    COMMAND "${FSDP2CPP_PYTHON}" -c
      "import torch.utils, torch; print(torch.utils.cmake_prefix_path); print(torch.__version__); print(int(torch.compiled_with_cxx11_abi()))"
    OUTPUT_VARIABLE _fsdp2cpp_torch_out RESULT_VARIABLE _fsdp2cpp_torch_rc
    ERROR_VARIABLE _fsdp2cpp_torch_err OUTPUT_STRIP_TRAILING_WHITESPACE)
  if(NOT _fsdp2cpp_torch_rc EQUAL 0)
    message(FATAL_ERROR "fsdp2cpp: '${FSDP2CPP_PYTHON}' cannot import torch (${_fsdp2cpp_torch_err}). "
                        "Run scripts/bootstrap.sh, or pass -DFSDP2CPP_PYTHON=<python with torch 2.11>.")
  endif()
  string(REPLACE "\n" ";" _fsdp2cpp_torch_out "${_fsdp2cpp_torch_out}")
  list(GET _fsdp2cpp_torch_out 0 _prefix)
  list(GET _fsdp2cpp_torch_out 1 FSDP2CPP_TORCH_VERSION)
  list(GET _fsdp2cpp_torch_out 2 FSDP2CPP_TORCH_CXX11_ABI)
  get_filename_component(FSDP2CPP_TORCH_ROOT "${_prefix}/../.." ABSOLUTE)
  set(FSDP2CPP_TORCH_ROOT "${FSDP2CPP_TORCH_ROOT}" CACHE PATH "Root of the torch package (holds include/ and lib/)")
  set(FSDP2CPP_TORCH_CXX11_ABI "${FSDP2CPP_TORCH_CXX11_ABI}" CACHE STRING "torch's _GLIBCXX_USE_CXX11_ABI")
  message(STATUS "fsdp2cpp: torch ${FSDP2CPP_TORCH_VERSION} at ${FSDP2CPP_TORCH_ROOT}")
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
  find_library(${var} NAMES ${name} PATHS "${dir}" NO_DEFAULT_PATH)
  if(NOT ${var})
    message(FATAL_ERROR "fsdp2cpp: ${name} not found under ${dir}")
  endif()
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
  set(_fsdp2cpp_torch_link_options "LINKER:-rpath,${FSDP2CPP_TORCH_ROOT}/lib")
  if(CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang" AND CMAKE_SYSTEM_NAME STREQUAL "Linux")
    list(APPEND _fsdp2cpp_torch_link_options "LINKER:--push-state,--no-as-needed,-lstdc++,--pop-state")
  endif()
  # Torch headers are SYSTEM so that our warning flags do not fire inside them.
  set_target_properties(fsdp2cpp::torch PROPERTIES
    INTERFACE_INCLUDE_DIRECTORIES "${FSDP2CPP_TORCH_ROOT}/include;${FSDP2CPP_TORCH_ROOT}/include/torch/csrc/api/include"
    INTERFACE_SYSTEM_INCLUDE_DIRECTORIES "${FSDP2CPP_TORCH_ROOT}/include;${FSDP2CPP_TORCH_ROOT}/include/torch/csrc/api/include"
    INTERFACE_COMPILE_DEFINITIONS "_GLIBCXX_USE_CXX11_ABI=${FSDP2CPP_TORCH_CXX11_ABI}"
    INTERFACE_LINK_LIBRARIES "${FSDP2CPP_LIBTORCH};${FSDP2CPP_LIBTORCH_CPU};${FSDP2CPP_LIBC10}"
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
