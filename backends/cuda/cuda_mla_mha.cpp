// MLA's MHA form on the cuda backend (docs/mla.md): the causal part of an MHA-form step and each
// prefix chunk run on the warp-specialised prefill CTA at q / k 192, v 128 (prefill_mla_mha_entry),
// one KV head per q head, reading the model's k / v tensors in place (key j of a request is row
// pt_start + j: AttnParams::kv_ragged), whole tiles by TMA; a chunk's (out, lse) is merged into the running result on the GPU
// (launch_mla_merge_chunk); the chunks' latent rows are gathered from the latent pool on the GPU
// (launch_gather_rows).
//
// Plan: init_forward_metadata of an EXTEND / MIXED step chooses the form (HostMlaMhaSteps, the
// rule of every backend) and, for the MHA form, lays out on the host the requests and work items
// of the causal part (each request's extend tokens attend to themselves, causally: prefix 0,
// keys = its extend tokens) and of every chunk (the extend tokens of each request attend to the
// chunk's keys of that request, no mask), with the chunks' latent slots. The first MHA-form call
// of the step uploads them in one copy; every layer's calls reuse them.
#include <algorithm>
#include <cstring>
#include <string>

#include <fmt/format.h>

#include "attnrt/batch/forward_mode.h"
#include "attnrt/core/device.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "backends/cuda/cuda_backend.h"
#include "backends/cuda/cuda_kv_cache.h"
#include "backends/cuda/kernels/launch.h"
#include "backends/cuda/kernels/prefill.h"

namespace attnrt::cuda {

namespace {

size_t align16(size_t x) { return (x + 15) / 16 * 16; }

bool on_gpu(const TensorView& t) { return t.device.kind == DeviceKind::cuda; }

// The element strides a launch reads a tensor with: rows of `dim` contiguous elements, 16-byte
// aligned (the kernel's cp.async copies), heads `head` elements apart where the CTA needs that.
void check_gpu_layout(const char* what, const TensorView& t, int64_t head_stride) {
  ATTNRT_CHECK(t.strides[2] == 1 && t.strides[0] % 8 == 0 && t.strides[1] % 8 == 0 &&
                   reinterpret_cast<uintptr_t>(t.data) % 16 == 0 &&
                   (head_stride == 0 || t.strides[1] == head_stride),
               "cuda backend: {} is {} with strides [{}, {}, {}]; the MHA form reads rows of "
               "contiguous elements, 16-byte aligned, token stride a multiple of 8{}",
               what, t.describe(), t.strides[0], t.strides[1], t.strides[2],
               head_stride == 0 ? std::string(", head stride a multiple of 8")
                                : fmt::format(", heads {} elements apart (packed)", head_stride));
}

void check_act_dtype(const char* what, const TensorView& t, DType want) {
  ATTNRT_CHECK(t.dtype == want && (want == DType::bf16 || want == DType::f16),
               "cuda backend: {} is {}; the MHA form takes q, k, v and out in one dtype, bf16 or "
               "fp16 (q is {})",
               what, t.describe(), dtype_name(want));
}

// The tensors of an MHA-form call (`call`: the causal part or a prefix chunk): q, k, v and out in
// one 16-bit dtype, all five on the GPU or all on the host, and on the GPU in the layouts the CTA
// reads (k / v heads packed). Returns whether they are on the GPU.
bool check_mha_tensors(const char* call, const TensorView& q, const TensorView& k,
                       const TensorView& v, const TensorView& out, const TensorView& lse,
                       const MlaMhaDims& d) {
  for (auto [what, t] : {std::pair{"k", &k}, {"v", &v}, {"out", &out}})
    check_act_dtype(what, *t, q.dtype);
  const bool dev = on_gpu(q);
  for (auto [what, t] : {std::pair{"k", &k}, {"v", &v}, {"out", &out}, {"lse", &lse}}) {
    ATTNRT_CHECK(t->empty() || on_gpu(*t) == dev,
                 "cuda backend: q is {} but {} is {}; {}'s q, k, v, out and lse must all be on "
                 "the GPU or all on the host",
                 q.describe(), what, t->describe(), call);
  }
  if (dev) {
    check_gpu_layout("q", q, 0);
    check_gpu_layout("k", k, d.qk);
    check_gpu_layout("v", v, d.v);
    check_gpu_layout("out", out, 0);
    ATTNRT_CHECK(lse.empty() || lse.strides[1] == 1,
                 "cuda backend: lse is {} with head stride {}; the heads must be contiguous",
                 lse.describe(), lse.empty() ? 0 : lse.strides[1]);
  }
  return dev;
}

}  // namespace

bool CudaBackend::planned_mha_for(const ForwardBatch& batch) const {
  return mha_mode_ == batch.mode && mha_bs_ == batch.batch_size &&
         mha_tokens_ == batch.num_tokens();
}

void CudaBackend::plan_mla_mha(const ForwardBatch& batch) {
  mha_plan_.uploaded = false;
  mha_mode_ = batch.mode;
  mha_bs_ = batch.batch_size;
  mha_tokens_ = batch.num_tokens();
  if (!is_extend_without_speculative(batch.mode)) {
    mha_.reset();
    return;
  }
  const StepLayout layout = make_step_layout(batch);
  mha_.plan("cuda", ctx_, batch, layout);
  if (mha_.form() != MlaForm::mha) return;
  const int bs = batch.batch_size;
  const PrefixChunkPlan& chunks = mha_.chunks();
  int64_t rows = layout.num_tokens;
  for (const PrefixChunk& c : chunks.chunks) rows = std::max(rows, c.num_tokens);
  ATTNRT_CHECK(rows < (int64_t{1} << 31),
               "cuda backend: an MHA-form step of {} tokens; the kernels index up to 2^31 - 1",
               rows);

  MhaDevicePlan& mp = mha_plan_;
  std::vector<unsigned char>& bytes = mp.host;
  bytes.clear();
  auto reserve = [&](size_t n) {
    const size_t off = align16(bytes.size());
    bytes.resize(off + n);
    return off;
  };
  // One part: every request's query rows in 128-row items on every head (one unit each); kv_len(i)
  // keys of request i, the first at row pt_start(i) of the part's k / v. The CTAs take units in
  // list order: the heads in groups whose K/V fit in half the L2 (all their units before the next
  // group's, so that the CTAs running at once share K/V tiles there), heaviest units first within
  // a group. On the H200 (50 MiB of L2), 1x16384 at 128 heads moves 10 MiB of K/V per head: ungrouped
  // (every head at once) each tile came from DRAM.
  const int hq = mha_heads_;
  const int64_t l2 = static_cast<int64_t>(std::max<size_t>(query_cuda().l2_bytes, 8 << 20));
  std::vector<WorkItem> items;
  auto add_part = [&](MhaPart& part, bool causal, int64_t part_tokens, auto kv_len,
                      auto pt_start) {
    part.reqs_off = reserve(static_cast<size_t>(bs) * sizeof(ReqInfo));
    for (int i = 0; i < bs; ++i) {
      ReqInfo r{};
      r.qo_start = static_cast<int32_t>(layout.query_start[i]);
      r.qlen = layout.query_lens[i];
      r.prefix = 0;
      r.kv_len = kv_len(i);
      r.pt_start = static_cast<int32_t>(pt_start(i));
      r.num_splits = 1;
      r.tree_start = -1;
      std::memcpy(bytes.data() + part.reqs_off + i * sizeof(ReqInfo), &r, sizeof(r));
    }
    const int64_t head_bytes =
        std::max<int64_t>(part_tokens, 1) * (kMlaMhaHeadDim + kMlaMhaVHeadDim) * 2;
    const int group = static_cast<int>(std::clamp<int64_t>(l2 / 2 / head_bytes, 1, hq));
    // The (request, rows) items heaviest first, once; then per head group each item on each of
    // the group's heads, written in place.
    items.clear();
    for (int i = 0; i < bs; ++i) {
      for (int f0 = 0; f0 < layout.query_lens[i]; f0 += kPrefillTileRows)
        items.push_back({i, f0, 0, 0});
    }
    auto keys = [&](const WorkItem& w) {
      return causal ? std::min(layout.query_lens[w.req], w.f0 + kPrefillTileRows) : kv_len(w.req);
    };
    std::stable_sort(items.begin(), items.end(),
                     [&](const WorkItem& a, const WorkItem& b) { return keys(a) > keys(b); });
    part.num_items = static_cast<int>(items.size()) * hq;
    part.work_off = reserve(static_cast<size_t>(part.num_items) * sizeof(WorkItem));
    auto* unit = reinterpret_cast<WorkItem*>(bytes.data() + part.work_off);
    for (int h0 = 0; h0 < hq; h0 += group) {
      const int h1 = std::min(hq, h0 + group);
      for (const WorkItem& w : items) {
        for (int h = h0; h < h1; ++h) *unit++ = {w.req, w.f0, 0, h};
      }
    }
  };
  add_part(
      mp.causal, true, layout.num_tokens, [&](int i) { return layout.query_lens[i]; },
      [&](int i) { return layout.query_start[i]; });
  mp.chunks.assign(chunks.chunks.size(), MhaPart{});
  mp.slots_off.assign(chunks.chunks.size(), 0);
  for (size_t c = 0; c < chunks.chunks.size(); ++c) {
    const PrefixChunk& pc = chunks.chunks[c];
    // A request whose prefix ended before this chunk has its rows written with no keys (out 0,
    // lse -inf), which the merge skips.
    add_part(
        mp.chunks[c], false, pc.num_tokens, [&](int i) { return pc.lens[i]; },
        [&](int i) { return pc.cu_seqlens[i]; });
    mp.slots_off[c] = reserve(pc.slots.size() * sizeof(int64_t));
    auto* s = reinterpret_cast<int64_t*>(bytes.data() + mp.slots_off[c]);
    for (size_t j = 0; j < pc.slots.size(); ++j) s[j] = pc.slots[j];
  }
  ATTNRT_CHECK(int64_t{mp.causal.num_items} < (int64_t{1} << 31),
               "cuda backend: {} MHA-form work units in one step; at most 2^31 - 1",
               mp.causal.num_items);
}

void CudaBackend::upload_mha_plan() {
  if (mha_plan_.uploaded) return;
  const std::vector<unsigned char>& bytes = mha_plan_.host;
  ensure(mha_meta_, bytes.size(), "MHA-form plan");
  // Stream order: every MHA-form launch and gather of the step comes after this copy on stream_;
  // the next step's copy into the same buffer comes after them.
  ATTNRT_CUDA_CHECK(cudaMemcpyAsync(mha_meta_.data(), bytes.data(), bytes.size(),
                                    cudaMemcpyHostToDevice, stream_));
  mha_plan_.uploaded = true;
}

void CudaBackend::launch_mla_mha(const LayerSpec& layer, const MhaPart& part, bool chunk,
                                 const void* q, int64_t q_tok, int64_t q_head, const void* k,
                                 int64_t k_tok, const void* v, int64_t v_tok, void* out,
                                 int64_t o_tok, int64_t o_head, float* lse, int64_t lse_tok,
                                 int64_t kv_rows, bool fp16) {
  if (part.num_items == 0) return;
  const char* meta = mha_meta_.ptr<char>();
  const int hq = layer.num_q_heads;
  ATTNRT_CHECK(hq == mha_heads_,
               "cuda backend: layer {} has {} q heads; the MHA-form plan of this model is for {} "
               "(the first MLA layer with an MHA form): every such layer must have as many",
               layer.layer_id, hq, mha_heads_);
  const float scale = layer.softmax_scale();
  AttnParams p{};
  p.q = q;
  p.out = out;
  p.q_stride_tok = q_tok;
  p.q_stride_head = q_head;
  p.o_stride_tok = o_tok;
  p.o_stride_head = o_head;
  p.lse_out = lse;
  p.lse_stride_tok = lse_tok;
  p.k = k;
  p.v = v;
  p.k_row_stride = k_tok;
  p.v_row_stride = v_tok;
  p.kv_kind = KvKind::same_as_q;
  p.kv_ragged = 1;
  p.page_shift = mla_mha_tile_shift();
  p.kv_rows = kv_rows;
  p.reqs = reinterpret_cast<const ReqInfo*>(meta + part.reqs_off);
  p.work = reinterpret_cast<const WorkItem*>(meta + part.work_off);
  p.num_q_heads = hq;
  p.num_kv_heads = hq;
  p.group = 1;
  p.scale_log2 = scale * 1.4426950408889634f;
  p.softmax_scale = scale;
  p.softcap = layer.logit_cap;
  p.v_scale = 1.f;
  p.window = -1;
  p.causal = chunk ? 0 : 1;
  p.merge_out = chunk ? 1 : 0;
  p.item_rows = kPrefillTileRows;
  p.sched = sched_.ptr<int32_t>();
  p.item_heads = 1;
  const AttnCtaEntry entry = prefill_mla_mha_entry(fp16);
  ATTNRT_CUDA_CHECK(entry.launch(p, AttnKernelKey{}, part.num_items, stream_, false));
}

void CudaBackend::forward_mla_mha(const MlaMhaArgs& args, const LayerSpec& layer,
                                  const ForwardBatch& batch) {
  mha_.check_causal("cuda", ctx_, planned_mha_for(batch), args, layer, batch);
  const MlaMhaDims d = mla_mha_dims(layer);
  ATTNRT_CHECK(d.qk == kMlaMhaHeadDim && d.v == kMlaMhaVHeadDim,
               "cuda backend: layer {} has an MHA form of q / k {} and v {}; the cuda kernel "
               "takes {} / {} (DeepSeek's 128 nope + 64 rope, v 128); use the cpu or reference "
               "backend for other dims",
               layer.layer_id, d.qk, d.v, kMlaMhaHeadDim, kMlaMhaVHeadDim);
  const DType dt = args.q.dtype;
  const bool dev =
      check_mha_tensors("the MHA form", args.q, args.k, args.v, args.out, args.lse, d);
  ATTNRT_CHECK(dev || !stream_is_capturing(stream_),
               "cuda backend: host tensors ({}) cannot be used inside a CUDA-graph capture",
               args.q.describe());
  if (args.save_kv) ctx_.kv_cache->store_step_kv(layer.layer_id, args.latent, TensorView());
  upload_mha_plan();
  const int64_t T = batch.num_tokens();
  const int hq = layer.num_q_heads;
  const bool fp16 = dt == DType::f16;
  const size_t es = dtype_size(dt);
  if (dev) {
    launch_mla_mha(layer, mha_plan_.causal, false, args.q.data, args.q.strides[0],
                   args.q.strides[1], args.k.data, args.k.strides[0], args.v.data,
                   args.v.strides[0], args.out.data, args.out.strides[0], args.out.strides[1],
                   args.lse.empty() ? nullptr : args.lse.ptr<float>(),
                   args.lse.empty() ? 0 : args.lse.strides[0], T, fp16);
  } else {
    for (auto [what, t] : {std::pair{"q", &args.q}, {"k", &args.k}, {"v", &args.v},
                           {"out", &args.out}, {"lse", &args.lse}}) {
      ATTNRT_CHECK(t->empty() || t->is_contiguous(),
                   "cuda backend: host tensor {} is {}; host tensors must be contiguous", what,
                   t->describe());
    }
    const size_t qb = args.q.numel() * es, kb = args.k.numel() * es, vb = args.v.numel() * es;
    const size_t ob = args.out.numel() * es, lb = args.lse.empty() ? 0 : args.lse.numel() * 4;
    const size_t k_off = align16(qb), v_off = k_off + align16(kb), o_off = v_off + align16(vb);
    const size_t l_off = o_off + align16(ob);
    ensure(mha_scratch_, l_off + lb + 16, "MHA-form staging");
    char* base = mha_scratch_.ptr<char>();
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(base, args.q.data, qb, cudaMemcpyHostToDevice, stream_));
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(base + k_off, args.k.data, kb, cudaMemcpyHostToDevice, stream_));
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(base + v_off, args.v.data, vb, cudaMemcpyHostToDevice, stream_));
    float* lse = lb > 0 ? reinterpret_cast<float*>(base + l_off) : nullptr;
    launch_mla_mha(layer, mha_plan_.causal, false, base, int64_t{hq} * d.qk, d.qk, base + k_off,
                   int64_t{hq} * d.qk, base + v_off, int64_t{hq} * d.v, base + o_off,
                   int64_t{hq} * d.v, d.v, lse, hq, T, fp16);
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(args.out.data, base + o_off, ob, cudaMemcpyDeviceToHost, stream_));
    if (lse != nullptr)
      ATTNRT_CUDA_CHECK(cudaMemcpyAsync(args.lse.data, lse, lb, cudaMemcpyDeviceToHost, stream_));
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  mha_.causal_done(layer.layer_id);
}

void CudaBackend::forward_mla_prefix_chunk(int chunk, const MlaChunkArgs& args,
                                           const LayerSpec& layer, const ForwardBatch& batch) {
  mha_.check_chunk("cuda", planned_mha_for(batch), chunk, args, layer, batch);
  const MlaMhaDims d = mla_mha_dims(layer);
  const DType dt = args.q.dtype;
  const bool dev =
      check_mha_tensors("a prefix chunk", args.q, args.k, args.v, args.out, args.lse, d);
  upload_mha_plan();
  const int64_t n = mha_.chunks().chunks[chunk].num_tokens;
  const int hq = layer.num_q_heads;
  const bool fp16 = dt == DType::f16;
  const size_t es = dtype_size(dt);
  const size_t qb = args.q.numel() * es, kb = args.k.numel() * es, vb = args.v.numel() * es;
  const size_t ob = args.out.numel() * es, lb = args.lse.numel() * 4;
  const size_t q_off = 0, k_off = q_off + align16(qb), v_off = k_off + align16(kb);
  const size_t o_off = v_off + align16(vb), l_off = o_off + align16(ob);
  char* base = nullptr;
  if (!dev) {
    ensure(mha_scratch_, l_off + lb + 16, "MHA-form staging");
    base = mha_scratch_.ptr<char>();
  }

  const void *q = args.q.data, *k = args.k.data, *v = args.v.data;
  void* out = args.out.data;
  float* lse = static_cast<float*>(args.lse.data);
  int64_t q_tok = hq * int64_t{d.qk}, q_head = d.qk, k_tok = q_tok, v_tok = hq * int64_t{d.v};
  int64_t o_tok = v_tok, o_head = d.v, lse_tok = hq;
  if (dev) {
    q_tok = args.q.strides[0];
    q_head = args.q.strides[1];
    k_tok = args.k.strides[0];
    v_tok = args.v.strides[0];
    o_tok = args.out.strides[0];
    o_head = args.out.strides[1];
    lse_tok = args.lse.strides[0];
  } else {
    for (auto [what, t] : {std::pair{"q", &args.q}, {"k", &args.k}, {"v", &args.v},
                           {"out", &args.out}, {"lse", &args.lse}}) {
      ATTNRT_CHECK(t->is_contiguous(),
                   "cuda backend: host tensor {} is {}; host tensors must be contiguous", what,
                   t->describe());
    }
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(base + q_off, args.q.data, qb, cudaMemcpyHostToDevice, stream_));
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(base + k_off, args.k.data, kb, cudaMemcpyHostToDevice, stream_));
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(base + v_off, args.v.data, vb, cudaMemcpyHostToDevice, stream_));
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(base + o_off, args.out.data, ob, cudaMemcpyHostToDevice, stream_));
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(base + l_off, args.lse.data, lb, cudaMemcpyHostToDevice, stream_));
    q = base + q_off;
    k = base + k_off;
    v = base + v_off;
    out = base + o_off;
    lse = reinterpret_cast<float*>(base + l_off);
  }
  // The chunk's rows merge into out / lse in the kernel's epilogue (AttnParams::merge_out).
  launch_mla_mha(layer, mha_plan_.chunks[chunk], true, q, q_tok, q_head, k, k_tok, v, v_tok, out,
                 o_tok, o_head, lse, lse_tok, n, fp16);
  if (!dev) {
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(args.out.data, base + o_off, ob, cudaMemcpyDeviceToHost, stream_));
    ATTNRT_CUDA_CHECK(
        cudaMemcpyAsync(args.lse.data, base + l_off, lb, cudaMemcpyDeviceToHost, stream_));
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
  mha_.chunk_done(chunk);
}

void CudaBackend::gather_prefix_chunk(int chunk, const KVLayerView& kv, int layer_id,
                                      const TensorView& latent) {
  const bool pool_dev = kv.device.kind == DeviceKind::cuda, out_dev = on_gpu(latent);
  if (!pool_dev && !out_dev) {
    AttentionBackend::gather_prefix_chunk(chunk, kv, layer_id, latent);
    return;
  }
  ATTNRT_CHECK(pool_dev,
               "gather_prefix_chunk: layer {}'s latent pool is on the host but latent is {}; "
               "gather into a host tensor (or build the cache on the GPU)",
               layer_id, latent.describe());
  ATTNRT_CHECK(kv.k != nullptr && kv.v == kv.k && kv.kv_heads == 1,
               "gather_prefix_chunk: layer {} is not an MLA latent pool (one kv head, V a view of "
               "the K row)",
               layer_id);
  const int64_t n = mha_.chunks().chunks[chunk].num_tokens;
  ATTNRT_CHECK(is_float(latent.dtype) && !is_fp8(latent.dtype) && latent.ndim == 3 &&
                   latent.shape[0] == n && latent.shape[1] == 1 &&
                   latent.shape[2] == kv.head_dim && latent.strides[2] == 1,
               "gather_prefix_chunk: latent is {}; expected a float (fp32 / fp16 / bf16) [{}, 1, "
               "{}] with contiguous rows (chunk tokens, 1, kv_lora_rank + qk_rope_head_dim)",
               latent.describe(), n, kv.head_dim);
  upload_mha_plan();
  const size_t bytes = static_cast<size_t>(n) * kv.head_dim * dtype_size(latent.dtype);
  void* dst = latent.data;
  int64_t stride = latent.strides[0];
  if (!out_dev) {
    ATTNRT_CHECK(latent.is_contiguous(), "gather_prefix_chunk: host latent {} must be contiguous",
                 latent.describe());
    ensure(mha_scratch_, bytes + 16, "gathered latent rows");
    dst = mha_scratch_.data();
    stride = kv.head_dim;
  }
  GatherRowsParams g{};
  g.src = kv.k;
  g.src_row_stride = kv.k_row_stride;
  g.src_dtype = static_cast<int32_t>(kv.dtype);
  g.slots = reinterpret_cast<const int64_t*>(mha_meta_.ptr<char>() + mha_plan_.slots_off[chunk]);
  g.slot_map = kv.slot_map;
  g.slot_map_rows = kv.slot_map_rows;
  g.out = dst;
  g.out_stride = stride;
  g.out_dtype = static_cast<int32_t>(latent.dtype);
  g.count = n;
  g.dim = kv.head_dim;
  g.scale = kv.k_scale;
  ATTNRT_CUDA_CHECK(launch_gather_rows(g, stream_));
  if (!out_dev) {
    ATTNRT_CUDA_CHECK(cudaMemcpyAsync(latent.data, dst, bytes, cudaMemcpyDeviceToHost, stream_));
    ATTNRT_CUDA_CHECK(cudaStreamSynchronize(stream_));
  }
}

}  // namespace attnrt::cuda
