// The one place that lists the built-in backends. Adding a backend: its folder plus one line here.
#include "attnrt/backend/registry.h"

namespace attnrt {

void register_reference_backend(Registry& registry);
void register_cpu_backend(Registry& registry);
void register_cuda_backend(Registry& registry);

void register_builtin_backends(Registry& registry) {
  register_reference_backend(registry);
  register_cpu_backend(registry);
  register_cuda_backend(registry);
}

}  // namespace attnrt
