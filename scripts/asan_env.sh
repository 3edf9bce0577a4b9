# Sourced by sanitize.sh and fuzz.sh: the build-asan/ configuration they share (one compilation
# serves both: clang, -O1, CUDA off, AddressSanitizer + UndefinedBehaviorSanitizer with every report
# fatal, libFuzzer's coverage instrumentation and the harnesses in fuzz/), and the sanitizers'
# run-time options.
ATTNRT_SETUP_CLANG=1 bash scripts/setup.sh --deps-only
asan_build=build-asan
cmake -S . -B "$asan_build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O1 -g" \
  -DATTNRT_CUDA=OFF -DATTNRT_INSTALL=OFF -DATTNRT_SANITIZE=address,undefined -DATTNRT_FUZZ=ON \
  ${ATTNRT_CMAKE_ARGS:-} >/dev/null
export ASAN_OPTIONS=halt_on_error=1:detect_leaks=1:abort_on_error=1:detect_stack_use_after_return=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
