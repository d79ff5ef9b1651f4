# ctest wgmma_mma_async_not_serialized: compiles every source that issues wgmma.mma_async for
# sm_90a with ptxas' report (-Xptxas -v) and fails where ptxas made those MMAs synchronous
# ("wgmma.mma_async instructions are serialized due to ...", C7510-C7520: a WARPGROUP.DEPBAR
# after every HGMMA). ptxas does that silently, as an info line, e.g. when a warp-role branch is
# not provably warp-uniform or an MMA operand register is redefined (spilled) while MMAs are in
# flight; the kernels stay correct and lose their overlap (docs/decode_design.md, "The
# warpgroup-MMA kernel for large groups").
#
# Inputs (-D): NVCC, SOURCE_DIR, GENERATED_DIR (the build's generated/ folder), WORK_DIR,
# DEFINES ("|"-separated NAME=VALUE), SOURCES
# ("|"-separated paths).
file(MAKE_DIRECTORY "${WORK_DIR}")
string(REPLACE "|" ";" DEFINES "${DEFINES}")
string(REPLACE "|" ";" SOURCES "${SOURCES}")
set(defines)
foreach(d IN LISTS DEFINES)
  list(APPEND defines "-D${d}")
endforeach()
set(failures 0)
foreach(src IN LISTS SOURCES)
  get_filename_component(name "${src}" NAME_WE)
  execute_process(
    COMMAND "${NVCC}" -std=c++20 --expt-relaxed-constexpr -O3 -cubin
            -gencode arch=compute_90a,code=sm_90a -Xptxas -v
            -I${SOURCE_DIR}/include -I${SOURCE_DIR}/src -I${GENERATED_DIR} ${defines}
            "${src}" -o "${WORK_DIR}/${name}.cubin"
    RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
  set(report "${out}${err}")
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${src}: nvcc failed (${rc}):\n${report}")
  endif()
  # Not vacuous: the sm_90a pass compiled the kernels' bodies (an empty body, as the sm_80 pass
  # compiles them, uses a handful of registers).
  string(REGEX MATCHALL "Used [0-9]+ registers" used "${report}")
  set(largest 0)
  foreach(u IN LISTS used)
    string(REGEX REPLACE "Used ([0-9]+) registers" "\\1" n "${u}")
    if(n GREATER largest)
      set(largest ${n})
    endif()
  endforeach()
  if(largest LESS 64)
    message(FATAL_ERROR "${src}: no kernel with a compiled body for sm_90a (largest register "
                        "count ${largest}); the check would be vacuous:\n${report}")
  endif()
  string(REGEX MATCHALL "[^\n]*wgmma[^\n]*serialized[^\n]*" serialized "${report}")
  if(serialized)
    math(EXPR failures "${failures} + 1")
    string(REPLACE ";" "\n" lines "${serialized}")
    message(SEND_ERROR "${src}: ptxas serialized wgmma.mma_async:\n${lines}")
  else()
    message(STATUS "${src}: wgmma.mma_async kept asynchronous (largest kernel ${largest} registers)")
  endif()
endforeach()
if(failures GREATER 0)
  message(FATAL_ERROR "${failures} source(s) with serialized wgmma.mma_async")
endif()
