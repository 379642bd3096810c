# Installs fsdp2cpp into a fresh prefix, then configures, builds and runs a
# downstream project against the installed package (not the build tree); with
# DOWNSTREAM_SOURCE_DIR, also the example project examples/downstream, run as
# HSDP 2x2 on 4 ranks by the installed fsdprun.
#
#   cmake -DFSDP2CPP_BINARY_DIR=<build> -DPREFIX=<dir> -DCONSUMER_SOURCE_DIR=<dir>
#         -DCONSUMER_BINARY_DIR=<dir> -DEXPECTED_TORCH_ROOT=<dir>
#         [-DDOWNSTREAM_SOURCE_DIR=<dir> -DDOWNSTREAM_BINARY_DIR=<dir>]
#         [-DGENERATOR=<gen>] [-DMAKE_PROGRAM=<path>] [-DCXX_COMPILER=<path>]
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

file(REMOVE_RECURSE "${PREFIX}" "${CONSUMER_BINARY_DIR}" "${DOWNSTREAM_BINARY_DIR}")

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

step("build" "${CMAKE_COMMAND}" --build "${CONSUMER_BINARY_DIR}")

step("run" "${CONSUMER_BINARY_DIR}/consumer")
message(STATUS "consumer output:\n${step_output}")
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
step("run examples/downstream (fsdprun --nproc 4 --mesh 2x2)" "${fsdprun}" --nproc 4 --mesh 2x2 --
     "${DOWNSTREAM_BINARY_DIR}/tiny_lm_train")
message(STATUS "examples/downstream output:\n${step_output}")
if(NOT step_output MATCHES "\\[rank0\\] OK: 4 ranks, DeviceMesh\\(cpu, \\[\\[0, 1\\], \\[2, 3\\]\\]")
  message(FATAL_ERROR "consumer test: examples/downstream did not report a matching HSDP 2x2 run:\n${step_output}")
endif()
