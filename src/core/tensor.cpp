#include "attnrt/core/tensor.h"

#include <cstdlib>
#include <cstring>

#include "attnrt/core/error.h"

namespace attnrt {

std::string device_name(Device d) {
  return d.kind == DeviceKind::cpu ? std::string("cpu") : fmt::format("cuda:{}", d.index);
}

TensorView::TensorView(void* data_, DType dtype_, std::initializer_list<int64_t> shape_,
                       Device device_)
    : data(data_), device(device_), dtype(dtype_), ndim(static_cast<int>(shape_.size())) {
  ATTNRT_CHECK(ndim <= kMaxDims, "TensorView: {} dims given, at most {} supported", ndim, kMaxDims);
  int i = 0;
  for (int64_t s : shape_) shape[i++] = s;
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    strides[d] = stride;
    stride *= shape[d];
  }
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != stride) return false;
    stride *= shape[d];
  }
  return true;
}

std::string TensorView::describe() const {
  std::string dims;
  for (int d = 0; d < ndim; ++d) dims += fmt::format("{}{}", d ? ", " : "", shape[d]);
  return fmt::format("{}[{}] on {}", dtype_name(dtype), dims, device_name(device));
}

void HostBuffer::Free::operator()(void* p) const { std::free(p); }

HostBuffer::HostBuffer(DType dtype, std::initializer_list<int64_t> shape) {
  std::array<int64_t, kMaxDims> dims{};
  int n = 0;
  for (int64_t s : shape) dims[n++] = s;
  *this = HostBuffer(dtype, dims, n);
}

HostBuffer::HostBuffer(DType dtype, const std::array<int64_t, kMaxDims>& shape, int ndim) {
  view_.dtype = dtype;
  view_.ndim = ndim;
  view_.shape = shape;
  int64_t stride = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    ATTNRT_CHECK(shape[d] >= 0, "HostBuffer: negative dimension {} in dim {}", shape[d], d);
    view_.strides[d] = stride;
    stride *= shape[d];
  }
  size_t bytes = static_cast<size_t>(stride) * dtype_size(dtype);
  size_t rounded = (bytes + 63) / 64 * 64;
  void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
  ATTNRT_CHECK(p != nullptr, "HostBuffer: out of host memory allocating {} bytes", bytes);
  storage_.reset(p);
  view_.data = p;
}

}  // namespace attnrt
