#include "attnrt/backend/registry.h"

namespace attnrt {

void register_reference_backend(Registry&) {}

}  // namespace attnrt
