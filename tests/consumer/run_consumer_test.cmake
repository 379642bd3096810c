# Installs fsdp2cpp into a fresh prefix, then configures, builds and runs a
# downstream project against the installed package (not the build tree); with
# DOWNSTREAM_SOURCE_DIR, also the example project examples/downstream, run as
# HSDP 2x2 on 4 ranks by the installed fsdprun.
#
#   cmake -DFSDP2CPP_BINARY_DIR=<build> -DPREFIX=<dir> -DCONSUMER_SOURCE_DIR=<dir>
#         -DCONSUMER_BINARY_DIR=<dir> -DEXPECTED_TORCH_ROOT=<dir>
#         [-DDOWNSTREAM_SOURCE_DIR=<dir> -DDOWNSTREAM_BINARY_DIR=<dir>]
#         [-DGENERATOR=<gen>] [-DMAKE_PROGRAM=<path>] [-DCXX_COMPILER=<path>]
#         [-DPYTHON=<python with that torch>]
#         -P run_consumer_test.cmake
#
# Fails (non-zero exit) on the first step that goes wrong, with its output.
cmake_minimum_required(VERSION 3.25)

foreach(var FSDP2CPP_BINARY_DIR PREFIX CONSUMER_SOURCE_DIR CONSUMER_BINARY_DIR EXPECTED_TORCH_ROOT)
  if(NOT DEFINED ${var})
    message(FATAL_ERROR "run_consumer_test.cmake: -D${var}=... is required")
  endif()
endforeach()

function(step name)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "consumer test: ${name} failed (${rc})\n${out}\n${err}")
  endif()
  message(STATUS "consumer test: ${name}: ok")
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

file(REMOVE_RECURSE "${PREFIX}" "${CONSUMER_BINARY_DIR}" "${DOWNSTREAM_BINARY_DIR}" "${CONSUMER_BINARY_DIR}-torch-dir"
     "${CONSUMER_BINARY_DIR}-bad-torch-dir" "${CONSUMER_BINARY_DIR}-bad-torch-root" "${CONSUMER_BINARY_DIR}-not-torch"
     "${CONSUMER_BINARY_DIR}-moved-prefix" "${CONSUMER_BINARY_DIR}-moved-none" "${CONSUMER_BINARY_DIR}-moved-python"
     "${CONSUMER_BINARY_DIR}-moved-prefix-path")

step("install" "${CMAKE_COMMAND}" --install "${FSDP2CPP_BINARY_DIR}" --prefix "${PREFIX}")

# The installed package must not point back into the build tree.
file(GLOB_RECURSE installed_cmake "${PREFIX}/*.cmake")
foreach(f IN LISTS installed_cmake)
  file(READ "${f}" text)
  string(FIND "${text}" "${FSDP2CPP_BINARY_DIR}" at)
  if(NOT at EQUAL -1)
    message(FATAL_ERROR "consumer test: ${f} refers to the build tree ${FSDP2CPP_BINARY_DIR}")
  endif()
endforeach()

# The toolchain of the fsdp2cpp build, for every project configured here.
set(toolchain_args "-DCMAKE_PREFIX_PATH=${PREFIX}")
if(GENERATOR)
  list(APPEND toolchain_args -G "${GENERATOR}")
endif()
if(MAKE_PROGRAM)
  list(APPEND toolchain_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
if(CXX_COMPILER)
  list(APPEND toolchain_args "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}")
endif()
set(configure_args -S "${CONSUMER_SOURCE_DIR}" -B "${CONSUMER_BINARY_DIR}" ${toolchain_args})
step("configure" "${CMAKE_COMMAND}" ${configure_args})
string(FIND "${step_output}" "torch at ${EXPECTED_TORCH_ROOT}" at)
if(at EQUAL -1)
  message(FATAL_ERROR "consumer test: the package did not find the torch it was built with "
                      "(${EXPECTED_TORCH_ROOT}):\n${step_output}")
endif()

# The torch can be named explicitly (the recorded one may be gone with the
# clone it lived in): Torch_DIR of the same torch is used ...
step("configure with -DTorch_DIR" "${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${CONSUMER_BINARY_DIR}-torch-dir"
     ${toolchain_args} "-DTorch_DIR=${EXPECTED_TORCH_ROOT}/share/cmake/Torch")
string(FIND "${step_output}" "at ${EXPECTED_TORCH_ROOT} (from Torch_DIR=${EXPECTED_TORCH_ROOT}/share/cmake/Torch)" at)
if(at EQUAL -1)
  message(FATAL_ERROR "consumer test: -DTorch_DIR did not choose ${EXPECTED_TORCH_ROOT}:\n${step_output}")
endif()
# ... and one that is not a torch stops the configure, saying how to fix it.
function(expect_configure_error name dir)
  execute_process(COMMAND "${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}" -B "${dir}" ${toolchain_args} ${ARGN}
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \n]+" " " text "${err}")  # CMake wraps message text
  if(rc EQUAL 0)
    message(FATAL_ERROR "consumer test: configure with ${name} succeeded; it must fail:\n${out}\n${err}")
  endif()
  foreach(expected IN LISTS expected_errors)
    string(FIND "${text}" "${expected}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "consumer test: configure with ${name} did not say '${expected}':\n${err}")
    endif()
  endforeach()
  message(STATUS "consumer test: configure with ${name} fails as it must")
endfunction()
set(not_torch "${CONSUMER_BINARY_DIR}-not-torch")
file(MAKE_DIRECTORY "${not_torch}")
set(expected_errors "Torch_DIR=${not_torch} has no TorchConfig.cmake"
    "-DTorch_DIR=<site-packages>/torch/share/cmake/Torch" "-DFSDP2CPP_PYTHON=" "-DFSDP2CPP_TORCH_ROOT=")
expect_configure_error("an invalid -DTorch_DIR" "${CONSUMER_BINARY_DIR}-bad-torch-dir" "-DTorch_DIR=${not_torch}")
set(expected_errors "FSDP2CPP_TORCH_ROOT=${not_torch} is not a torch package" "-DTorch_DIR=")
expect_configure_error("an invalid -DFSDP2CPP_TORCH_ROOT" "${CONSUMER_BINARY_DIR}-bad-torch-root"
                       "-DFSDP2CPP_TORCH_ROOT=${not_torch}")

# The recorded torch gone (the clone whose .venv held it deleted): a copy of
# the package whose config records a torch root that does not exist, its
# libraries and headers linked from the real prefix, configured with no
# torch named in the environment or on CMAKE_PREFIX_PATH.
set(moved "${CONSUMER_BINARY_DIR}-moved-prefix")
set(gone "${CONSUMER_BINARY_DIR}-deleted-clone/torch")
file(MAKE_DIRECTORY "${moved}/lib/cmake/fsdp2cpp")
file(CREATE_LINK "${PREFIX}/include" "${moved}/include" SYMBOLIC)
file(GLOB installed_libs LIST_DIRECTORIES false "${PREFIX}/lib/*")
foreach(lib IN LISTS installed_libs)
  get_filename_component(name "${lib}" NAME)
  file(CREATE_LINK "${lib}" "${moved}/lib/${name}" SYMBOLIC)
endforeach()
file(GLOB package_files "${PREFIX}/lib/cmake/fsdp2cpp/*.cmake")
foreach(f IN LISTS package_files)
  get_filename_component(name "${f}" NAME)
  file(READ "${f}" text)
  string(REPLACE "${EXPECTED_TORCH_ROOT}" "${gone}" text "${text}")
  file(WRITE "${moved}/lib/cmake/fsdp2cpp/${name}" "${text}")
endforeach()
set(moved_toolchain_args "${toolchain_args}")
list(REMOVE_ITEM moved_toolchain_args "-DCMAKE_PREFIX_PATH=${PREFIX}")
set(no_torch_env "${CMAKE_COMMAND}" -E env --unset=FSDP2CPP_PYTHON --unset=FSDP2CPP_TORCH_ROOT --unset=Torch_DIR
                 --unset=CMAKE_PREFIX_PATH "PATH=/usr/bin:/bin")
execute_process(COMMAND ${no_torch_env} python3 -c "import torch" RESULT_VARIABLE rc OUTPUT_QUIET ERROR_QUIET)
if(rc EQUAL 0)
  message(STATUS "consumer test: python3 in /usr/bin has torch; not checking the error for no torch at all")
else()
  execute_process(COMMAND ${no_torch_env} "${CMAKE_COMMAND}" -S "${CONSUMER_SOURCE_DIR}"
                          -B "${CONSUMER_BINARY_DIR}-moved-none" ${moved_toolchain_args} "-DCMAKE_PREFIX_PATH=${moved}"
                  RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  string(REGEX REPLACE "[ \n]+" " " text "${err}")
  foreach(expected "fsdp2cpp: cannot find torch" "at ${gone}, which is no longer there"
                   "-DTorch_DIR=<site-packages>/torch/share/cmake/Torch" "-DFSDP2CPP_PYTHON=")
    string(FIND "${text}" "${expected}" at)
    if(rc EQUAL 0 OR at EQUAL -1)
      message(FATAL_ERROR "consumer test: with the recorded torch gone and none given, configure did not fail "
                          "saying '${expected}' (${rc}):\n${out}\n${err}")
    endif()
  endforeach()
  message(STATUS "consumer test: recorded torch gone, none given: fails as it must")
endif()
if(PYTHON)
  step("configure with the recorded torch gone and -DFSDP2CPP_PYTHON" ${no_torch_env} "${CMAKE_COMMAND}"
       -S "${CONSUMER_SOURCE_DIR}" -B "${CONSUMER_BINARY_DIR}-moved-python" ${moved_toolchain_args}
       "-DCMAKE_PREFIX_PATH=${moved}" "-DFSDP2CPP_PYTHON=${PYTHON}")
  string(FIND "${step_output}" "at ${EXPECTED_TORCH_ROOT} (from FSDP2CPP_PYTHON=${PYTHON})" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "consumer test: -DFSDP2CPP_PYTHON did not choose ${EXPECTED_TORCH_ROOT}:\n${step_output}")
  endif()
endif()
# (the environment's CMAKE_PREFIX_PATH: a list in -D would split here)
step("configure with the recorded torch gone and torch on CMAKE_PREFIX_PATH" "${CMAKE_COMMAND}" -E env
     --unset=FSDP2CPP_PYTHON --unset=FSDP2CPP_TORCH_ROOT --unset=Torch_DIR "PATH=/usr/bin:/bin"
     "CMAKE_PREFIX_PATH=${EXPECTED_TORCH_ROOT}/share/cmake" "${CMAKE_COMMAND}"
     -S "${CONSUMER_SOURCE_DIR}" -B "${CONSUMER_BINARY_DIR}-moved-prefix-path" ${moved_toolchain_args}
     "-DCMAKE_PREFIX_PATH=${moved}")
string(FIND "${step_output}" "at ${EXPECTED_TORCH_ROOT} (from CMAKE_PREFIX_PATH" at)
if(at EQUAL -1)
  message(FATAL_ERROR "consumer test: CMAKE_PREFIX_PATH did not lead to ${EXPECTED_TORCH_ROOT}:\n${step_output}")
endif()

step("build" "${CMAKE_COMMAND}" --build "${CONSUMER_BINARY_DIR}")

step("run" "${CONSUMER_BINARY_DIR}/consumer")
message(STATUS "consumer output:\n${step_output}")
# The program itself finds LibTorch, through its own RUNPATH (the torch its
# configure chose), not through the installed libraries' RUNPATH, which
# names the torch they were built with and breaks when that one is deleted.
execute_process(COMMAND "${CMAKE_COMMAND}" -E env LD_DEBUG=libs "${CONSUMER_BINARY_DIR}/consumer"
                OUTPUT_QUIET ERROR_VARIABLE loader_log)
foreach(lib libtorch.so libtorch_cpu.so libc10.so)
  string(REPLACE "." "\\." lib_re "${lib}")
  if(NOT loader_log MATCHES "find library=${lib_re} \\[0\\]; searching\n[^\n]*search path=[^\n]*\\(RUNPATH from file [^\n]*/consumer\\)")
    message(FATAL_ERROR "consumer test: the consumer program does not load ${lib} through its own RUNPATH "
                        "(LD_DEBUG=libs):\n${loader_log}")
  endif()
endforeach()
message(STATUS "consumer test: LibTorch found through the program's RUNPATH: ok")
foreach(expected
    "chunk_extent\\(10, 4, 3\\) = {9, 1}; torch.chunk: {9, 1}"
    "reduce op: [A-Za-z]"
    "placement: Shard\\(0\\)")
  if(NOT step_output MATCHES "${expected}")
    message(FATAL_ERROR "consumer test: output does not match '${expected}':\n${step_output}")
  endif()
endforeach()

step("run consumer_filesystem" "${CONSUMER_BINARY_DIR}/consumer_filesystem")
message(STATUS "consumer_filesystem output:\n${step_output}")
if(NOT step_output MATCHES "filesystem: ok")
  message(FATAL_ERROR "consumer test: consumer_filesystem did not report 'filesystem: ok':\n${step_output}")
endif()

if(NOT DOWNSTREAM_SOURCE_DIR)
  return()
endif()
set(fsdprun "${PREFIX}/bin/fsdprun")
if(NOT EXISTS "${fsdprun}")
  message(FATAL_ERROR "consumer test: the install has no ${fsdprun}")
endif()
step("configure examples/downstream" "${CMAKE_COMMAND}" -S "${DOWNSTREAM_SOURCE_DIR}" -B "${DOWNSTREAM_BINARY_DIR}"
     ${toolchain_args})
step("build examples/downstream" "${CMAKE_COMMAND}" --build "${DOWNSTREAM_BINARY_DIR}")
set(profile_dir "${DOWNSTREAM_BINARY_DIR}/profile")
file(REMOVE_RECURSE "${profile_dir}")
step("run examples/downstream (fsdprun --nproc 4 --mesh 2x2, --profile)" "${fsdprun}" --nproc 4 --mesh 2x2 --
     "${DOWNSTREAM_BINARY_DIR}/tiny_lm_train" --profile "${profile_dir}")
message(STATUS "examples/downstream output:\n${step_output}")
if(NOT step_output MATCHES "\\[rank0\\] OK: 4 ranks, DeviceMesh\\(cpu, \\[\\[0, 1\\], \\[2, 3\\]\\]")
  message(FATAL_ERROR "consumer test: examples/downstream did not report a matching HSDP 2x2 run:\n${step_output}")
endif()
# fsdp::Profiler from the installed headers and library: one trace per rank,
# the root's phases named.
foreach(rank RANGE 3)
  set(trace "${profile_dir}/trace_rank${rank}.json")
  if(NOT EXISTS "${trace}")
    message(FATAL_ERROR "consumer test: examples/downstream --profile wrote no ${trace}:\n${step_output}")
  endif()
  file(READ "${trace}" trace_text)
  foreach(label "ProfilerStep#1" "FSDP::all_gather (root)" "FSDP::reduce_scatter (blocks.0)")
    string(FIND "${trace_text}" "${label}" at)
    if(at EQUAL -1)
      message(FATAL_ERROR "consumer test: ${trace} has no '${label}'")
    endif()
  endforeach()
endforeach()
