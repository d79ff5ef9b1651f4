# ctest cuda_archs_native: ATTNKIT_CUDA_ARCHS=native (cmake/cuda_archs.cmake, the default of a pip
# build) maps the GPUs nvidia-smi lists to the architectures attnkit builds. A stand-in nvidia-smi
# prints each case's compute capabilities. -DSOURCE_DIR= -DWORK_DIR=
cmake_minimum_required(VERSION 3.24)
include(${SOURCE_DIR}/cmake/cuda_archs.cmake)
file(MAKE_DIRECTORY ${WORK_DIR})
set(fake ${WORK_DIR}/nvidia-smi)
# case: the lines nvidia-smi prints ("|"-separated; "fail" = it exits non-zero) = the expected
# architectures (","-separated)
set(cases
    "9.0=90a"
    "8.0=80"
    "8.6|8.9=80"
    "9.0|8.6|9.0=80,90a"
    "12.0=80"
    "7.5=80,90a"
    "7.5|9.0=90a"
    "=80,90a"
    "fail=80,90a")
foreach(case IN LISTS cases)
  string(REPLACE "=" ";" parts "${case}")
  list(GET parts 0 lines)
  list(GET parts 1 expected)
  string(REPLACE "," ";" expected "${expected}")
  if(lines STREQUAL "fail")
    file(WRITE ${fake} "#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
  else()
    string(REPLACE "|" "\\n" printed "${lines}")
    file(WRITE ${fake} "#!/bin/sh\nprintf '${printed}\\n'\n")
  endif()
  file(CHMOD ${fake} PERMISSIONS OWNER_READ OWNER_WRITE OWNER_EXECUTE)
  set(ATTNKIT_NVIDIA_SMI ${fake})
  attnkit_native_cuda_archs(got)
  if(NOT got STREQUAL expected)
    message(FATAL_ERROR "nvidia-smi printing '${lines}': got '${got}', expected '${expected}'")
  endif()
endforeach()
# Without nvidia-smi at all: the full list.
set(ATTNKIT_NVIDIA_SMI ATTNKIT_NVIDIA_SMI-NOTFOUND)
attnkit_native_cuda_archs(got)
if(NOT got STREQUAL "80;90a")
  message(FATAL_ERROR "without nvidia-smi: got '${got}'")
endif()
