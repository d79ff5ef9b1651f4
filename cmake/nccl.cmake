# NCCL for the context-parallel communicator (docs/context_parallel.md, docs/building.md).
#
# attnkit compiles against nccl.h and opens libnccl.so.2 at run time (dlopen), so only the header
# is needed to build; the library found here is the fallback path dlopen tries after the soname.
# Searched, in order: NCCL_ROOT / NCCL_HOME (CMake or environment variables), the CUDA toolkit
# (which ships NCCL in recent releases), the nvidia-nccl-cu* wheel of the Python on PATH, the
# system paths.
#
# attnkit_find_nccl(<mode>) with mode ON (fail when missing), AUTO or OFF sets ATTNKIT_NCCL (ON or
# OFF), ATTNKIT_NCCL_INCLUDE_DIR and ATTNKIT_NCCL_LIBRARY in the caller's scope.
function(attnkit_find_nccl mode)
  set(ATTNKIT_NCCL OFF PARENT_SCOPE)
  if(mode STREQUAL "OFF")
    return()
  endif()
  if(NOT ATTNKIT_CUDA)
    if(mode STREQUAL "ON")
      message(FATAL_ERROR "ATTNKIT_WITH_NCCL=ON needs the CUDA backend (ATTNKIT_WITH_CUDA)")
    endif()
    return()
  endif()

  set(hints)
  foreach(root IN ITEMS "${NCCL_ROOT}" "$ENV{NCCL_ROOT}" "${NCCL_HOME}" "$ENV{NCCL_HOME}")
    if(root)
      list(APPEND hints "${root}")
    endif()
  endforeach()
  if(CUDAToolkit_LIBRARY_ROOT)
    list(APPEND hints "${CUDAToolkit_LIBRARY_ROOT}")
  endif()
  foreach(dir IN LISTS CUDAToolkit_INCLUDE_DIRS)
    get_filename_component(parent "${dir}" DIRECTORY)
    list(APPEND hints "${parent}")
  endforeach()
  find_program(ATTNKIT_NCCL_PYTHON NAMES python3 python)
  if(ATTNKIT_NCCL_PYTHON)
    # nvidia.nccl is a namespace package: its directory is __path__[0].
    execute_process(
      COMMAND "${ATTNKIT_NCCL_PYTHON}" -c "import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])"
      OUTPUT_VARIABLE wheel_dir OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE wheel_missing
      ERROR_QUIET)
    if(NOT wheel_missing AND wheel_dir)
      list(APPEND hints "${wheel_dir}")
    endif()
  endif()

  find_path(ATTNKIT_NCCL_INCLUDE_DIR nccl.h HINTS ${hints} PATH_SUFFIXES include)
  find_library(ATTNKIT_NCCL_LIBRARY NAMES nccl libnccl.so.2 HINTS ${hints}
               PATH_SUFFIXES lib lib64 lib/x86_64-linux-gnu lib/aarch64-linux-gnu)
  set(version "")
  if(ATTNKIT_NCCL_INCLUDE_DIR)
    file(STRINGS "${ATTNKIT_NCCL_INCLUDE_DIR}/nccl.h" lines REGEX "#define NCCL_(MAJOR|MINOR) ")
    string(REGEX REPLACE ".*NCCL_MAJOR ([0-9]+).*" "\\1" major "${lines}")
    string(REGEX REPLACE ".*NCCL_MINOR ([0-9]+).*" "\\1" minor "${lines}")
    set(version "${major}.${minor}")
  endif()
  # ncclSend / ncclRecv arrived in NCCL 2.7.
  if(ATTNKIT_NCCL_INCLUDE_DIR AND version VERSION_GREATER_EQUAL 2.7)
    set(ATTNKIT_NCCL ON PARENT_SCOPE)
    message(STATUS "attnkit: NCCL ${version} (${ATTNKIT_NCCL_INCLUDE_DIR}; library "
                   "${ATTNKIT_NCCL_LIBRARY}, opened at run time)")
  elseif(mode STREQUAL "ON")
    message(FATAL_ERROR "ATTNKIT_WITH_NCCL=ON: nccl.h of NCCL >= 2.7 not found (got "
                        "'${ATTNKIT_NCCL_INCLUDE_DIR}' version '${version}'); set NCCL_ROOT or "
                        "pip install nvidia-nccl-cu12")
  else()
    message(STATUS "attnkit: NCCL not found (context parallelism over NCCL off; set NCCL_ROOT)")
  endif()
  set(library "${ATTNKIT_NCCL_LIBRARY}")
  if(NOT library)
    set(library "")  # dlopen then tries the sonames only
  endif()
  set(ATTNKIT_NCCL_INCLUDE_DIR "${ATTNKIT_NCCL_INCLUDE_DIR}" PARENT_SCOPE)
  set(ATTNKIT_NCCL_LIBRARY "${library}" PARENT_SCOPE)
endfunction()
