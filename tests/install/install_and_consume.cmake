# cmake -DBUILD_DIR=... -DCONSUMER_DIR=... -DWORK_DIR=... [-DCONFIG=...] -DGENERATOR=...
#       [-DMAKE_PROGRAM=...] -DCXX_COMPILER=... [-DRUN_APP=1] -P install_and_consume.cmake
#
# 1. cmake --install BUILD_DIR into WORK_DIR/prefix
# 2. configure + build CONSUMER_DIR against it (same generator and compiler, CMAKE_PREFIX_PATH)
# 3. run the consumer (and the installed epmoe_run --help, which proves its RPATH)
cmake_minimum_required(VERSION 3.25)

foreach(var BUILD_DIR CONSUMER_DIR WORK_DIR GENERATOR CXX_COMPILER)
  if(NOT DEFINED ${var} OR "${${var}}" STREQUAL "")
    message(FATAL_ERROR "install_and_consume.cmake: -D${var}=... is required")
  endif()
endforeach()
if(NOT CONFIG)
  set(CONFIG Release)
endif()

set(prefix "${WORK_DIR}/prefix")
set(consumer_build "${WORK_DIR}/consumer-build")
file(REMOVE_RECURSE "${WORK_DIR}")
file(MAKE_DIRECTORY "${WORK_DIR}")

function(run_step name)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  message("---- ${name}: ${ARGN}\n${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${name} failed (exit ${rc})")
  endif()
  set(step_output "${out}" PARENT_SCOPE)
endfunction()

run_step(install "${CMAKE_COMMAND}" --install "${BUILD_DIR}" --prefix "${prefix}" --config "${CONFIG}")

set(configure_args -S "${CONSUMER_DIR}" -B "${consumer_build}" -G "${GENERATOR}"
    "-DCMAKE_CXX_COMPILER=${CXX_COMPILER}" "-DCMAKE_BUILD_TYPE=${CONFIG}"
    "-DCMAKE_PREFIX_PATH=${prefix}" "-DEXPECTED_PREFIX=${prefix}"
    # Only the prefix may satisfy find_package: no user/system package registry.
    -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
if(MAKE_PROGRAM)
  list(APPEND configure_args "-DCMAKE_MAKE_PROGRAM=${MAKE_PROGRAM}")
endif()
run_step(configure "${CMAKE_COMMAND}" ${configure_args})
run_step(build "${CMAKE_COMMAND}" --build "${consumer_build}" --config "${CONFIG}")

find_program(consumer NAMES epmoe_consumer PATHS "${consumer_build}" "${consumer_build}/${CONFIG}"
             NO_DEFAULT_PATH REQUIRED)
run_step(run "${consumer}")
if(NOT step_output MATCHES "total")
  message(FATAL_ERROR "the consumer's output does not look like MemoryPlan::explain()")
endif()

if(RUN_APP)
  run_step(installed-app "${prefix}/bin/epmoe_run" --help)
endif()
message("consumer: ok")
