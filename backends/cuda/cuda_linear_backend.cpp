#include "backends/cuda/cuda_linear_backend.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/linear_state_pool.h"
#include "backends/cuda/cuda_linear_state.h"
#include "backends/cuda/kernels/linear.h"

namespace attnrt::cuda {

namespace {

constexpr int kMaxConvKernel = 8;   // kernels/linear_conv.cu
constexpr int kMaxStateCols = 256;  // kernels/linear_recurrent.cu
constexpr int kChunk = 64;          // tokens per chunk of the chunked extend launchers

// The shapes the chunked launchers take (kernels/linear_delta_chunked.cu, linear_ssd_chunked.cu).
bool has_chunked_form(const LayerSpec& layer, const LinearStateShape& sh) {
  if (layer.kind == LayerKind::mamba2) return sh.rows == 64 && (sh.cols == 64 || sh.cols == 128);
  return (sh.rows == 64 && sh.cols == 64) || (sh.rows == 128 && sh.cols == 128);
}

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

linear::DTypeCode code(DType t) { return static_cast<linear::DTypeCode>(t); }

bool on_device(const TensorView& t) { return t.device.kind == DeviceKind::cuda; }

// The host tensors of one call, packed into one device buffer: where each goes and its row layout
// there (per-token tensors become contiguous rows).
struct Staged {
  const TensorView* t = nullptr;
  int64_t rows = 0, row_elems = 0;  // rows x row_elems elements of t.dtype
  size_t offset = 0;
  size_t bytes() const { return static_cast<size_t>(rows * row_elems) * dtype_size(t->dtype); }
};

void check_launch(cudaError_t err, const char* what, const LayerSpec& layer) {
  ATTNRT_CHECK(err == cudaSuccess, "cuda linear backend: layer {} ({}): {} failed: {}",
               layer.layer_id, layer_kind_name(layer.kind), what, cudaGetErrorString(err));
}

}  // namespace

CudaLinearBackend::CudaLinearBackend(const BackendContext& ctx) : LinearAttnBackend(ctx) {
  const CudaDeviceInfo& info = query_cuda();
  ATTNRT_CHECK(info.usable, "cuda linear backend: no usable CUDA device ({})", info.reason);
  ATTNRT_CHECK(ctx.model != nullptr, "cuda linear backend: BackendContext.model is null");
  LinearStatePool& p = pool();
  memory_ = dynamic_cast<CudaLinearStateMemory*>(&p.memory());
  ATTNRT_CHECK(memory_ != nullptr,
               "cuda linear backend: the linear state pool is on {}; this backend keeps the "
               "state in GPU memory: build the pool with make_cuda_linear_state_memory (the "
               "runtime does when the KV cache is on the GPU)",
               device_name(p.device()));
  for (const LayerSpec& l : ctx.model->layers) {
    if (!is_linear_kind(l.kind)) continue;
    const LinearStateShape sh = linear_state_shape(l);
    const LinearSpec& s = l.linear;
    ATTNRT_CHECK(s.conv_kernel >= 1 && s.conv_kernel <= kMaxConvKernel,
                 "cuda linear backend: layer {} ({}) has conv_kernel {}; the kernels take 1..{}",
                 l.layer_id, layer_kind_name(l.kind), s.conv_kernel, kMaxConvKernel);
    ATTNRT_CHECK(sh.cols >= 1 && sh.cols <= kMaxStateCols,
                 "cuda linear backend: layer {} ({}) has {} state columns ({}); the kernels take "
                 "up to {}",
                 l.layer_id, layer_kind_name(l.kind), sh.cols,
                 l.kind == LayerKind::mamba2 ? "d_state" : "head_k_dim", kMaxStateCols);
    const int key_heads = l.kind == LayerKind::mamba2 ? s.n_groups : s.num_k_heads;
    ATTNRT_CHECK(key_heads >= 1 && sh.heads % key_heads == 0,
                 "cuda linear backend: layer {} ({}) has {} heads and {} {}; the heads must be a "
                 "multiple",
                 l.layer_id, layer_kind_name(l.kind), sh.heads, key_heads,
                 l.kind == LayerKind::mamba2 ? "groups" : "key heads");
  }
}

CudaLinearBackend::~CudaLinearBackend() {
  if (memory_ != nullptr) cudaStreamSynchronize(memory_->stream());
}

cudaStream_t CudaLinearBackend::stream() const { return memory_->stream(); }

void CudaLinearBackend::ensure(DeviceBuffer& buf, size_t bytes) {
  if (bytes > buf.bytes()) buf.reserve_async(bytes, stream());
}

void CudaLinearBackend::init_forward_metadata(const ForwardBatch& batch) {
  planned_ = false;
  plan_ = attnrt::linear::make_step_plan(batch, pool(), "cuda");
  ATTNRT_CHECK(plan_.reqs.size() <= 65535,
               "cuda linear backend: a step of {} requests; the kernels take up to 65535",
               plan_.reqs.size());
  split_ = !plan_.verify && plan_.max_tokens > kChunk;
  if (!plan_.reqs.empty() && plan_.num_tokens > 0) {
    const size_t bs = plan_.reqs.size();
    table_bytes_ = align_up(bs * sizeof(linear::LinReq), 16);
    parents_off_ = table_bytes_ * (split_ ? 3 : 1);
    const size_t bytes = parents_off_ + plan_.parents.size() * sizeof(int32_t);
    ensure(meta_, bytes);
    // Stream order: the pinned slot is written only after the copy that last read it ran
    // (StagingRing::acquire); the copy into meta_ precedes this step's kernels on stream(), and
    // the next step's copy into meta_ comes after them.
    char* host = static_cast<char*>(staging_.acquire(bytes, stream()));
    auto* reqs = reinterpret_cast<linear::LinReq*>(host);
    auto* short_reqs = reinterpret_cast<linear::LinReq*>(host + table_bytes_);
    auto* long_reqs = reinterpret_cast<linear::LinReq*>(host + 2 * table_bytes_);
    for (size_t i = 0; i < bs; ++i) {
      const attnrt::linear::RequestWork& w = plan_.reqs[i];
      reqs[i] = {w.slot, static_cast<int32_t>(w.token_start), w.tokens, w.has_initial_state ? 1 : 0,
                 0};
      if (split_) {
        const bool is_long = w.tokens > kChunk;
        short_reqs[i] = reqs[i];
        long_reqs[i] = reqs[i];
        (is_long ? short_reqs[i] : long_reqs[i]).tokens = 0;
      }
    }
    if (!plan_.parents.empty()) {
      std::memcpy(host + parents_off_, plan_.parents.data(),
                  plan_.parents.size() * sizeof(int32_t));
    }
    staging_.upload(meta_.data(), bytes, stream());
  }
  planned_ = true;
}

void CudaLinearBackend::forward_linear(const LinearArgs& args, const LayerSpec& layer,
                                       const ForwardBatch& batch) {
  if (!begin_layer(args, layer, batch, /*device_tensors=*/true)) return;
  const LinearLayerState& st = pool().layer(layer.layer_id);
  const LinearStateShape& sh = st.shape;
  const int64_t T = plan_.num_tokens;
  const bool mamba = layer.kind == LayerKind::mamba2;
  const cudaStream_t s = stream();

  // Host tensors go to the device first; out (when on the host) comes back at the end.
  std::vector<Staged> staged;
  auto stage = [&](const TensorView& t, bool per_token) {
    if (t.empty() || on_device(t)) return;
    Staged g;
    g.t = &t;
    g.rows = per_token ? T : 1;
    g.row_elems = per_token ? t.numel() / std::max<int64_t>(T, 1) : t.numel();
    staged.push_back(g);
  };
  stage(args.mixed_qkv, true);
  stage(args.a, true);
  stage(args.b, true);
  stage(args.out, true);
  for (const TensorView* t :
       {&args.conv_weight, &args.conv_bias, &args.A_log, &args.dt_bias, &args.D}) {
    stage(*t, false);
  }
  size_t io_bytes = 0;
  for (Staged& g : staged) {
    g.offset = io_bytes;
    io_bytes = align_up(io_bytes + g.bytes(), 256);
  }
  // The conv outputs y: fp32 for fp32 activations, else bf16 (linear.h).
  const DType y_dtype = args.mixed_qkv.dtype == DType::f32 ? DType::f32 : DType::bf16;
  ensure(y_, static_cast<size_t>(T) * sh.conv_dim * dtype_size(y_dtype));
  if (io_bytes > 0) ensure(io_, io_bytes);
  // Device address and row stride (elements) of each tensor.
  struct Where {
    void* ptr;
    int64_t stride;
  };
  auto where = [&](const TensorView& t) -> Where {
    if (t.empty()) return {nullptr, 0};
    for (const Staged& g : staged) {
      if (g.t == &t) return {io_.ptr<char>() + g.offset, g.row_elems};
    }
    return {t.data, t.ndim > 0 ? t.strides[0] : 0};
  };
  // Stream order: host inputs are copied on the stream into io_ before the kernels that read them;
  // with a device output nothing below waits for the stream, so the call waits for the copies
  // (a pinned source is read when its copy runs, and the caller may reuse it on return).
  bool host_inputs = false;
  for (const Staged& g : staged) {
    if (g.t == &args.out) continue;
    host_inputs = true;
    const size_t elem = dtype_size(g.t->dtype);
    const size_t row_bytes = static_cast<size_t>(g.row_elems) * elem;
    const size_t src_pitch = g.rows > 1 ? static_cast<size_t>(g.t->strides[0]) * elem : row_bytes;
    ATTNRT_CUDA_CHECK(cudaMemcpy2DAsync(io_.ptr<char>() + g.offset, row_bytes, g.t->data, src_pitch,
                                        row_bytes, static_cast<size_t>(g.rows),
                                        cudaMemcpyHostToDevice, s));
  }
  if (host_inputs && on_device(args.out)) ATTNRT_CUDA_CHECK(cudaStreamSynchronize(s));

  linear::LinStep step;
  step.reqs = meta_.ptr<linear::LinReq>();
  step.num_reqs = static_cast<int32_t>(plan_.reqs.size());
  step.max_tokens = static_cast<int32_t>(plan_.max_tokens);
  step.verify = plan_.verify ? 1 : 0;
  step.draft_tokens = plan_.draft_tokens;
  step.parents =
      plan_.verify ? reinterpret_cast<const int32_t*>(meta_.ptr<char>() + parents_off_) : nullptr;
  linear::LinState state;
  state.conv = st.conv;
  state.ssm = st.ssm;
  state.inter_conv = st.inter_conv;
  state.inter_ssm = st.inter_ssm;
  state.conv_dtype = code(st.conv_dtype);
  state.ssm_dtype = code(st.ssm_dtype);
  state.conv_dim = sh.conv_dim;
  state.conv_width = sh.conv_width;
  state.heads = sh.heads;
  state.rows = sh.rows;
  state.cols = sh.cols;

  const Where x = where(args.mixed_qkv), a = where(args.a), b = where(args.b),
              out = where(args.out);
  linear::ConvParams cp;
  cp.step = step;
  cp.state = state;
  cp.x = x.ptr;
  cp.x_stride = x.stride;
  cp.x_dtype = code(args.mixed_qkv.dtype);
  cp.weight = static_cast<const float*>(where(args.conv_weight).ptr);
  cp.bias = static_cast<const float*>(where(args.conv_bias).ptr);
  cp.kernel = layer.linear.conv_kernel;
  cp.y = y_.data();
  cp.y_dtype = code(y_dtype);
  check_launch(linear::launch_conv(cp, s), "launch_conv", layer);

  // DECODE, TARGET_VERIFY and requests of up to one chunk: token by token, right after the conv
  // (its dependent: a / b, the table and the state were on the device before the conv). Longer
  // extend requests: the chunked form where the layer's shape has one (each launch sees the other's
  // requests with 0 tokens).
  const bool chunked = split_ && has_chunked_form(layer, sh);
  linear::LinStep rec_step = step, chunk_step = step;
  if (chunked) {
    rec_step.reqs = reinterpret_cast<const linear::LinReq*>(meta_.ptr<char>() + table_bytes_);
    chunk_step.reqs = reinterpret_cast<const linear::LinReq*>(meta_.ptr<char>() + 2 * table_bytes_);
  }
  if (mamba) {
    linear::SsdParams p;
    p.step = rec_step;
    p.state = state;
    p.groups = layer.linear.n_groups;
    p.y = y_.data();
    p.y_dtype = code(y_dtype);
    p.a = a.ptr;
    p.a_stride = a.stride;
    p.a_dtype = code(args.a.dtype);
    p.A_log = static_cast<const float*>(where(args.A_log).ptr);
    p.dt_bias = static_cast<const float*>(where(args.dt_bias).ptr);
    p.D = static_cast<const float*>(where(args.D).ptr);
    p.out = out.ptr;
    p.out_stride = out.stride;
    p.out_dtype = code(args.out.dtype);
    check_launch(linear::launch_ssd_recurrent(p, s, /*dependent=*/true), "launch_ssd_recurrent",
                 layer);
    if (chunked) {
      p.step = chunk_step;
      ensure(workspace_, std::max<size_t>(linear::ssd_chunked_workspace(p, T, kChunk), 1));
      check_launch(linear::launch_ssd_chunked(p, T, kChunk, workspace_.data(), s),
                   "launch_ssd_chunked", layer);
    }
  } else {
    linear::DeltaParams p;
    p.step = rec_step;
    p.state = state;
    p.kda = layer.kind == LayerKind::kda ? 1 : 0;
    p.key_heads = layer.linear.num_k_heads;
    p.scale = layer.scaling > 0.f ? layer.scaling : 1.f / std::sqrt(static_cast<float>(sh.cols));
    p.y = y_.data();
    p.y_dtype = code(y_dtype);
    p.a = a.ptr;
    p.a_stride = a.stride;
    p.a_dtype = code(args.a.dtype);
    p.b = b.ptr;
    p.b_stride = b.stride;
    p.b_dtype = code(args.b.dtype);
    p.A_log = static_cast<const float*>(where(args.A_log).ptr);
    p.dt_bias = static_cast<const float*>(where(args.dt_bias).ptr);
    p.out = out.ptr;
    p.out_stride = out.stride;
    p.out_dtype = code(args.out.dtype);
    check_launch(linear::launch_delta_recurrent(p, s, /*dependent=*/true),
                 "launch_delta_recurrent", layer);
    if (chunked) {
      p.step = chunk_step;
      ensure(workspace_, std::max<size_t>(linear::delta_chunked_workspace(p, T, kChunk), 1));
      check_launch(linear::launch_delta_chunked(p, T, kChunk, workspace_.data(), s),
                   "launch_delta_chunked", layer);
    }
  }

  if (!on_device(args.out)) {
    const size_t elem = dtype_size(args.out.dtype);
    const size_t row_bytes = static_cast<size_t>(int64_t{sh.heads} * sh.rows) * elem;
    ATTNRT_CUDA_CHECK(cudaMemcpy2DAsync(args.out.data,
                                        static_cast<size_t>(args.out.strides[0]) * elem, out.ptr,
                                        static_cast<size_t>(out.stride) * elem, row_bytes,
                                        static_cast<size_t>(T), cudaMemcpyDeviceToHost, s));
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(s));
  }
}

void CudaLinearBackend::update_state_after_verify(std::span<const int32_t> last_accepted) {
  check_commit(last_accepted);
  const size_t bs = plan_.slots.size();
  const int n = plan_.draft_tokens;
  for (size_t i = 0; i < bs; ++i) {
    ATTNRT_CHECK(last_accepted[i] >= -1 && last_accepted[i] < n,
                 "cuda linear backend: update_state_after_verify: last accepted index {} of "
                 "request {} is out of range -1..{} (the verify block has {} tokens)",
                 last_accepted[i], i, n - 1, n);
  }
  if (bs == 0) return;
  const size_t acc_off = align_up(bs * sizeof(int64_t), 16);
  const size_t bytes = acc_off + bs * sizeof(int32_t);
  ensure(commit_, bytes);
  // Stream order: as the step's table (init_forward_metadata); the commit kernels read commit_
  // after the copy, and after the verify step's kernels that wrote the checkpoints.
  char* host = static_cast<char*>(staging_.acquire(bytes, stream()));
  std::memcpy(host, plan_.slots.data(), bs * sizeof(int64_t));
  std::memcpy(host + acc_off, last_accepted.data(), bs * sizeof(int32_t));
  staging_.upload(commit_.data(), bytes, stream());
  for (int id : pool().layer_ids()) {
    const LinearLayerState& st = pool().layer(id);
    linear::CommitParams p;
    p.state.conv = st.conv;
    p.state.ssm = st.ssm;
    p.state.inter_conv = st.inter_conv;
    p.state.inter_ssm = st.inter_ssm;
    p.state.conv_dtype = code(st.conv_dtype);
    p.state.ssm_dtype = code(st.ssm_dtype);
    p.state.conv_dim = st.shape.conv_dim;
    p.state.conv_width = st.shape.conv_width;
    p.state.heads = st.shape.heads;
    p.state.rows = st.shape.rows;
    p.state.cols = st.shape.cols;
    p.slots = commit_.ptr<int64_t>();
    p.last_accepted = reinterpret_cast<const int32_t*>(commit_.ptr<char>() + acc_off);
    p.rows = static_cast<int32_t>(bs);
    p.draft_tokens = n;
    const cudaError_t err = linear::launch_commit(p, stream());
    ATTNRT_CHECK(err == cudaSuccess, "cuda linear backend: launch_commit (layer {}) failed: {}", id,
                 cudaGetErrorString(err));
  }
}

}  // namespace attnrt::cuda
