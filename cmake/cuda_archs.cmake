# ATTNKIT_CUDA_ARCHS=native (the default of `pip install .`, pyproject.toml): build for the GPUs of
# this machine instead of the whole "80;90a" matrix, which halves the CUDA compile time when only
# one of the two is wanted. CMake's own CUDA_ARCHITECTURES=native cannot be used: it gives "90" for
# a Hopper GPU, and the Hopper kernels need the arch-specific "90a".
#
# Each GPU that nvidia-smi lists maps to what attnkit builds for it: compute capability 9.x -> 90a
# (the TMA + wgmma kernels and the portable ones), any other 8.0 or newer -> 80 (sm_80 code runs
# on every 8.x GPU; newer GPUs compile its PTX when the library is loaded). GPUs older than 8.0
# cannot run the CUDA backend and are left out. With no GPU listed (a build machine without one,
# or no nvidia-smi) the full "80;90a" is built, and the message says so.
function(attnkit_native_cuda_archs out_var)
  set(default_archs "80;90a")
  find_program(ATTNKIT_NVIDIA_SMI nvidia-smi)
  set(caps "")
  if(ATTNKIT_NVIDIA_SMI)
    execute_process(COMMAND ${ATTNKIT_NVIDIA_SMI} --query-gpu=compute_cap --format=csv,noheader
                    OUTPUT_VARIABLE caps RESULT_VARIABLE rc ERROR_QUIET
                    OUTPUT_STRIP_TRAILING_WHITESPACE)
    if(rc)
      set(caps "")
    endif()
  endif()
  string(REGEX REPLACE "[\r\n]+" ";" caps "${caps}")
  set(archs "")
  foreach(cap IN LISTS caps)
    string(STRIP "${cap}" cap)
    if(NOT cap MATCHES "^([0-9]+)\\.([0-9]+)$")
      continue()
    endif()
    set(major ${CMAKE_MATCH_1})
    if(major EQUAL 9)
      list(APPEND archs 90a)
    elseif(major GREATER_EQUAL 8)
      list(APPEND archs 80)
    else()
      message(STATUS "attnkit: GPU of compute capability ${cap} left out (the CUDA backend needs "
                     "8.0 or newer)")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES archs)
  if(archs)
    list(SORT archs)
    list(JOIN caps ", " caps_text)
    message(STATUS "attnkit: ATTNKIT_CUDA_ARCHS=native: the GPUs here (compute capability "
                   "${caps_text}) -> ${archs}")
  else()
    set(archs ${default_archs})
    message(STATUS "attnkit: ATTNKIT_CUDA_ARCHS=native: no GPU listed by nvidia-smi, building "
                   "for ${archs} (set ATTNKIT_CUDA_ARCHS to choose)")
  endif()
  set(${out_var} "${archs}" PARENT_SCOPE)
endfunction()
