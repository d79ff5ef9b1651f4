# ctest example_cpp_quickstart: installs the build tree into a scratch prefix, then configures,
# builds and runs examples/cpp (the quick start of docs/guide.md) against it.
foreach(step IN ITEMS install configure build run)
  if(step STREQUAL "install")
    file(REMOVE_RECURSE ${WORK_DIR})
    set(cmd ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${WORK_DIR}/prefix)
  elseif(step STREQUAL "configure")
    # CONSUMER_ARGS: "|"-separated (the compiler, and a sanitized build's flags).
    string(REPLACE "|" ";" consumer_args "${CONSUMER_ARGS}")
    set(cmd ${CMAKE_COMMAND} -S ${CMAKE_CURRENT_LIST_DIR} -B ${WORK_DIR}/build
            -DCMAKE_PREFIX_PATH=${WORK_DIR}/prefix ${consumer_args})
  elseif(step STREQUAL "build")
    set(cmd ${CMAKE_COMMAND} --build ${WORK_DIR}/build)
  else()
    set(cmd ${WORK_DIR}/build/quickstart)
  endif()
  execute_process(COMMAND ${cmd} RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "examples/cpp: ${step} failed (${rc})")
  endif()
endforeach()
