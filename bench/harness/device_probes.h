// The device probes of the harness: GPU ceilings and the GPU timer. They live here, not in the
// backends, so that the library an engine links carries no benchmark code.
#pragma once

namespace attnrt::bench {

// Installs the probes of every device this build supports (register_ceiling_probe,
// register_device_timer) on the first call; later calls do nothing.
void install_builtin_device_probes();

}  // namespace attnrt::bench
