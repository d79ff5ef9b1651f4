# ctest installed_program_and_package: `cmake --install` into a scratch prefix, the prefix moved
# elsewhere (an installation must not depend on where it was installed, nor on the build tree),
# then the installed `attnkit` program and, when built, the installed Python package are run from
# there with no library path set.
#   -DBINARY_DIR= -DWORK_DIR= -DBINDIR= (CMAKE_INSTALL_BINDIR) -DVERSION=
#   -DPYTHON= -DPYTHON_DIR= (ATTNKIT_PYTHON_INSTALL_DIR) -DCHECK_PY= (check_python.py), when the
#   extension is built
file(REMOVE_RECURSE ${WORK_DIR})
execute_process(COMMAND ${CMAKE_COMMAND} --install ${BINARY_DIR} --prefix ${WORK_DIR}/installed
                OUTPUT_QUIET RESULT_VARIABLE rc)
if(rc)
  message(FATAL_ERROR "cmake --install failed (${rc})")
endif()
file(RENAME ${WORK_DIR}/installed ${WORK_DIR}/moved)
set(prefix ${WORK_DIR}/moved)
set(program ${prefix}/${BINDIR}/attnkit)

# The program finds libattnkit through a RUNPATH relative to itself, never through the build tree.
file(READ_ELF ${program} RUNPATH runpath RPATH rpath CAPTURE_ERROR elf_error)
if(elf_error)
  message(FATAL_ERROR "${program}: ${elf_error}")
endif()
if(NOT "${runpath}${rpath}" MATCHES "^\\$ORIGIN/")
  message(FATAL_ERROR "${program}: RUNPATH '${runpath}' RPATH '${rpath}' is not relative to "
                      "$ORIGIN")
endif()
string(FIND "${runpath}${rpath}" "${BINARY_DIR}" in_build_tree)
if(NOT in_build_tree EQUAL -1)
  message(FATAL_ERROR "${program}: RUNPATH '${runpath}' RPATH '${rpath}' names the build tree")
endif()

# run(NAME COMMAND...): the command in an environment without LD_LIBRARY_PATH / PYTHONPATH;
# NAME_out holds its standard output.
function(run name)
  execute_process(COMMAND ${CMAKE_COMMAND} -E env --unset=LD_LIBRARY_PATH --unset=PYTHONPATH
                          ${ARGN}
                  OUTPUT_VARIABLE out ERROR_VARIABLE err RESULT_VARIABLE rc)
  if(rc)
    message(FATAL_ERROR "${name}: exit status ${rc}\n${out}\n${err}")
  endif()
  set(${name}_out "${out}" PARENT_SCOPE)
endfunction()

run(version ${program} --version)
if(NOT version_out MATCHES "^attnkit ${VERSION} ")
  message(FATAL_ERROR "attnkit --version printed '${version_out}'")
endif()
run(info ${program} info)
if(NOT info_out MATCHES "^attnkit ${VERSION}\n" OR NOT info_out MATCHES "support matrix on cpu")
  message(FATAL_ERROR "attnkit info printed\n${info_out}")
endif()
message(STATUS "installed program: ${program} (RUNPATH ${runpath}${rpath}) runs")

if(PYTHON)
  # The package lies in <prefix>/<PYTHON_DIR>/attnkit and its module finds <prefix>/<LIBDIR>.
  if(EXISTS ${prefix}/attnkit)
    message(FATAL_ERROR "cmake --install put a Python package at ${prefix}/attnkit")
  endif()
  if(NOT EXISTS ${prefix}/${PYTHON_DIR}/attnkit/__init__.py)
    message(FATAL_ERROR "no attnkit package in ${prefix}/${PYTHON_DIR}")
  endif()
  run(python ${CMAKE_COMMAND} -E env PYTHONPATH=${prefix}/${PYTHON_DIR}
          ${PYTHON} ${CHECK_PY} ${prefix}/${PYTHON_DIR})
  message(STATUS "installed Python package: ${python_out}")
endif()
