# ctest install.find_package: installs the build into WORK_DIR/prefix, checks that no tool library
# went with it, then configures, builds and runs examples/find_package against it, as an engine's
# build would (examples/engine_step.cpp linked with the static library and with the shared one).
set(prefix ${WORK_DIR}/prefix)
set(build ${WORK_DIR}/build)
file(REMOVE_RECURSE ${WORK_DIR})

function(run what)
  execute_process(COMMAND ${ARGN} RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE out)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${what} failed (${rc}):\n${out}")
  endif()
  message(STATUS "${what}: ok")
  set(last_output "${out}" PARENT_SCOPE)
endfunction()

run("install" ${CMAKE_COMMAND} --install ${BUILD_DIR} --prefix ${prefix})
# The tools' libraries stay in the build tree: only libattnrt is the engine's.
foreach(tool_library attnrt_sim attnrt_io attnrt_bench attnrt_conformance)
  file(GLOB_RECURSE leaked ${prefix}/*${tool_library}*)
  if(leaked)
    message(FATAL_ERROR "the install holds a tool library: ${leaked}")
  endif()
endforeach()
foreach(expected ${LIBDIR}/libattnrt.a ${LIBDIR}/libattnrt.so
                 ${INCLUDEDIR}/attnrt/runtime/attention_runtime.h
                 ${LIBDIR}/cmake/attnrt/attnrtConfig.cmake
                 ${LIBDIR}/cmake/attnrt/attnrtConfigVersion.cmake)
  if(NOT EXISTS ${prefix}/${expected})
    message(FATAL_ERROR "the install lacks ${expected}")
  endif()
endforeach()

set(configure_args -S ${SOURCE_DIR} -B ${build} -G ${GENERATOR}
    -DCMAKE_CXX_COMPILER=${CXX_COMPILER} -DCMAKE_BUILD_TYPE=${BUILD_TYPE}
    -DCMAKE_PREFIX_PATH=${prefix})
if(CUDA_ROOT)
  list(APPEND configure_args -DCUDAToolkit_ROOT=${CUDA_ROOT})
endif()
run("configure" ${CMAKE_COMMAND} ${configure_args})
run("build" ${CMAKE_COMMAND} --build ${build} --parallel 2)
foreach(app engine_step_static engine_step_shared)
  run("${app}" ${build}/${app})
  message(STATUS "${last_output}")
endforeach()
