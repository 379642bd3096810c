# Runs doc_examples_check on the fixture tree testdata/ and checks that it
# reports each planted problem: cmake -DCHECK=<exe> -DROOT=<dir> -P expect_drift.cmake
execute_process(COMMAND "${CHECK}" "${ROOT}" RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 1)
  message(FATAL_ERROR "doc_examples_check exited ${rc}, expected 1:\n${out}\n${err}")
endif()
foreach(expected
    "README.md:3: a ```cpp block that no build compiles"
    "docs/guide.md:4: this line of the example is not in examples/demo.cc \\(in this order\\):\n    int a = twice\\(3\\);\n  the file has:\n    int a = twice\\(2\\);"
    "lib/include/lib/api.h:8: this line of the example is not in examples/demo.cc \\(in this order\\):\n    int b = twice\\(2\\);"
    "3 problem\\(s\\) in the examples of 3 files")
  if(NOT err MATCHES "${expected}")
    message(FATAL_ERROR "doc_examples_check output lacks '${expected}':\n${err}")
  endif()
endforeach()
message(STATUS "doc_examples_check found the planted problems:\n${err}")
