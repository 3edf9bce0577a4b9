// attnrt._native: the Python extension. A thin layer over AttentionRuntime: tensors come in and go
// out through DLPack without copies (CPU and CUDA), batch fields arrive as host integer arrays, and
// every attnrt::Error becomes attnrt.Error (a ValueError) with the library's message. The Python
// package (python/attnrt) adds the torch-facing conveniences on top: the current CUDA stream,
// output allocation, the engine-interface class and the transformers plug-in.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "attnrt/backend/mla_mha.h"
#include "attnrt/backend/options.h"
#include "attnrt/backend/registry.h"
#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/model/model_spec.h"
#include "attnrt/runtime/attention_runtime.h"
#include "attnrt/runtime/communicator.h"
#include "attnrt/runtime/dcp.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace attnrt::python {
namespace {

using Array = nb::ndarray<nb::ro>;
using MutArray = nb::ndarray<>;

// DLPack device types (dlpack.h): CPU, CUDA, CUDA host (pinned), CUDA managed.
constexpr int kDLCPU = 1, kDLCUDA = 2, kDLCUDAHost = 3, kDLCUDAManaged = 13;

std::optional<DType> dtype_of(nb::dlpack::dtype t) {
  using C = nb::dlpack::dtype_code;
  if (t.lanes != 1) return std::nullopt;
  if (t.code == static_cast<uint8_t>(C::Float)) {
    if (t.bits == 32) return DType::f32;
    if (t.bits == 16) return DType::f16;
  }
  if (t.code == static_cast<uint8_t>(C::Bfloat) && t.bits == 16) return DType::bf16;
  if (t.code == static_cast<uint8_t>(C::Int)) {
    if (t.bits == 32) return DType::i32;
    if (t.bits == 64) return DType::i64;
  }
  if (t.code == static_cast<uint8_t>(C::UInt) && t.bits == 8) return DType::u8;
  return std::nullopt;
}

nb::dlpack::dtype dlpack_dtype(DType t) {
  using C = nb::dlpack::dtype_code;
  switch (t) {
    case DType::f32: return {static_cast<uint8_t>(C::Float), 32, 1};
    case DType::f16: return {static_cast<uint8_t>(C::Float), 16, 1};
    case DType::bf16: return {static_cast<uint8_t>(C::Bfloat), 16, 1};
    case DType::i32: return {static_cast<uint8_t>(C::Int), 32, 1};
    case DType::i64: return {static_cast<uint8_t>(C::Int), 64, 1};
    default: return {static_cast<uint8_t>(C::UInt), 8, 1};  // fp8 and bytes: raw uint8
  }
}

std::string dtype_text(nb::dlpack::dtype t) {
  const char* code = "?";
  switch (static_cast<nb::dlpack::dtype_code>(t.code)) {
    case nb::dlpack::dtype_code::Int: code = "int"; break;
    case nb::dlpack::dtype_code::UInt: code = "uint"; break;
    case nb::dlpack::dtype_code::Float: code = "float"; break;
    case nb::dlpack::dtype_code::Bfloat: code = "bfloat"; break;
    default: break;
  }
  return fmt::format("{}{}", code, t.bits);
}

// ---- DLPack's C exchange API ---------------------------------------------------------------------
// torch (>= 2.10) puts a table of C functions on its tensor type, `__dlpack_c_exchange_api__` (a
// capsule named "dlpack_exchange_api", DLPack 1.2+): dltensor_from_py_object_no_sync fills a DLTensor
// that borrows the tensor's fields, with no Python call and no capsule; current_work_stream gives
// torch's current CUDA stream. Going through it instead of `__dlpack__` (a Python method that builds
// a capsule per tensor) is what keeps a forward() call within a couple of microseconds of C++.
// Declared here because the system's dlpack.h predates the table; the layouts are DLPack's stable
// ABI (DLTensor is unchanged since 0.x; the table is versioned, and only major version 1 is used).
struct XDevice {
  int32_t device_type;
  int32_t device_id;
};
struct XTensor {
  void* data;
  XDevice device;
  int32_t ndim;
  nb::dlpack::dtype dtype;  // {uint8 code, uint8 bits, uint16 lanes}, as DLDataType
  int64_t* shape;
  int64_t* strides;  // null: compact row-major
  uint64_t byte_offset;
};
struct XApi {
  struct {
    uint32_t major, minor;
  } version;
  void* prev_api;
  void* managed_tensor_allocator;
  void* managed_tensor_from_py_object_no_sync;
  void* managed_tensor_to_py_object_no_sync;
  int (*dltensor_from_py_object_no_sync)(void* py_object, XTensor* out);
  int (*current_work_stream)(int32_t device_type, int32_t device_id, void** out_stream);
};

// The exchange table of a Python type, or nullptr. Looked up once per type (a few types are cached,
// each kept alive by a reference, so that a cached address can never name another type).
const XApi* exchange_api(PyTypeObject* tp) {
  struct Entry {
    PyTypeObject* type;
    const XApi* api;
  };
  static Entry cache[4] = {};
  static int next = 0;
  for (const Entry& e : cache) {
    if (e.type == tp) return e.api;
  }
  const XApi* api = nullptr;
  PyObject* obj = PyObject_GetAttrString(reinterpret_cast<PyObject*>(tp), "__dlpack_c_exchange_api__");
  if (obj == nullptr) {
    PyErr_Clear();
  } else {
    const void* p = nullptr;
    if (PyCapsule_CheckExact(obj)) {
      p = PyCapsule_GetPointer(obj, "dlpack_exchange_api");
    } else if (PyLong_Check(obj)) {
      p = PyLong_AsVoidPtr(obj);
    }
    if (p == nullptr) PyErr_Clear();
    const auto* x = static_cast<const XApi*>(p);
    if (x != nullptr && x->version.major == 1 && x->dltensor_from_py_object_no_sync != nullptr &&
        x->current_work_stream != nullptr) {
      api = x;
    }
    Py_DECREF(obj);
  }
  Entry& slot = cache[next];
  next = (next + 1) % 4;
  Py_XDECREF(reinterpret_cast<PyObject*>(slot.type));
  Py_INCREF(reinterpret_cast<PyObject*>(tp));
  slot = {tp, api};
  return api;
}

TensorView view_of(const XTensor& t, const char* name) {
  const std::optional<DType> dt = dtype_of(t.dtype);
  if (!dt) {
    throw nb::type_error(fmt::format("{}: dtype {} is not supported; attnrt takes float32, float16, "
                                     "bfloat16 (activations), int32 / int64 (indices) and uint8 "
                                     "(fp8 bytes)",
                                     name, dtype_text(t.dtype))
                             .c_str());
  }
  if (t.ndim > kMaxDims) {
    throw nb::value_error(
        fmt::format("{}: {} dimensions; at most {} are supported", name, t.ndim, kMaxDims).c_str());
  }
  TensorView v;
  v.data = static_cast<char*>(t.data) + t.byte_offset;
  v.dtype = *dt;
  v.ndim = t.ndim;
  int64_t stride = 1;
  for (int i = v.ndim - 1; i >= 0; --i) {
    v.shape[i] = t.shape[i];
    v.strides[i] = t.strides != nullptr ? t.strides[i] : stride;
    stride *= t.shape[i];
  }
  const int dev = t.device.device_type;
  if (dev == kDLCPU || dev == kDLCUDAHost) {
    v.device = Device::cpu();
  } else if (dev == kDLCUDA || dev == kDLCUDAManaged) {
    v.device = Device::cuda(t.device.device_id);
  } else {
    throw nb::value_error(
        fmt::format("{}: the tensor is on DLPack device type {}; attnrt takes CPU and CUDA tensors",
                    name, dev)
            .c_str());
  }
  return v;
}

// An array nanobind imported (numpy, other DLPack producers) as a TensorView, no copy.
TensorView view_of(const Array& a, const char* name) {
  XTensor t{};
  t.data = const_cast<void*>(a.data());
  t.device = {a.device_type(), a.device_id()};
  t.ndim = static_cast<int32_t>(a.ndim());
  t.dtype = a.dtype();
  t.shape = const_cast<int64_t*>(a.shape_ptr());
  t.strides = const_cast<int64_t*>(a.stride_ptr());
  return view_of(t, name);
}

TensorView optional_view(const std::optional<Array>& a, const char* name) {
  return a ? view_of(*a, name) : TensorView();
}

// An activation (q, k, v, out, linear inputs): a float tensor.
TensorView as_activation(TensorView v, const char* name) {
  if (v.dtype != DType::f32 && v.dtype != DType::f16 && v.dtype != DType::bf16) {
    throw nb::type_error(fmt::format("{}: dtype {} is not an activation dtype; q / k / v / out are "
                                     "float32, float16 or bfloat16",
                                     name, dtype_name(v.dtype))
                             .c_str());
  }
  return v;
}

TensorView activation_view(const Array& a, const char* name) {
  return as_activation(view_of(a, name), name);
}

// Any tensor argument: torch tensors through the exchange table, anything else DLPack or
// buffer-protocol through nanobind. None gives an empty view.
TensorView tensor_of(nb::handle h, const char* name) {
  PyObject* o = h.ptr();
  if (o == Py_None) return TensorView();
  if (const XApi* api = exchange_api(Py_TYPE(o))) {
    XTensor t;
    if (api->dltensor_from_py_object_no_sync(o, &t) != 0) throw nb::python_error();
    static PyObject* const requires_grad = PyUnicode_InternFromString("requires_grad");
    PyObject* grad = PyObject_GetAttr(o, requires_grad);
    const bool needs_grad = grad == Py_True;
    Py_XDECREF(grad);
    if (grad == nullptr) PyErr_Clear();
    if (needs_grad) {
      throw nb::type_error(fmt::format("{}: the tensor requires grad; run attnrt under "
                                       "torch.no_grad() / torch.inference_mode() or pass "
                                       "tensor.detach()",
                                       name)
                               .c_str());
    }
    return view_of(t, name);
  }
  Array a;
  if (!nb::try_cast(h, a)) {
    throw nb::type_error(fmt::format("{}: {}; pass a torch tensor (or another DLPack array)", name,
                                     nb::inst_name(h).c_str())
                             .c_str());
  }
  return view_of(a, name);
}

TensorView activation_of(nb::handle h, const char* name) {
  TensorView v = tensor_of(h, name);
  if (v.empty() && h.is_none()) {
    throw nb::type_error(fmt::format("{}: None; pass a tensor", name).c_str());
  }
  return as_activation(v, name);
}

// [T, H*D] as [T, H, D] (the engine's flat layout); 3-D views pass unchanged.
TensorView split_heads(TensorView t, int heads, int dim, const char* name) {
  if (t.ndim != 2) return t;
  if (t.shape[1] != int64_t{heads} * dim || (t.strides[1] != 1 && t.shape[1] > 1)) {
    throw nb::value_error(fmt::format("{}: {}; a 2-D {} is [tokens, heads * dim] = [T, {} * {}] "
                                      "with contiguous rows",
                                      name, t.describe(), name, heads, dim)
                              .c_str());
  }
  t.ndim = 3;
  t.shape = {t.shape[0], heads, dim};
  t.strides = {t.strides[0], dim, 1};
  return t;
}

// Integer batch fields: any host integer array (int32 or int64) or None.
template <typename T>
std::vector<T> ints(const std::optional<nb::ndarray<nb::ro, nb::device::cpu>>& a, const char* name) {
  std::vector<T> out;
  if (!a) return out;
  const nb::dlpack::dtype t = a->dtype();
  if (a->ndim() != 1) {
    throw nb::value_error(
        fmt::format("batch field {}: {} dimensions; it must be one-dimensional", name, a->ndim())
            .c_str());
  }
  const size_t n = a->shape(0);
  const int64_t stride = a->stride(0);
  out.resize(n);
  if (t == nb::dtype<int32_t>()) {
    const auto* p = static_cast<const int32_t*>(a->data());
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(p[i * stride]);
  } else if (t == nb::dtype<int64_t>()) {
    const auto* p = static_cast<const int64_t*>(a->data());
    for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(p[i * stride]);
  } else {
    throw nb::type_error(fmt::format("batch field {}: dtype {}; it must be int32 or int64 (on the "
                                     "CPU)",
                                     name, dtype_text(t))
                             .c_str());
  }
  return out;
}

using HostInts = std::optional<nb::ndarray<nb::ro, nb::device::cpu>>;

// A batch field: None, a list / tuple of ints, or a host int32 / int64 array (torch tensors through
// the exchange table). A field on a GPU raises TypeError (the Python layer copies it then).
template <typename T>
std::vector<T> field(nb::handle h, const char* name) {
  std::vector<T> out;
  PyObject* o = h.ptr();
  if (o == Py_None) return out;
  if (PyList_CheckExact(o) || PyTuple_CheckExact(o)) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
    PyObject** items = PySequence_Fast_ITEMS(o);
    out.resize(static_cast<size_t>(n));
    for (Py_ssize_t i = 0; i < n; ++i) {
      const long long x = PyLong_AsLongLong(items[i]);
      if (x == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        throw nb::type_error(fmt::format("batch field {}: item {} is {}; the items must be ints",
                                         name, i, nb::inst_name(items[i]).c_str())
                                 .c_str());
      }
      out[static_cast<size_t>(i)] = static_cast<T>(x);
    }
    return out;
  }
  if (const XApi* api = exchange_api(Py_TYPE(o))) {
    XTensor t;
    if (api->dltensor_from_py_object_no_sync(o, &t) != 0) throw nb::python_error();
    const int dev = t.device.device_type;
    if (dev != kDLCPU && dev != kDLCUDAHost) {
      throw nb::type_error(
          fmt::format("batch field {}: the tensor is on a GPU; batch fields are host integers",
                      name)
              .c_str());
    }
    if (t.ndim > 1) {
      throw nb::value_error(fmt::format("batch field {}: {} dimensions; it must be "
                                        "one-dimensional",
                                        name, t.ndim)
                                .c_str());
    }
    const size_t n = t.ndim == 0 ? 1 : static_cast<size_t>(t.shape[0]);
    const int64_t stride = t.ndim == 0 || t.strides == nullptr ? 1 : t.strides[0];
    const char* base = static_cast<const char*>(t.data) + t.byte_offset;
    out.resize(n);
    if (t.dtype == nb::dtype<int32_t>()) {
      const auto* p = reinterpret_cast<const int32_t*>(base);
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(p[i * stride]);
    } else if (t.dtype == nb::dtype<int64_t>()) {
      const auto* p = reinterpret_cast<const int64_t*>(base);
      for (size_t i = 0; i < n; ++i) out[i] = static_cast<T>(p[i * stride]);
    } else {
      throw nb::type_error(fmt::format("batch field {}: dtype {}; it must be int32 or int64",
                                       name, dtype_text(t.dtype))
                               .c_str());
    }
    return out;
  }
  HostInts a;
  nb::ndarray<nb::ro, nb::device::cpu> arr;
  if (!nb::try_cast(h, arr)) {
    throw nb::type_error(fmt::format("batch field {}: {}; pass a list, a numpy array or a CPU "
                                     "tensor of ints",
                                     name, nb::inst_name(h).c_str())
                             .c_str());
  }
  a = std::move(arr);
  return ints<T>(a, name);
}

// A step's ForwardBatch from the reference engine's fields (Python handles: see field()).
void fill_batch(ForwardBatch& b, const std::string& mode, nb::handle req_pool_indices,
                nb::handle seq_lens, nb::handle extend_prefix_lens, nb::handle extend_seq_lens,
                nb::handle out_cache_loc, nb::handle positions, int draft_token_num, int topk,
                nb::handle parents, nb::handle accept_length) {
  b.mode = parse_forward_mode(mode);
  b.req_pool_indices = field<int64_t>(req_pool_indices, "req_pool_indices");
  b.batch_size = static_cast<int>(b.req_pool_indices.size());
  b.seq_lens = field<int32_t>(seq_lens, "seq_lens");
  b.extend_prefix_lens = field<int32_t>(extend_prefix_lens, "extend_prefix_lens");
  b.extend_seq_lens = field<int32_t>(extend_seq_lens, "extend_seq_lens");
  b.extend_start_loc.clear();
  if (!b.extend_seq_lens.empty()) {
    int32_t at = 0;
    for (int32_t n : b.extend_seq_lens) {
      b.extend_start_loc.push_back(at);
      at += n;
    }
  }
  b.out_cache_loc = field<int64_t>(out_cache_loc, "out_cache_loc");
  b.positions = field<int64_t>(positions, "positions");
  b.spec_info.reset();
  if (draft_token_num > 0 || !parents.is_none() || !accept_length.is_none()) {
    SpecInfo s;
    s.draft_token_num = draft_token_num;
    s.topk = topk;
    s.parents = field<int32_t>(parents, "spec_info.parents");
    s.accept_length = field<int32_t>(accept_length, "spec_info.accept_length");
    if (s.parents.empty() && is_target_verify(b.mode) && s.is_chain() && draft_token_num > 0) {
      // A chain's parents, made here for the caller: only for as many block tokens as the step
      // writes (a draft_token_num that disagrees must not size an allocation).
      const int64_t block = int64_t{b.batch_size} * draft_token_num;
      ATTNRT_CHECK(block == static_cast<int64_t>(b.out_cache_loc.size()),
                   "ForwardBatch (TARGET_VERIFY): spec_info.draft_token_num = {} for {} "
                   "requests is {} block tokens, but out_cache_loc has {} entries (one per "
                   "block token)",
                   draft_token_num, b.batch_size, block, b.out_cache_loc.size());
      s.parents = SpecInfo::chain(b.batch_size, draft_token_num).parents;
    }
    b.spec_info = std::move(s);
  }
}

// The arguments of one attention call of layer `l` (forward()'s): flat [T, H*D] tensors split
// into heads; DSA layers' indexer inputs, any float dtype and strides; index_topk an optional int32
// [T, index_topk] output of the selection.
AttnArgs attn_args(const LayerSpec& l, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                   bool save_kv, nb::handle sinks, nb::handle lse, nb::handle index_q,
                   nb::handle index_k, nb::handle index_weights, nb::handle index_topk) {
  const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
  AttnArgs a;
  a.q = split_heads(activation_of(q, "q"), l.num_q_heads, l.head_dim, "q");
  a.k = split_heads(activation_of(k, "k"), l.num_kv_heads, l.head_dim, "k");
  a.v = split_heads(activation_of(v, "v"), l.num_kv_heads, dv, "v");
  a.out = split_heads(activation_of(out, "out"), l.num_q_heads, dv, "out");
  a.save_kv = save_kv;
  if (!sinks.is_none()) {
    const TensorView s = tensor_of(sinks, "sinks");
    ATTNRT_CHECK(s.dtype == DType::f32 && s.is_contiguous(),
                 "sinks: {}; the sink logits are a contiguous float32 tensor [num_q_heads]",
                 s.describe());
    a.sinks = s.ptr<const float>();
  }
  a.lse = tensor_of(lse, "lse");
  // DSA layers (docs/dsa.md): the indexer's inputs, any float dtype and strides; index_topk an
  // optional int32 [T, index_topk] output of the selection.
  a.indexer.q = tensor_of(index_q, "index_q");
  a.indexer.k = tensor_of(index_k, "index_k");
  a.indexer.weights = tensor_of(index_weights, "index_weights");
  a.indexer.topk = tensor_of(index_topk, "index_topk");
  return a;
}

// Layer `layer_id` of `m` (attnrt::Error naming the layers when there is none); `table` caches the
// lookup by id.
const LayerSpec& find_layer(const ModelSpec& m, std::vector<const LayerSpec*>& table,
                            int layer_id) {
  if (table.empty()) {
    for (const LayerSpec& l : m.layers) {
      if (static_cast<size_t>(l.layer_id) >= table.size()) table.resize(l.layer_id + 1);
      table[l.layer_id] = &l;
    }
  }
  ATTNRT_CHECK(layer_id >= 0 && static_cast<size_t>(layer_id) < table.size() &&
                   table[layer_id] != nullptr,
               "forward: layer_id {} is not a layer of model '{}'; layers are 0..{}", layer_id,
               m.name, table.size() - 1);
  return *table[layer_id];
}

// A preset name or config.json path, or the text of a config.json (then `model` names its origin);
// `dtype` ("" = the model's) replaces the activation dtype; tp_size splits the heads.
ModelSpec load_model(const std::string& model, const std::string& config_json,
                     const std::string& dtype, int tp_size) {
  ModelSpec spec = config_json.empty()
                       ? resolve_model(model)
                       : load_hf_config_text(config_json, model.empty() ? "config" : model);
  if (!dtype.empty()) spec.dtype = parse_dtype(dtype);
  return tp_size > 1 ? apply_tensor_parallel(spec, tp_size) : spec;
}

// Follows the framework's current CUDA stream (its tensor type's exchange table): the engine's
// work is queued there, and attnrt's must run in order with it.
class StreamFollower {
 public:
  // The framework's tensor type; `pools`: where the pools live (host pools follow nothing).
  void use(nb::handle tensor_type, Device pools) {
    api_ = exchange_api(reinterpret_cast<PyTypeObject*>(tensor_type.ptr()));
    cuda_device_ = pools.kind == DeviceKind::cuda ? pools.index : -1;
  }
  bool active() const { return api_ != nullptr && cuda_device_ >= 0; }
  // set_stream(s) when the framework's current stream s is not the one handed over last.
  template <class SetStream>
  void follow(SetStream&& set_stream) {
    if (!active()) return;
    void* s = nullptr;
    if (api_->current_work_stream(kDLCUDA, cuda_device_, &s) != 0) throw nb::python_error();
    if (!known_ || s != stream_) {
      set_stream(s);
      stream_ = s;
      known_ = true;
    }
  }

 private:
  const XApi* api_ = nullptr;
  int cuda_device_ = -1;
  void* stream_ = nullptr;
  bool known_ = false;
};

// The runtime plus the batch of the step in progress (begin_step keeps a pointer to it).
class Runtime {
 public:
  Runtime(const std::string& model, const std::string& config_json, const std::string& dtype,
          int tp_size, const Options& options, const RuntimeConfig& config)
      : rt_(std::make_unique<AttentionRuntime>(load_model(model, config_json, dtype, tp_size),
                                               options, config)) {}

  AttentionRuntime& rt() {
    if (!rt_) throw std::runtime_error("attnrt.Runtime: the runtime was closed; create a new one");
    return *rt_;
  }
  void close() {
    if (rt_ && in_step_) rt_->end_step();
    in_step_ = false;
    rt_.reset();
  }
  bool closed() const { return !rt_; }

  // kind: 0 = an eager step, 1 = before a capture of `bs` requests, 2 = before a replay at `bs`.
  // The framework whose current CUDA stream the runtime follows (torch.Tensor's exchange table),
  // and the pools' CUDA device (-1: host pools).
  void use_framework(nb::handle tensor_type) { stream_.use(tensor_type, rt().kv_cache().device()); }
  bool follows_framework_stream() const { return stream_.active(); }

  // Moves the runtime to the framework's current stream when that changed.
  void follow_stream() {
    stream_.follow([&](void* s) { rt().set_stream(s); });
  }

  void begin_step(const std::string& mode, nb::handle req_pool_indices, nb::handle seq_lens,
                  nb::handle extend_prefix_lens, nb::handle extend_seq_lens,
                  nb::handle out_cache_loc, nb::handle positions, int draft_token_num, int topk,
                  nb::handle parents, nb::handle accept_length, int kind, int bs) {
    AttentionRuntime& r = rt();
    ForwardBatch& b = batch_;
    fill_batch(b, mode, req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
               out_cache_loc, positions, draft_token_num, topk, parents, accept_length);
    if (in_step_) {
      r.end_step();
      in_step_ = false;
    }
    capturing_ = false;
    follow_stream();
    if (kind == 1) {
      r.begin_capture_step(b, bs);
      capturing_ = true;  // the capture runs on a stream of its own: forward() follows it
    } else if (kind == 2) {
      r.begin_replay_step(b, bs);
    } else {
      r.begin_step(b);
    }
    in_step_ = true;
  }

  void end_step() {
    AttentionRuntime& r = rt();
    ATTNRT_CHECK(in_step_, "end_step: no step in progress; call begin_step first");
    r.end_step();
    in_step_ = false;
  }

  void forward(int layer_id, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
               bool save_kv, nb::handle sinks, nb::handle lse, nb::handle index_q,
               nb::handle index_k, nb::handle index_weights, nb::handle index_topk) {
    AttentionRuntime& r = rt();
    const LayerSpec& l = layer(layer_id);
    if (capturing_) follow_stream();
    const AttnArgs a = attn_args(l, q, k, v, out, save_kv, sinks, lse, index_q, index_k,
                                 index_weights, index_topk);
    r.forward(layer_id, a);
  }

  // MLA in the MHA form (docs/mla.md): the form of the step begun, its prefix chunks, and the
  // three calls of an MHA-form layer. Flat [T, H*D] tensors are split like forward()'s.
  std::string mla_form() { return std::string(mla_form_name(rt().mla_form())); }

  nb::dict prefix_chunk_plan() {
    const PrefixChunkPlan& plan = rt().prefix_chunk_plan();
    nb::list chunks;
    for (const PrefixChunk& c : plan.chunks) {
      nb::dict d;
      d["num_tokens"] = c.num_tokens;
      d["starts"] = c.starts;
      d["lens"] = c.lens;
      d["cu_seqlens"] = c.cu_seqlens;
      d["slots"] = c.slots;
      chunks.append(d);
    }
    nb::dict out;
    out["chunk_len"] = plan.chunk_len;
    out["chunks"] = chunks;
    return out;
  }

  // q / k [T, Hq, qk_nope + qk_rope], v / out [T, Hq, mha_v] of an MHA-form call (flat accepted).
  template <class Args>
  static void mha_views(const LayerSpec& l, nb::handle q, nb::handle k, nb::handle v,
                        nb::handle out, Args& a) {
    const MlaMhaDims d = mla_mha_dims(l);
    a.q = split_heads(activation_of(q, "q"), l.num_q_heads, d.qk, "q");
    a.k = split_heads(activation_of(k, "k"), l.num_q_heads, d.qk, "k");
    a.v = split_heads(activation_of(v, "v"), l.num_q_heads, d.v, "v");
    a.out = split_heads(activation_of(out, "out"), l.num_q_heads, d.v, "out");
  }

  void forward_mla_mha(int layer_id, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
                       nb::handle lse, nb::handle latent, bool save_kv) {
    const LayerSpec& l = layer(layer_id);
    MlaMhaArgs a;
    mha_views(l, q, k, v, out, a);
    a.lse = tensor_of(lse, "lse");
    a.latent = split_heads(tensor_of(latent, "latent"), 1, l.head_dim, "latent");
    a.save_kv = save_kv;
    rt().forward_mla_mha(layer_id, a);
  }

  void gather_prefix_chunk(int layer_id, int chunk, nb::handle latent) {
    const LayerSpec& l = layer(layer_id);
    rt().gather_prefix_chunk(layer_id, chunk,
                             split_heads(activation_of(latent, "latent"), 1, l.head_dim, "latent"));
  }

  void forward_mla_prefix_chunk(int layer_id, int chunk, nb::handle q, nb::handle k,
                                nb::handle v, nb::handle out, nb::handle lse) {
    MlaChunkArgs a;
    mha_views(layer(layer_id), q, k, v, out, a);
    a.lse = tensor_of(lse, "lse");
    rt().forward_mla_prefix_chunk(layer_id, chunk, a);
  }

  // The layer `layer_id` of the model (attnrt::Error naming the layers when there is none).
  const LayerSpec& layer(int layer_id) { return find_layer(rt().model(), layers_, layer_id); }

  void forward_linear(int layer_id, const Array& mixed_qkv, const Array& a, std::optional<Array> b,
                      const Array& conv_weight, std::optional<Array> conv_bias,
                      const Array& A_log, const Array& dt_bias, std::optional<Array> D,
                      const Array& out) {
    LinearArgs x;
    x.mixed_qkv = activation_view(mixed_qkv, "mixed_qkv");
    x.a = view_of(a, "a");
    x.b = optional_view(b, "b");
    x.conv_weight = view_of(conv_weight, "conv_weight");
    x.conv_bias = optional_view(conv_bias, "conv_bias");
    x.A_log = view_of(A_log, "A_log");
    x.dt_bias = view_of(dt_bias, "dt_bias");
    x.D = optional_view(D, "D");
    x.out = activation_view(out, "out");
    rt().forward_linear(layer_id, x);
  }

  bool in_step() const { return in_step_; }

 private:
  std::unique_ptr<AttentionRuntime> rt_;
  ForwardBatch batch_;
  bool in_step_ = false;
  bool capturing_ = false;  // between begin_capture_step and the next step
  std::vector<const LayerSpec*> layers_;  // by layer id (forward's lookup)
  StreamFollower stream_;                 // the framework's current stream (use_framework)
};

// ---- Decode context parallelism (docs/dcp.md, docs/python.md) -----------------------------------

// One rank's handle on a group's communicator: an in-process group (shared by the handles of all
// its ranks, a thread each) or one rank over NCCL.
struct Comm {
  std::shared_ptr<Communicator> comm;
  std::shared_ptr<Communicator> host;  // a device communicator's exchange of host tensors, if any
  int rank = 0;
};

// The accepted block indices of a verify step, per request (lists of ints).
std::vector<std::vector<int32_t>> accepted_paths(nb::handle accepted) {
  std::vector<std::vector<int32_t>> out;
  if (!PyList_Check(accepted.ptr()) && !PyTuple_Check(accepted.ptr())) {
    throw nb::type_error(fmt::format("commit_verify: accepted is {}; pass a list with one list of "
                                     "block indices per request (the root 0 first)",
                                     nb::inst_name(accepted).c_str())
                             .c_str());
  }
  for (nb::handle path : accepted) out.push_back(field<int32_t>(path, "accepted[i]"));
  return out;
}

// The runtime of a group's (or rank's) first part: where the pools live.
AttentionRuntime& first_runtime(DcpAttention& g) { return g.rank(0).runtime(); }
AttentionRuntime& first_runtime(DcpRank& r) { return r.runtime(); }

// What DcpAttention and DcpRank share: the step's batch, the layer lookup, the closed state, the
// framework's current stream (followed as Runtime does, at begin_step and at every forward).
template <class Impl>
class DcpBase {
 public:
  Impl& impl() {
    if (!impl_) throw std::runtime_error("attnrt: the DCP group was closed; create a new one");
    return *impl_;
  }
  bool closed() const { return !impl_; }
  bool in_step() const { return in_step_; }
  Device pool_device() { return first_runtime(impl()).kv_cache().device(); }
  void use_framework(nb::handle tensor_type) { stream_.use(tensor_type, pool_device()); }
  bool follows_framework_stream() const { return stream_.active(); }
  void follow_stream() {
    stream_.follow([&](void* s) { impl().set_stream(s); });
  }

  // graph_tokens > 0: before a replay of a graph captured at that many rows
  // (begin_replay_step); else an eager step.
  void begin_step(const std::string& mode, nb::handle req_pool_indices, nb::handle seq_lens,
                  nb::handle extend_prefix_lens, nb::handle extend_seq_lens,
                  nb::handle out_cache_loc, nb::handle positions, int draft_token_num, int topk,
                  nb::handle parents, nb::handle accept_length, int graph_tokens) {
    Impl& g = impl();
    end_current();
    fill_batch(batch_, mode, req_pool_indices, seq_lens, extend_prefix_lens, extend_seq_lens,
               out_cache_loc, positions, draft_token_num, topk, parents, accept_length);
    follow_stream();
    if (graph_tokens > 0) {
      g.begin_replay_step(batch_, graph_tokens);
    } else {
      g.begin_step(batch_);
    }
    in_step_ = true;
    stepped_ = true;
  }
  // CUDA graphs an engine captures (docs/dcp.md "CUDA graphs"): the stream followed is the
  // current one here and at every forward, so a capture's forward calls go to its stream.
  void init_cuda_graph_state(int max_num_tokens) {
    Impl& g = impl();
    end_current();
    g.init_cuda_graph_state(max_num_tokens);
  }
  void begin_capture_step(int tokens) {
    Impl& g = impl();
    end_current();
    follow_stream();
    g.begin_capture_step(tokens);
    in_step_ = true;  // no batch of its own: nothing to commit after it
  }
  void end_step() {
    Impl& g = impl();
    ATTNRT_CHECK(in_step_, "end_step: no step in progress; call begin_step first");
    g.end_step();
    in_step_ = false;
  }
  void commit_verify(nb::handle accepted) {
    Impl& g = impl();
    ATTNRT_CHECK(stepped_ && !in_step_,
                 "commit_verify: call it after the TARGET_VERIFY step's end_step and before the "
                 "next begin_step");
    const std::vector<std::vector<int32_t>> paths = accepted_paths(accepted);
    g.commit_verify(batch_, paths);
  }
  void close() {
    if (impl_ && in_step_) impl_->end_step();
    in_step_ = false;
    impl_.reset();
  }

 protected:
  // A new step ends the one in progress (as Runtime does); the batch is kept for commit_verify.
  void end_current() {
    if (in_step_) {
      impl().end_step();
      in_step_ = false;
    }
    stepped_ = false;
  }

  std::unique_ptr<Impl> impl_;
  ForwardBatch batch_;
  bool in_step_ = false;
  bool stepped_ = false;
  std::vector<const LayerSpec*> layers_;
  StreamFollower stream_;
};

// n simulated ranks in one process (DcpAttention): host backends, or cuda ranks on one GPU.
class Dcp : public DcpBase<DcpAttention> {
 public:
  Dcp(const std::string& model, const std::string& config_json, const std::string& dtype,
      int tp_size, const Options& options, const RuntimeConfig& config) {
    impl_ = std::make_unique<DcpAttention>(load_model(model, config_json, dtype, tp_size), options,
                                           config);
  }
  const ModelSpec& model() { return impl().model(); }
  void forward(int layer_id, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
               bool save_kv, nb::handle sinks, nb::handle lse) {
    DcpAttention& g = impl();
    const LayerSpec& l = find_layer(g.model(), layers_, layer_id);
    const nb::handle none = nb::none();
    const AttnArgs a = attn_args(l, q, k, v, out, save_kv, sinks, lse, none, none, none, none);
    follow_stream();
    g.forward(layer_id, a);
  }
};

// One rank of a group (DcpRank) over the communicator the caller made.
class DcpRankPy : public DcpBase<DcpRank> {
 public:
  DcpRankPy(const std::string& model, const std::string& config_json, const std::string& dtype,
            int tp_size, const Options& options, const RuntimeConfig& config, const Comm& comm)
      : comm_(comm), model_(load_model(model, config_json, dtype, tp_size)) {
    ATTNRT_CHECK(comm.comm != nullptr, "DcpRank: the communicator is empty");
    ATTNRT_CHECK(options.dcp_size == comm.comm->size(),
                 "DcpRank: dcp_size = {} but the communicator's group has {} ranks",
                 options.dcp_size, comm.comm->size());
    validate_dcp(model_, options);
    impl_ = std::make_unique<DcpRank>(comm.rank, model_, options, config, *comm_.comm,
                                      comm_.host.get());
  }
  const ModelSpec& model() const { return model_; }
  int rank() { return impl().rank(); }
  // The q heads whose merged rows forward() writes on this rank: [begin, end).
  std::pair<int, int> head_range(int layer_id) {
    const LayerSpec& l = find_layer(model_, layers_, layer_id);
    const DcpRank& r = impl();
    return {dcp_head_begin(r.rank(), l.num_q_heads, r.size()),
            dcp_head_begin(r.rank() + 1, l.num_q_heads, r.size())};
  }
  void forward(int layer_id, nb::handle q, nb::handle k, nb::handle v, nb::handle out,
               bool save_kv, nb::handle sinks, nb::handle lse) {
    DcpRank& r = impl();
    const LayerSpec& l = find_layer(model_, layers_, layer_id);
    const nb::handle none = nb::none();
    const AttnArgs a = attn_args(l, q, k, v, out, save_kv, sinks, lse, none, none, none, none);
    follow_stream();
    // The exchange waits for the group's other ranks, which other threads drive; the
    // communicators made here complete a collective when every rank's call returns (in process)
    // or in stream order (NCCL), so the merge follows at once.
    nb::gil_scoped_release unlocked;
    r.forward(layer_id, a);
    r.merge(layer_id, a);
  }
  void synchronize() {
    DcpRank& r = impl();
    nb::gil_scoped_release unlocked;
    r.synchronize();
  }

 private:
  Comm comm_;  // keeps the communicator alive for the rank
  ModelSpec model_;
};

// A zero-copy array over memory the runtime owns; `owner` (the Python Runtime) keeps it alive.
nb::ndarray<> owned_array(void* data, DType dt, std::vector<size_t> shape,
                          std::vector<int64_t> strides, Device device, nb::handle owner) {
  const int dev = device.kind == DeviceKind::cuda ? kDLCUDA : kDLCPU;
  return nb::ndarray<>(data, shape.size(), shape.data(), owner, strides.data(), dlpack_dtype(dt),
                       dev, device.index);
}

nb::dict layer_dict(const LayerSpec& l) {
  nb::dict d;
  d["layer_id"] = l.layer_id;
  d["kind"] = std::string(layer_kind_name(l.kind));
  d["num_q_heads"] = l.num_q_heads;
  d["num_kv_heads"] = l.num_kv_heads;
  d["head_dim"] = l.head_dim;
  d["v_head_dim"] = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
  d["scaling"] = l.softmax_scale();
  d["logit_cap"] = l.logit_cap;
  d["sliding_window"] = l.sliding_window;
  d["causal"] = l.causal();
  d["has_sinks"] = l.has_sinks;
  d["kv_lora_rank"] = l.kv_lora_rank;
  d["qk_rope_head_dim"] = l.qk_rope_head_dim;
  d["qk_nope_head_dim"] = l.qk_nope_head_dim;
  d["mha_v_head_dim"] = l.mha_v_head_dim;
  d["uses_kv_cache"] = l.uses_kv_cache();
  // DSA layers (docs/dsa.md): the indexer's dims, 0 where the layer has none.
  d["index_topk"] = l.indexer.index_topk;
  d["index_n_heads"] = l.indexer.index_n_heads;
  d["index_head_dim"] = l.indexer.index_head_dim;
  return d;
}

}  // namespace
}  // namespace attnrt::python

NB_MODULE(_native, m) {
  using namespace attnrt;
  using attnrt::python::Runtime;
  m.doc() = "attnrt's native extension (use the attnrt package, not this module).";

  static nb::exception<Error> error(m, "Error", PyExc_ValueError);

  m.def("version", [] { return std::string(ATTNRT_VERSION); });
  m.def("cuda_status", [] {
    const CudaDeviceInfo c = query_cuda();
    return nb::make_tuple(c.usable, c.usable ? c.name : c.reason);
  });
  m.def("preset_names", &preset_names);
  m.def("backend_names", [] { return Registry::global().names(); });

  nb::class_<Options>(m, "Options")
      .def(nb::init<>())
      .def_rw("attention_backend", &Options::attention_backend)
      .def_rw("prefill_attention_backend", &Options::prefill_attention_backend)
      .def_rw("decode_attention_backend", &Options::decode_attention_backend)
      .def_rw("speculative_attention_mode", &Options::speculative_attention_mode)
      .def_rw("page_size", &Options::page_size)
      .def_rw("kv_cache_dtype", &Options::kv_cache_dtype)
      .def_rw("speculative_num_steps", &Options::speculative_num_steps)
      .def_rw("speculative_eagle_topk", &Options::speculative_eagle_topk)
      .def_rw("speculative_num_draft_tokens", &Options::speculative_num_draft_tokens)
      .def_rw("linear_attn_backend", &Options::linear_attn_backend)
      .def_rw("linear_attn_prefill_backend", &Options::linear_attn_prefill_backend)
      .def_rw("linear_attn_decode_backend", &Options::linear_attn_decode_backend)
      .def_rw("num_threads", &Options::num_threads)
      .def_rw("deterministic", &Options::deterministic)
      .def_rw("fp8_prefill_attention", &Options::fp8_prefill_attention)
      .def_rw("disable_chunked_prefix_cache", &Options::disable_chunked_prefix_cache)
      .def_rw("chunked_prefix_cache_threshold", &Options::chunked_prefix_cache_threshold)
      .def_rw("max_chunk_capacity", &Options::max_chunk_capacity)
      .def_rw("dsa_prefill_backend", &Options::dsa_prefill_backend)
      .def_rw("dsa_decode_backend", &Options::dsa_decode_backend)
      .def_rw("dcp_size", &Options::dcp_size);

  nb::class_<RuntimeConfig>(m, "RuntimeConfig")
      .def(nb::init<>())
      .def_rw("max_requests", &RuntimeConfig::max_requests)
      .def_rw("kv_slots", &RuntimeConfig::kv_slots)
      .def_rw("swa_full_tokens_ratio", &RuntimeConfig::swa_full_tokens_ratio)
      .def_rw("max_num_tokens", &RuntimeConfig::max_num_tokens)
      .def_rw("max_context_len", &RuntimeConfig::max_context_len)
      .def_rw("linear_state_slots", &RuntimeConfig::linear_state_slots)
      .def_rw("linear_verify_requests", &RuntimeConfig::linear_verify_requests)
      .def_rw("cuda_graphs", &RuntimeConfig::cuda_graphs)
      .def_rw("cuda_graph_max_bs", &RuntimeConfig::cuda_graph_max_bs)
      .def_rw("cuda_graph_batch_sizes", &RuntimeConfig::cuda_graph_batch_sizes);

  nb::class_<Runtime>(m, "Runtime")
      .def(nb::init<const std::string&, const std::string&, const std::string&, int,
                    const Options&, const RuntimeConfig&>(),
           "model"_a, "config_json"_a, "dtype"_a, "tp_size"_a, "options"_a, "config"_a)
      .def("close", &Runtime::close)
      .def_prop_ro("closed", &Runtime::closed)
      .def_prop_ro("in_step", &Runtime::in_step)
      .def_prop_ro("model_name", [](Runtime& r) { return r.rt().model().name; })
      .def_prop_ro("model_dtype",
                   [](Runtime& r) { return std::string(dtype_name(r.rt().model().dtype)); })
      .def_prop_ro("layers",
                   [](Runtime& r) {
                     nb::list out;
                     for (const LayerSpec& l : r.rt().model().layers) out.append(python::layer_dict(l));
                     return out;
                   })
      .def_prop_ro("selection",
                   [](Runtime& r) {
                     const Selection& s = r.rt().selection();
                     nb::dict d;
                     d["prefill"] = s.prefill;
                     d["decode"] = s.decode;
                     d["linear_prefill"] = s.linear_prefill;
                     d["linear_decode"] = s.linear_decode;
                     d["kv_cache_dtype"] = std::string(dtype_name(s.kv_dtype));
                     d["speculative_topk"] = s.spec_topk;
                     d["speculative_num_draft_tokens"] = s.spec_num_draft_tokens;
                     d["reasons"] = s.reasons;
                     return d;
                   })
      .def_prop_ro("pool_device",
                   [](Runtime& r) {
                     const Device d = r.rt().kv_cache().device();
                     return nb::make_tuple(d.kind == DeviceKind::cuda ? "cuda" : "cpu", d.index);
                   })
      .def_prop_ro("page_size", [](Runtime& r) { return r.rt().kv_cache().page_size(); })
      .def_prop_ro("kv_cache_dtype",
                   [](Runtime& r) { return std::string(dtype_name(r.rt().kv_cache().dtype())); })
      .def_prop_ro("cuda_graphs_off_reason",
                   [](Runtime& r) { return r.rt().cuda_graphs_off_reason(); })
      .def_prop_ro("has_linear_layers", [](Runtime& r) { return r.rt().has_linear_layers(); })
      // Pools and allocator, for an engine that manages requests itself.
      .def("req_to_token",
           [](nb::handle self) {
             Runtime& r = nb::cast<Runtime&>(self);
             ReqToTokenPool& p = r.rt().req_to_token();
             return python::owned_array(const_cast<int32_t*>(p.data()), DType::i32,
                                        {static_cast<size_t>(p.size()),
                                         static_cast<size_t>(p.max_context_len())},
                                        {p.max_context_len(), 1}, Device::cpu(), self);
           })
      .def("alloc_request", [](Runtime& r) { return r.rt().req_to_token().alloc(); })
      .def("free_request", [](Runtime& r, int row) { r.rt().req_to_token().free(row); })
      .def("write_req_to_token",
           [](Runtime& r, int row, int start, python::HostInts slots) {
             const std::vector<int64_t> s = python::ints<int64_t>(slots, "slots");
             r.rt().req_to_token().write(row, start, s);
           })
      .def("alloc_extend",
           [](Runtime& r, python::HostInts prefix_lens, python::HostInts seq_lens,
              python::HostInts last_locs) {
             const auto p = python::ints<int32_t>(prefix_lens, "prefix_lens");
             const auto s = python::ints<int32_t>(seq_lens, "seq_lens");
             const auto l = python::ints<int64_t>(last_locs, "last_locs");
             return r.rt().allocator().alloc_extend(p, s, l);
           })
      .def("alloc_decode",
           [](Runtime& r, python::HostInts seq_lens, python::HostInts last_locs) {
             const auto s = python::ints<int32_t>(seq_lens, "seq_lens");
             const auto l = python::ints<int64_t>(last_locs, "last_locs");
             return r.rt().allocator().alloc_decode(s, l);
           })
      .def("free_slots",
           [](Runtime& r, python::HostInts slots) {
             const auto s = python::ints<int64_t>(slots, "slots");
             r.rt().allocator().free(s);
           })
      .def_prop_ro("available_slots", [](Runtime& r) { return r.rt().allocator().available_size(); })
      .def("alloc_linear_state", [](Runtime& r, int row) { return r.rt().linear_state().alloc_for(row); })
      .def("free_linear_state", [](Runtime& r, int row) { r.rt().linear_state().free_for(row); })
      .def("kv_buffers",
           [](nb::handle self, int layer_id) {
             Runtime& r = nb::cast<Runtime&>(self);
             const KVLayerView v = r.rt().kv_cache().layer(layer_id);
             const auto rows = static_cast<size_t>(v.num_rows);
             const auto h = static_cast<size_t>(v.kv_heads);
             nb::ndarray<> k = python::owned_array(v.k, v.dtype, {rows, h, static_cast<size_t>(v.head_dim)},
                                                   {v.k_row_stride, v.head_dim, 1}, v.device, self);
             nb::ndarray<> vv = python::owned_array(
                 v.v, v.dtype, {rows, h, static_cast<size_t>(v.v_head_dim)},
                 {v.v_row_stride, v.v == v.k ? v.head_dim : v.v_head_dim, 1}, v.device, self);
             return nb::make_tuple(k, vv, v.k_scale, v.v_scale);
           })
      .def("bind_kv_buffers",
           [](Runtime& r, int layer_id, const python::Array& k, std::optional<python::Array> v) {
             r.rt().bind_kv_buffers(layer_id, python::view_of(k, "k"), python::optional_view(v, "v"));
           },
           "layer_id"_a, "k"_a, "v"_a.none())
      .def("set_kv_scales",
           [](Runtime& r, int layer_id, float k_scale, float v_scale) {
             r.rt().kv_cache().set_kv_scales(layer_id, k_scale, v_scale);
           })
      // The step.
      .def("set_stream", [](Runtime& r, uintptr_t stream) {
             r.rt().set_stream(reinterpret_cast<void*>(stream));
           })
      .def("stream", [](Runtime& r) { return reinterpret_cast<uintptr_t>(r.rt().stream()); })
      .def("begin_step", &Runtime::begin_step, "mode"_a, "req_pool_indices"_a.none(),
           "seq_lens"_a.none(), "extend_prefix_lens"_a.none(), "extend_seq_lens"_a.none(),
           "out_cache_loc"_a.none(), "positions"_a.none(), "draft_token_num"_a = 0,
           "topk"_a = 1, "parents"_a.none() = nb::none(), "accept_length"_a.none() = nb::none(),
           "kind"_a = 0, "bs"_a = 0)
      .def("use_framework", &Runtime::use_framework, "tensor_type"_a)
      .def_prop_ro("follows_framework_stream", &Runtime::follows_framework_stream)
      .def("init_cuda_graph_state",
           [](Runtime& r, int max_bs, int max_num_tokens) {
             r.rt().init_cuda_graph_state(max_bs, max_num_tokens);
           })
      .def("cuda_graph_seq_len_fill_value",
           [](Runtime& r) { return r.rt().cuda_graph_seq_len_fill_value(); })
      .def("forward", &Runtime::forward, "layer_id"_a, "q"_a.none(), "k"_a.none(), "v"_a.none(),
           "out"_a.none(), "save_kv"_a = true, "sinks"_a.none() = nb::none(),
           "lse"_a.none() = nb::none(), "index_q"_a.none() = nb::none(),
           "index_k"_a.none() = nb::none(), "index_weights"_a.none() = nb::none(),
           "index_topk"_a.none() = nb::none())
      .def("forward_linear", &Runtime::forward_linear, "layer_id"_a, "mixed_qkv"_a, "a"_a,
           "b"_a.none(), "conv_weight"_a, "conv_bias"_a.none(), "A_log"_a, "dt_bias"_a,
           "D"_a.none(), "out"_a)
      .def("mla_form", &Runtime::mla_form)
      .def("prefix_chunk_plan", &Runtime::prefix_chunk_plan)
      .def("forward_mla_mha", &Runtime::forward_mla_mha, "layer_id"_a, "q"_a.none(), "k"_a.none(),
           "v"_a.none(), "out"_a.none(), "lse"_a.none(), "latent"_a.none(), "save_kv"_a)
      .def("gather_prefix_chunk", &Runtime::gather_prefix_chunk, "layer_id"_a, "chunk"_a,
           "latent"_a.none())
      .def("forward_mla_prefix_chunk", &Runtime::forward_mla_prefix_chunk, "layer_id"_a,
           "chunk"_a, "q"_a.none(), "k"_a.none(), "v"_a.none(), "out"_a.none(), "lse"_a.none())
      .def("end_step", &Runtime::end_step)
      .def("update_state_after_verify",
           [](Runtime& r, python::HostInts last_accepted) {
             const auto v = python::ints<int32_t>(last_accepted, "last_accepted");
             r.rt().update_state_after_verify(v);
           })
      .def("synchronize", [](Runtime& r) { r.rt().synchronize(); });

  // Decode context parallelism (docs/dcp.md): communicators, the simulated group, one rank.
  nb::class_<python::Comm>(m, "Communicator")
      .def_prop_ro("name", [](const python::Comm& c) { return std::string(c.comm->name()); })
      .def_prop_ro("size", [](const python::Comm& c) { return c.comm->size(); })
      .def_prop_ro("rank", [](const python::Comm& c) { return c.rank; });
  m.def("in_process_group", [](int size) {
    ATTNRT_CHECK(size >= 1 && size <= kMaxDcpSize,
                 "in_process_group: size {}; a group has 1..{} ranks", size, kMaxDcpSize);
    std::shared_ptr<Communicator> group = std::make_shared<InProcessCommunicator>(size, true);
    std::vector<python::Comm> out;
    for (int r = 0; r < size; ++r) out.push_back(python::Comm{group, nullptr, r});
    return out;
  });
  m.def("nccl_unavailable_reason", &nccl_unavailable_reason);
  m.def("nccl_version", &nccl_version);
  m.def("nccl_unique_id", [] {
    const NcclUniqueId id = nccl_unique_id();
    return nb::bytes(id.bytes.data(), id.bytes.size());
  });
  m.def(
      "nccl_communicator",
      [](nb::bytes id, int size, int rank, int device, uintptr_t stream) {
        NcclUniqueId u;
        ATTNRT_CHECK(id.size() == u.bytes.size(),
                     "nccl_communicator: unique_id has {} bytes; NCCL's id has {} (pass what "
                     "nccl_unique_id() returned on one rank)",
                     id.size(), u.bytes.size());
        std::memcpy(u.bytes.data(), id.c_str(), u.bytes.size());
        std::unique_ptr<Communicator> c;
        {
          nb::gil_scoped_release unlocked;  // joins block until every rank has called
          c = make_nccl_communicator(u, size, rank, device, reinterpret_cast<void*>(stream));
        }
        return python::Comm{std::shared_ptr<Communicator>(std::move(c)), nullptr, rank};
      },
      "unique_id"_a, "size"_a, "rank"_a, "device"_a, "stream"_a = 0);
  m.def(
      "wrap_nccl_comm",
      [](uintptr_t comm, int rank, uintptr_t stream) {
        std::unique_ptr<Communicator> c =
            wrap_nccl_comm(reinterpret_cast<void*>(comm), reinterpret_cast<void*>(stream));
        return python::Comm{std::shared_ptr<Communicator>(std::move(c)), nullptr, rank};
      },
      "comm"_a, "rank"_a, "stream"_a = 0);

#define ATTNRT_DCP_STEP(C)                                                                        \
  .def("begin_step", &C::begin_step, "mode"_a, "req_pool_indices"_a.none(), "seq_lens"_a.none(), \
       "extend_prefix_lens"_a.none(), "extend_seq_lens"_a.none(), "out_cache_loc"_a.none(),      \
       "positions"_a.none(), "draft_token_num"_a = 0, "topk"_a = 1,                              \
       "parents"_a.none() = nb::none(), "accept_length"_a.none() = nb::none(),                   \
       "graph_tokens"_a = 0)                                                                     \
      .def("init_cuda_graph_state", &C::init_cuda_graph_state, "max_num_tokens"_a)               \
      .def("begin_capture_step", &C::begin_capture_step, "tokens"_a)                             \
      .def_prop_ro("cuda_graphs_off_reason",                                                     \
                   [](C& g) { return g.impl().cuda_graphs_off_reason(); })                       \
      .def("forward", &C::forward, "layer_id"_a, "q"_a.none(), "k"_a.none(), "v"_a.none(),       \
           "out"_a.none(), "save_kv"_a = true, "sinks"_a.none() = nb::none(),                    \
           "lse"_a.none() = nb::none())                                                          \
      .def("end_step", &C::end_step)                                                             \
      .def("commit_verify", &C::commit_verify, "accepted"_a)                                     \
      .def("free_request", [](C& g, int row) { g.impl().free_request(row); })                    \
      .def("reserve_prefix", [](C& g, int row, int32_t n) { g.impl().reserve_prefix(row, n); })  \
      .def("set_kv_scales",                                                                      \
           [](C& g, int layer_id, float k, float v) { g.impl().set_kv_scales(layer_id, k, v); }) \
      .def("close", &C::close)                                                                   \
      .def_prop_ro("closed", &C::closed)                                                         \
      .def_prop_ro("in_step", &C::in_step)                                                       \
      .def_prop_ro("size", [](C& g) { return g.impl().size(); })                                 \
      .def("set_stream",                                                                         \
           [](C& g, uintptr_t s) { g.impl().set_stream(reinterpret_cast<void*>(s)); })           \
      .def("stream", [](C& g) { return reinterpret_cast<uintptr_t>(g.impl().stream()); })        \
      .def("use_framework", &C::use_framework, "tensor_type"_a)                                  \
      .def_prop_ro("follows_framework_stream", &C::follows_framework_stream)                     \
      .def_prop_ro("pool_device", [](C& g) {                                                     \
        const Device d = g.pool_device();                                                        \
        return nb::make_tuple(d.kind == DeviceKind::cuda ? "cuda" : "cpu", d.index);             \
      })                                                                                         \
      .def_prop_ro("layers", [](C& g) {                                                          \
        nb::list out;                                                                            \
        for (const LayerSpec& l : g.model().layers) out.append(python::layer_dict(l));           \
        return out;                                                                              \
      })                                                                                         \
      .def_prop_ro("model_dtype",                                                                \
                   [](C& g) { return std::string(dtype_name(g.model().dtype)); })

  nb::class_<python::Dcp>(m, "DcpAttention")
      .def(nb::init<const std::string&, const std::string&, const std::string&, int,
                    const Options&, const RuntimeConfig&>(),
           "model"_a, "config_json"_a, "dtype"_a, "tp_size"_a, "options"_a, "config"_a)
      ATTNRT_DCP_STEP(python::Dcp);

  nb::class_<python::DcpRankPy>(m, "DcpRank")
      .def(nb::init<const std::string&, const std::string&, const std::string&, int,
                    const Options&, const RuntimeConfig&, const python::Comm&>(),
           "model"_a, "config_json"_a, "dtype"_a, "tp_size"_a, "options"_a, "config"_a,
           "communicator"_a)
      ATTNRT_DCP_STEP(python::DcpRankPy)
      .def_prop_ro("rank", &python::DcpRankPy::rank)
      .def("head_range", &python::DcpRankPy::head_range, "layer_id"_a)
      .def("synchronize", &python::DcpRankPy::synchronize);
#undef ATTNRT_DCP_STEP
}
