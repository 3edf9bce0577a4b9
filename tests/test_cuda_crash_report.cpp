// A crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT) in a test binary prints the stack as
// "binary(+offset)" frames before the process dies, so that a crash on the GPU machine, where no
// debugger is installed, can be located afterwards (`addr2line -f -C -e attnrt_cuda_tests OFFSET`
// on the unstripped binary). Named test_cuda_* so both test binaries link it.
#include <execinfo.h>
#include <unistd.h>

#include <csignal>
#include <cstring>
#include <initializer_list>

namespace {

void report_and_reraise(int sig) {
  const char* head = "\n*** fatal signal in a test binary; stack (binary(+offset)):\n";
  [[maybe_unused]] ssize_t n = write(STDERR_FILENO, head, std::strlen(head));
  void* frames[64];
  const int count = backtrace(frames, 64);
  backtrace_symbols_fd(frames, count, STDERR_FILENO);
  std::signal(sig, SIG_DFL);
  std::raise(sig);
}

const bool installed = [] {
  for (int sig : {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT}) std::signal(sig, report_and_reraise);
  return true;
}();

}  // namespace
