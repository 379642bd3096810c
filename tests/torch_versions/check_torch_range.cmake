# cmake -DSOURCE_DIR=<fsdp2cpp> -DWORK_DIR=<scratch> -DGENERATOR=<gen> -P check_torch_range.cmake
# Configures fsdp2cpp against fake torch roots (a torch root is what has
# lib/libtorch_cpu.so and include/ATen/ATen.h) and checks what configure says.
file(REMOVE_RECURSE "${WORK_DIR}")

# configure_with(<case> <version.py __version__ or ""> <header MAJOR.MINOR.PATCH or "">)
# sets `output` (stdout and stderr), `rc` and `build` (the build directory).
function(configure_with case py_version header_version)
  set(root "${WORK_DIR}/${case}/torch")
  file(WRITE "${root}/lib/libtorch_cpu.so" "")
  file(WRITE "${root}/include/ATen/ATen.h" "")
  if(py_version)
    file(WRITE "${root}/version.py" "__version__ = '${py_version}'\n")
  endif()
  if(header_version)
    string(REPLACE "." ";" parts "${header_version}")
    list(GET parts 0 major)
    list(GET parts 1 minor)
    list(GET parts 2 patch)
    file(WRITE "${root}/include/torch/headeronly/version.h"
         "#define TORCH_VERSION_MAJOR ${major}\n\n#define TORCH_VERSION_MINOR ${minor}\n\n#define TORCH_VERSION_PATCH ${patch}\n")
  endif()
  set(build "${WORK_DIR}/${case}/build")
  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${SOURCE_DIR}" -B "${build}" -G "${GENERATOR}"
                          "-DFSDP2CPP_TORCH_ROOT=${root}" -DFSDP2CPP_CUDA=OFF
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE result)
  # CMake wraps long messages: compare with the line breaks as spaces.
  string(REGEX REPLACE "[ \n]+" " " all "${out}${err}")
  set(output "${all}" PARENT_SCOPE)
  set(rc "${result}" PARENT_SCOPE)
  set(build "${build}" PARENT_SCOPE)
  set(root "${root}" PARENT_SCOPE)
endfunction()

function(expect_refused case what)
  if(rc EQUAL 0)
    message(FATAL_ERROR "torch range: ${case}: configure succeeded, expected a refusal:\n${output}")
  endif()
  foreach(text "${what}" "fsdp2cpp builds against torch 2.11 to 2.15." "-DFSDP2CPP_PYTHON=" "TORCH_VERSION=2.15.0 make test")
    string(FIND "${output}" "${text}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "torch range: ${case}: the error lacks '${text}':\n${output}")
    endif()
  endforeach()
  file(STRINGS "${build}/CMakeCache.txt" kept REGEX "^FSDP2CPP_TORCH_ROOT:")
  if(kept)
    message(FATAL_ERROR "torch range: ${case}: the refused torch stayed in the cache: ${kept}")
  endif()
  message(STATUS "torch range: ${case}: refused, saying '${what}'")
endfunction()

configure_with(older "2.10.1+cpu" "")
expect_refused(older "the torch at ${root} is 2.10.1+cpu, outside the supported range.")
configure_with(newer "" "2.16.0")
expect_refused(newer "the torch at ${root} is 2.16.0, outside the supported range.")
configure_with(unknown "" "")
expect_refused(unknown "cannot tell the version of the torch at ${root}")

# In range: configure states the version and goes on (to fail later, on the
# fake root's missing libraries).
configure_with(in_range "2.13.0+cu130" "")
string(FIND "${output}" "fsdp2cpp: torch 2.13.0+cu130 at ${root} (supported: 2.11 to 2.15)" at)
string(FIND "${output}" "outside the supported range" refused)
if(at EQUAL -1 OR NOT refused EQUAL -1)
  message(FATAL_ERROR "torch range: in_range: 2.13.0 was not accepted with its version stated:\n${output}")
endif()
message(STATUS "torch range: in_range: 2.13.0+cu130 accepted and stated")
