// TensorView: a non-owning view (data, device, dtype, shape, strides in elements).
// HostBuffer: owning, 64-byte aligned host memory. CUDA buffers live with the CUDA backend.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "attnrt/core/dtype.h"

namespace attnrt {

enum class DeviceKind : uint8_t { cpu, cuda };

struct Device {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  bool operator==(const Device&) const = default;
  static Device cpu() { return {DeviceKind::cpu, 0}; }
  static Device cuda(int i = 0) { return {DeviceKind::cuda, i}; }
};
std::string device_name(Device d);

inline constexpr int kMaxDims = 5;

struct TensorView {
  void* data = nullptr;
  Device device;
  DType dtype = DType::f32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // in elements

  TensorView() = default;
  // Contiguous row-major view.
  TensorView(void* data, DType dtype, std::initializer_list<int64_t> shape,
             Device device = Device::cpu());

  int64_t size(int dim) const { return shape[dim]; }
  int64_t numel() const;
  bool is_contiguous() const;
  bool empty() const { return data == nullptr; }
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
  std::string describe() const;  // "bf16[4, 32, 128] on cpu", for error messages
};

class HostBuffer {
 public:
  HostBuffer() = default;
  HostBuffer(DType dtype, std::initializer_list<int64_t> shape);
  HostBuffer(DType dtype, const std::array<int64_t, kMaxDims>& shape, int ndim);

  TensorView view() const { return view_; }
  void* data() const { return view_.data; }
  template <typename T>
  T* ptr() const { return static_cast<T*>(view_.data); }
  int64_t numel() const { return view_.numel(); }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(view_.dtype); }
  DType dtype() const { return view_.dtype; }

 private:
  struct Free {
    void operator()(void* p) const;
  };
  std::unique_ptr<void, Free> storage_;
  TensorView view_;
};

}  // namespace attnrt
