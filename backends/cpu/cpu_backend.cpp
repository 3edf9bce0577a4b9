#include "backends/cpu/cpu_backend.h"
#include "backends/cpu/linear_backend.h"

#include <omp.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <string>

#include "attnrt/backend/host_attn_checks.h"
#include "attnrt/backend/host_backend_entry.h"
#include "attnrt/backend/options.h"
#include "attnrt/backend/selection.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "backends/cpu/kernels/attention_kernels.h"

namespace attnrt {

namespace {

// Positions travel through the kernels as fp32, exact below 2^24.
constexpr int64_t kMaxKeysPerRequest = int64_t{1} << 24;
// A key split never makes pieces shorter than this: below it the merge costs more than it saves.
constexpr int32_t kMinSplitKeys = 256;
// Pieces start on multiples of this, so that every kernel block of a piece is full.
constexpr int32_t kSplitAlign = 64;
// Deterministic mode: keys split at fixed absolute boundaries, whatever the batch and the thread
// count, so a request's result does not depend on its neighbours.
constexpr int32_t kDeterministicSplitKeys = 2048;
// q heads per kv head from which single queries run as tiles of heads too.
constexpr int kWideGroup = 16;
// Multiply-adds a thread must get before another one is woken for a call: about a tenth of a
// millisecond of one core. Below it the fork and join cost more than they save, and on a shared
// machine idle-spinning threads steal the cores others need.
constexpr int64_t kMinMacsPerThread = int64_t{1} << 21;

int v_dim_of(const LayerSpec& layer) {
  return layer.v_head_dim > 0 ? layer.v_head_dim : layer.head_dim;
}

// q / out / lse of a call as the kernels read them.
void set_io(cpu::LayerArgs& a, const TensorView& q, const TensorView& out, const TensorView& lse) {
  a.q = q.data;
  a.q_dtype = q.dtype;
  std::copy_n(q.strides.data(), 3, a.q_stride);
  a.out = out.data;
  a.out_dtype = out.dtype;
  std::copy_n(out.strides.data(), 3, a.out_stride);
  if (!lse.empty()) {
    a.lse = lse.ptr<float>();
    a.lse_stride[0] = lse.strides[0];
    a.lse_stride[1] = lse.strides[1];
  }
}

}  // namespace

int cpu_num_threads(const Options* options) {
  return host_num_threads(options, "cpu backend", omp_get_num_procs());
}

int cpu_threads_for(int64_t macs, int max_threads) {
  return host_threads_for(macs, kMinMacsPerThread, max_threads);
}

std::string cpu_simd_target() { return cpu::simd_target_name(); }

// The tile heights are the first dispatch of a backend: ATTNRT_CPU_SIMD is applied before.
static int chosen_tile_rows() {
  cpu::choose_simd_target();
  return cpu::tile_rows();
}

CpuBackend::CpuBackend(const BackendContext& ctx)
    : OnePathAttnBackend(ctx),
      num_threads_(cpu_num_threads(ctx.options)),
      tile_rows_(chosen_tile_rows()),
      wide_tile_rows_(cpu::wide_tile_rows()) {}

void CpuBackend::init_forward_metadata(const ForwardBatch& batch) {
  planned_ = false;
  const StepLayout layout = make_step_layout(batch);
  const int bs = batch.batch_size;
  reqs_.assign(bs, cpu::RequestInfo{});
  slots_.clear();
  tree_depth_.clear();
  tree_mask_.clear();
  tree_words_ = 0;
  variants_.clear();

  // Verify blocks whose parents are not a plain chain get an ancestor-or-self mask; a chain is
  // ordinary causal attention and runs unmasked.
  bool tree = false;
  int n_draft = 0;
  if (is_target_verify(batch.mode) && batch.spec_info.has_value()) {
    const SpecInfo& spec = *batch.spec_info;
    n_draft = spec.draft_token_num;
    for (size_t k = 0; k < spec.parents.size() && !tree; ++k) {
      tree = spec.parents[k] != static_cast<int32_t>(k % n_draft) - 1;
    }
    if (tree) {
      tree_words_ = (n_draft + 63) / 64;
      tree_depth_.assign(static_cast<size_t>(bs) * n_draft, 0);
      tree_mask_.assign(static_cast<size_t>(bs) * n_draft * tree_words_, 0);
      for (int i = 0; i < bs; ++i) {
        const int32_t* parents = spec.parents.data() + static_cast<size_t>(i) * n_draft;
        for (int t = 0; t < n_draft; ++t) {
          const size_t node = static_cast<size_t>(i) * n_draft + t;
          uint64_t* bits = tree_mask_.data() + node * tree_words_;
          if (parents[t] >= 0) {
            const size_t parent = static_cast<size_t>(i) * n_draft + parents[t];
            tree_depth_[node] = tree_depth_[parent] + 1;
            std::copy_n(tree_mask_.data() + parent * tree_words_, tree_words_, bits);
          }
          bits[t / 64] |= uint64_t{1} << (t % 64);
        }
      }
    }
  }

  int64_t total_keys = 0;
  for (int i = 0; i < bs; ++i) total_keys += layout.kv_len(i);
  slots_.resize(total_keys);
  int64_t offset = 0;
  for (int i = 0; i < bs; ++i) {
    const int32_t kv_len = layout.kv_len(i), prefix = layout.prefix_lens[i];
    const int32_t* row_slots =
        checked_request_row("cpu", ctx_, batch, layout, i, kMaxKeysPerRequest - 1);
    std::copy_n(row_slots, kv_len, slots_.data() + offset);
    cpu::RequestInfo& r = reqs_[i];
    r.q_row = layout.query_start[i];
    r.slot_offset = offset;
    r.prefix = prefix;
    r.qlen = layout.query_lens[i];
    r.kv_len = kv_len;
    r.tree = tree ? i * n_draft : -1;
    offset += kv_len;
  }
  mode_ = batch.mode;
  num_tokens_ = layout.num_tokens;
  plan_mha(batch, layout);
  planned_ = true;

  // Work lists for every layer shape of the model, so that forward never plans.
  if (ctx_.model != nullptr && ctx_.kv_cache != nullptr && bs > 0) {
    int64_t partial = 0;
    for (const LayerSpec& layer : ctx_.model->layers) {
      if (!layer.uses_kv_cache()) continue;
      if (!layer.causal() && layer.sliding_window >= 0) continue;  // rejected at forward
      if (layer.has_indexer()) continue;  // DSA: a work list per call, over the selected keys
      const KVLayerView kv = ctx_.kv_cache->layer(layer.layer_id);
      const VariantKey key = key_of(layer, kv);
      if (find_variant(key) != nullptr) continue;
      variants_.push_back(build_variant(key, kv, layer.layer_id));
      partial = std::max(partial, variants_.back().partial_floats);
    }
    if (static_cast<int64_t>(partial_.size()) < partial) partial_.resize(partial);
  }
}

CpuBackend::VariantKey CpuBackend::key_of(const LayerSpec& layer, const KVLayerView& kv) {
  VariantKey key;
  key.window = layer.sliding_window;
  key.causal = layer.causal();
  key.q_heads = layer.num_q_heads;
  key.kv_heads = layer.num_kv_heads;
  key.v_dim = v_dim_of(layer);
  key.slot_map = kv.slot_map;
  return key;
}

const CpuBackend::Variant* CpuBackend::find_variant(const VariantKey& key) const {
  for (const Variant& v : variants_) {
    if (v.key == key) return &v;
  }
  return nullptr;
}

CpuBackend::Variant CpuBackend::build_variant(const VariantKey& key, const KVLayerView& kv,
                                              int layer_id) const {
  return build_variant(key, kv, layer_id, reqs_, slots_);
}

CpuBackend::Variant CpuBackend::build_variant(const VariantKey& key, const KVLayerView& kv,
                                              int layer_id,
                                              const std::vector<cpu::RequestInfo>& reqs,
                                              const std::vector<int32_t>& slots) const {
  Variant var;
  var.key = key;
  const int group = key.q_heads / key.kv_heads;
  const int bs = static_cast<int>(reqs.size());

  // Key slots in this layer's pool, range-checked before anything is stored so that a bad request
  // row leaves the pool untouched.
  if (key.slot_map != nullptr) var.slots.resize(slots.size());
  for (size_t k = 0; k < slots.size(); ++k) {
    const int64_t full = slots[k];
    ATTNRT_CHECK(full >= 0 && (key.slot_map != nullptr || full < kv.num_rows),
                 "cpu backend: a request row holds slot {}; layer {} KV rows are [0, {})", full,
                 layer_id, kv.num_rows);
    if (key.slot_map == nullptr) continue;
    const int64_t s = key.slot_map[full];
    ATTNRT_CHECK(s >= 0 && s < kv.num_rows,
                 "cpu backend: full slot {} maps to slot {} of layer {}; rows are [0, {})", full, s,
                 layer_id, kv.num_rows);
    var.slots[k] = static_cast<int32_t>(s);
  }

  auto query_pos = [&](const cpu::RequestInfo& r, int t) {
    return r.prefix + (r.tree >= 0 && key.causal ? tree_depth_[r.tree + t] : t);
  };

  // cost: work of one task; tasks: how many the item makes (single-query items run every kv head
  // in one task, multi-query items one task per kv head).
  struct Pending {
    cpu::WorkItem item;
    int64_t cost;
    int tasks;
  };
  std::vector<Pending> pending;
  for (int i = 0; i < bs; ++i) {
    const cpu::RequestInfo& r = reqs[i];
    if (r.qlen == 0) continue;
    // Many q heads per kv head (MLA: 16 or 128 on one latent head): tiles of heads even for a
    // single query, so that every K row loaded serves a whole tile of rows.
    const bool wide = group >= kWideGroup;
    const int rows = wide ? wide_tile_rows_ : tile_rows_;
    int tokens_per_item = 1, heads_per_item = group;
    if (r.qlen > 1 || wide) {
      if (group >= rows) {
        heads_per_item = rows;
      } else {
        tokens_per_item = rows / group;
      }
    }
    for (int t0 = 0; t0 < r.qlen; t0 += tokens_per_item) {
      const int t1 = std::min(r.qlen, t0 + tokens_per_item);
      int k0 = 0, k1 = r.kv_len;
      if (key.causal) {
        int min_pos = query_pos(r, t0);
        for (int t = t0 + 1; t < t1; ++t) min_pos = std::min(min_pos, query_pos(r, t));
        k1 = r.prefix + t1;  // drafts come after their ancestors, so none beyond t1 is visible
        if (key.window >= 0) k0 = std::max(0, min_pos - key.window);
        // An SWA pool must still hold every key some query of this item can see.
        if (!var.slots.empty()) {
          for (int j = k0; j < k1; ++j) {
            const int32_t s = var.slots[r.slot_offset + j];
            const bool draft = r.tree >= 0 && j >= r.prefix;
            ATTNRT_CHECK(s != 0 || draft,
                         "cpu backend: layer {} request {} key {} (full slot {}) is inside the "
                         "window of query {} but has no slot in the SWA pool",
                         layer_id, i, j, slots[r.slot_offset + j], t0);
          }
        }
      }
      for (int g0 = 0; g0 < group; g0 += heads_per_item) {
        const int g1 = std::min(group, g0 + heads_per_item);
        cpu::WorkItem it{.req = i, .t0 = t0, .t1 = t1, .g0 = g0, .g1 = g1, .k0 = k0, .k1 = k1};
        const int64_t cost = static_cast<int64_t>(t1 - t0) * (g1 - g0) * (k1 - k0);
        it.tile = !(t1 - t0 == 1 && (r.tree < 0 || !key.causal || r.qlen == 1)) || wide;
        pending.push_back({it, it.tile ? cost : cost * key.kv_heads, it.tile ? key.kv_heads : 1});
      }
    }
  }
  // Longest first: dynamic scheduling then ends with short items, whatever the lengths.
  std::stable_sort(pending.begin(), pending.end(),
                   [](const Pending& a, const Pending& b) { return a.cost > b.cost; });

  int64_t total = 0;
  for (const Pending& p : pending) total += p.cost * p.tasks;
  const bool deterministic = ctx_.options != nullptr && ctx_.options->deterministic;
  // Only as many threads as the work keeps busy (small decode batches run on one).
  var.threads = cpu_threads_for(total * (kv.head_dim + key.v_dim), num_threads_);
  // A task longer than a quarter of a thread's share is split over its keys so that a few long
  // requests (or one) still occupy every thread.
  const int64_t target = std::max<int64_t>(1, total / (4 * int64_t{var.threads}));
  for (const Pending& p : pending) {
    const cpu::WorkItem& it = p.item;
    std::vector<int32_t> cuts = {it.k0};
    if (deterministic) {
      for (int32_t b = (it.k0 / kDeterministicSplitKeys + 1) * kDeterministicSplitKeys; b < it.k1;
           b += kDeterministicSplitKeys) {
        cuts.push_back(b);
      }
    } else if (var.threads > 1) {
      const int32_t keys = it.k1 - it.k0;
      const int64_t by_work = (p.cost + target - 1) / target;
      const int64_t pieces = std::min<int64_t>(by_work, keys / kMinSplitKeys);
      if (pieces > 1) {
        const int32_t step = static_cast<int32_t>(
            (keys / pieces + kSplitAlign - 1) / kSplitAlign * kSplitAlign);
        for (int32_t b = it.k0 + step; b < it.k1; b += step) cuts.push_back(b);
      }
    }
    cuts.push_back(it.k1);
    const int npieces = static_cast<int>(cuts.size()) - 1;
    if (npieces == 1) {
      var.items.push_back(it);
      continue;
    }
    const int64_t rows = static_cast<int64_t>(it.t1 - it.t0) * (it.g1 - it.g0);
    var.merges.push_back({static_cast<int32_t>(var.items.size()), npieces});
    for (int s = 0; s < npieces; ++s) {
      cpu::WorkItem piece = it;
      piece.k0 = cuts[s];
      piece.k1 = cuts[s + 1];
      piece.part = var.partial_floats;
      var.partial_floats += key.kv_heads * rows * (key.v_dim + 2);
      var.items.push_back(piece);
    }
  }
  return var;
}

CpuBackend::WorkSummary CpuBackend::work_summary(const LayerSpec& layer) const {
  ATTNRT_CHECK(planned_ && ctx_.kv_cache != nullptr,
               "cpu backend: no plan; call init_forward_metadata first");
  const Variant* var = find_variant(key_of(layer, ctx_.kv_cache->layer(layer.layer_id)));
  ATTNRT_CHECK(var != nullptr, "cpu backend: layer {} has no work list in this step's plan",
               layer.layer_id);
  WorkSummary s;
  s.items = static_cast<int64_t>(var->items.size());
  s.merges = static_cast<int64_t>(var->merges.size());
  s.threads = var->threads;
  for (const cpu::WorkItem& it : var->items) s.single_query += it.tile ? 0 : 1;
  return s;
}

void CpuBackend::attend(const AttnArgs& args, const LayerSpec& layer, const ForwardBatch& batch) {
  const bool planned = planned_for(batch);
  const KVLayerView kv = check_host_attn_call("cpu", ctx_, planned, args, layer, batch);
  if (reqs_.empty()) return;

  cpu::LayerArgs a;
  set_io(a, args.q, args.out, args.lse);
  a.sinks = args.sinks;
  a.k_cache = kv.k;
  a.v_cache = kv.v;
  a.kv_dtype = kv.dtype;
  a.k_row_stride = kv.k_row_stride;
  a.v_row_stride = kv.v_row_stride;
  a.num_q_heads = layer.num_q_heads;
  a.num_kv_heads = layer.num_kv_heads;
  a.head_dim = layer.head_dim;
  a.v_head_dim = v_dim_of(layer);
  const float scale =
      layer.scaling > 0.f ? layer.scaling : 1.f / std::sqrt(static_cast<float>(layer.head_dim));
  a.qk_scale = scale * kv.k_scale;
  a.v_scale = kv.v_scale;
  a.softcap = layer.logit_cap;
  a.window = layer.sliding_window;
  a.causal = layer.causal();
  if (layer.has_indexer()) {
    attend_dsa(args, layer, kv, a);
    return;
  }

  const VariantKey key = key_of(layer, kv);
  const Variant* var = find_variant(key);
  if (var == nullptr) {
    // A layer outside ctx.model (or a model given no KV cache at plan time): planned once, then
    // shared by the step's later layers of the same shape.
    variants_.push_back(build_variant(key, kv, layer.layer_id));
    var = &variants_.back();
  }
  if (args.save_kv && !args.k.empty()) {
    ctx_.kv_cache->store_step_kv(layer.layer_id, args.k, args.v);
  }
  run_variant(a, *var, reqs_, var->slots.empty() ? slots_ : var->slots, kv.slot_map != nullptr);
}

void CpuBackend::attend_dsa(const AttnArgs& args, const LayerSpec& layer, const KVLayerView& kv,
                            cpu::LayerArgs& a) {
  // Every key slot the selection may name, range-checked before anything is stored.
  for (int32_t s : slots_) {
    ATTNRT_CHECK(s >= 0 && s < kv.num_rows,
                 "cpu backend: a request row holds slot {}; layer {} KV rows are [0, {})", s,
                 layer.layer_id, kv.num_rows);
  }
  if (args.save_kv && !args.k.empty()) {
    ctx_.kv_cache->store_step_kv(layer.layer_id, args.k, args.v);
    ctx_.kv_cache->store_step_index_k(layer.layer_id, args.indexer.k);
  }
  const cpu::DsaStep step{.reqs = &reqs_,
                          .slots = &slots_,
                          .tree_mask = tree_mask_.data(),
                          .tree_words = tree_words_,
                          .num_threads = num_threads_};
  cpu::select_dsa_keys(step, layer, args.indexer, ctx_.kv_cache->index_keys(layer.layer_id), dsa_);
  // Each token is a request of one query over its selected keys, all visible (causal, the query
  // at the last position).
  VariantKey key = key_of(layer, kv);
  const Variant var = build_variant(key, kv, layer.layer_id, dsa_.reqs, dsa_.slots);
  run_variant(a, var, dsa_.reqs, dsa_.slots, false);
}

void CpuBackend::run_variant(const cpu::LayerArgs& a, const Variant& var,
                             const std::vector<cpu::RequestInfo>& reqs,
                             const std::vector<int32_t>& slots, bool zero_slot_is_absent) {
  if (static_cast<int64_t>(partial_.size()) < var.partial_floats) {
    partial_.resize(var.partial_floats);
  }
  cpu::KernelPlan p;
  p.reqs = reqs.data();
  p.slots = slots.data();
  p.items = var.items.data();
  p.num_items = static_cast<int64_t>(var.items.size());
  p.merges = var.merges.data();
  p.num_merges = static_cast<int64_t>(var.merges.size());
  p.tree_depth = tree_depth_.data();
  p.tree_mask = tree_mask_.data();
  p.tree_words = tree_words_;
  p.zero_slot_is_absent = zero_slot_is_absent;
  p.partial = partial_.data();
  p.num_threads = var.threads;
  cpu::run_attention(a, p);
}

// ------------------------------------------------------------------------------------------------
// MLA in the MHA form (docs/mla.md): the same kernels over the call's own k / v rows (identity
// slots), causal within each request for the causal part, unmasked for a prefix chunk, whose
// result is merged into out / lse by log-sum-exp.

bool CpuBackend::planned_for(const ForwardBatch& batch) const {
  return planned_ && mode_ == batch.mode && static_cast<int>(reqs_.size()) == batch.batch_size &&
         num_tokens_ == batch.num_tokens();
}

void CpuBackend::plan_mha(const ForwardBatch& batch, const StepLayout& layout) {
  mha_causal_ = {};
  mha_chunks_.clear();
  mha_.plan("cpu", ctx_, batch, layout);
  if (mha_.form() != MlaForm::mha) return;
  const int bs = batch.batch_size;
  auto identity = [](std::vector<int32_t>& slots, int64_t n) {
    slots.resize(n);
    for (int64_t j = 0; j < n; ++j) slots[j] = static_cast<int32_t>(j);
  };
  mha_causal_.reqs.resize(bs);
  for (int i = 0; i < bs; ++i) {
    mha_causal_.reqs[i] = {.q_row = layout.query_start[i],
                           .slot_offset = layout.query_start[i],
                           .qlen = layout.query_lens[i],
                           .kv_len = layout.query_lens[i]};
  }
  identity(mha_causal_.slots, layout.num_tokens);
  for (const PrefixChunk& c : mha_.chunks().chunks) {
    MhaPart& part = mha_chunks_.emplace_back();
    part.reqs.resize(bs);
    for (int i = 0; i < bs; ++i) {
      // A request whose prefix ended before this chunk has no item in it.
      part.reqs[i] = {.q_row = layout.query_start[i],
                      .slot_offset = c.cu_seqlens[i],
                      .qlen = c.lens[i] > 0 ? layout.query_lens[i] : 0,
                      .kv_len = c.lens[i]};
    }
    identity(part.slots, c.num_tokens);
  }
  if (ctx_.model == nullptr) return;
  for (const LayerSpec& layer : ctx_.model->layers) {
    if (!layer.has_mha_form()) continue;
    mha_variant(mha_causal_, layer, true);
    for (MhaPart& part : mha_chunks_) mha_variant(part, layer, false);
  }
}

const CpuBackend::Variant& CpuBackend::mha_variant(MhaPart& part, const LayerSpec& layer,
                                                   bool causal) const {
  VariantKey key;
  key.causal = causal;
  key.q_heads = layer.num_q_heads;
  key.kv_heads = layer.num_q_heads;
  key.v_dim = layer.mha_v_head_dim;
  for (const Variant& v : part.variants) {
    if (v.key == key) return v;
  }
  KVLayerView rows;
  rows.num_rows = static_cast<int64_t>(part.slots.size());
  return part.variants.emplace_back(build_variant(key, rows, layer.layer_id, part.reqs, part.slots));
}

void CpuBackend::run_mha(MhaPart& part, const LayerSpec& layer, bool causal, const TensorView& q,
                         const TensorView& k, const TensorView& v, const TensorView& out,
                         const TensorView& lse) {
  const MlaMhaDims d = mla_mha_dims(layer);
  // The kernels read K / V rows of [heads, dim] contiguous in one dtype; other layouts are copied
  // to fp32 first.
  auto fits = [](const TensorView& t, int dim) { return t.strides[2] == 1 && t.strides[1] == dim; };
  TensorView kk = k, vv = v;
  if (k.dtype != v.dtype || !fits(k, d.qk) || !fits(v, d.v)) {
    kv_f32_.resize(static_cast<size_t>(k.numel() + v.numel()));
    float* kp = kv_f32_.data();
    float* vp = kp + k.numel();
    for (int64_t j = 0; j < k.shape[0]; ++j) {
      for (int64_t h = 0; h < k.shape[1]; ++h) {
        for (int e = 0; e < d.qk; ++e) {
          *kp++ = load_as_float(k.data, k.dtype, j * k.strides[0] + h * k.strides[1] + e * k.strides[2]);
        }
        for (int e = 0; e < d.v; ++e) {
          *vp++ = load_as_float(v.data, v.dtype, j * v.strides[0] + h * v.strides[1] + e * v.strides[2]);
        }
      }
    }
    kk = TensorView(kv_f32_.data(), DType::f32, {k.shape[0], k.shape[1], k.shape[2]});
    vv = TensorView(kv_f32_.data() + k.numel(), DType::f32, {v.shape[0], v.shape[1], v.shape[2]});
  }
  cpu::LayerArgs a;
  set_io(a, q, out, lse);
  a.k_cache = kk.data;
  a.v_cache = vv.data;
  a.kv_dtype = kk.dtype;
  a.k_row_stride = kk.strides[0];
  a.v_row_stride = vv.strides[0];
  a.num_q_heads = layer.num_q_heads;
  a.num_kv_heads = layer.num_q_heads;
  a.head_dim = d.qk;
  a.v_head_dim = d.v;
  a.qk_scale = layer.softmax_scale();
  a.softcap = layer.logit_cap;
  a.causal = causal;
  run_variant(a, mha_variant(part, layer, causal), part.reqs, part.slots, false);
}

void CpuBackend::forward_mla_mha(const MlaMhaArgs& args, const LayerSpec& layer,
                                 const ForwardBatch& batch) {
  mha_.check_causal("cpu", ctx_, planned_for(batch), args, layer, batch);
  if (args.save_kv) ctx_.kv_cache->store_step_kv(layer.layer_id, args.latent, TensorView());
  if (!reqs_.empty()) run_mha(mha_causal_, layer, true, args.q, args.k, args.v, args.out, args.lse);
  mha_.causal_done(layer.layer_id);
}

void CpuBackend::forward_mla_prefix_chunk(int chunk, const MlaChunkArgs& args,
                                          const LayerSpec& layer, const ForwardBatch& batch) {
  mha_.check_chunk("cpu", planned_for(batch), chunk, args, layer, batch);
  const int64_t T = num_tokens_;
  const int hq = layer.num_q_heads, dv = layer.mha_v_head_dim;
  const DType odt = args.out.dtype;
  chunk_out_.resize(static_cast<size_t>(T) * hq * dv * dtype_size(odt));
  chunk_lse_.resize(static_cast<size_t>(T) * hq);
  const TensorView out(chunk_out_.data(), odt, {T, hq, dv});
  const TensorView lse(chunk_lse_.data(), DType::f32, {T, hq});
  run_mha(mha_chunks_[chunk], layer, false, args.q, args.k, args.v, out, lse);

  // (o, lse) <- merge((o, lse), (o_chunk, lse_chunk)) on the rows of requests the chunk has keys of.
  const PrefixChunk& c = mha_.chunks().chunks[chunk];
  const std::vector<cpu::RequestInfo>& reqs = mha_causal_.reqs;
  const TensorView& ro = args.out;
  float* rl = args.lse.ptr<float>();
#pragma omp parallel for schedule(static) num_threads(num_threads_)
  for (int64_t row = 0; row < T * hq; ++row) {
    const int64_t t = row / hq;
    const int h = static_cast<int>(row % hq);
    const auto req = std::upper_bound(reqs.begin(), reqs.end(), t,
                                      [](int64_t x, const cpu::RequestInfo& r) { return x < r.q_row; }) - 1;
    if (c.lens[req - reqs.begin()] == 0) continue;
    float& a = rl[t * args.lse.strides[0] + h * args.lse.strides[1]];
    const float b = chunk_lse_[row];
    const float m = std::max(a, b);
    const float wa = std::exp(a - m), wb = std::exp(b - m), inv = 1.f / (wa + wb);
    for (int e = 0; e < dv; ++e) {
      const size_t at = t * ro.strides[0] + h * ro.strides[1] + e * ro.strides[2];
      const float oa = load_as_float(ro.data, odt, at);
      const float ob = load_as_float(out.data, odt, static_cast<size_t>(row) * dv + e);
      store_from_float(ro.data, odt, at, (wa * oa + wb * ob) * inv);
    }
    a = m + std::log(wa + wb);
  }
  mha_.chunk_done(chunk);
}

BackendEntry cpu_backend_entry() {
  return host_backend_entry<CpuBackend, CpuLinearBackend>(
      "cpu",
      "SIMD (Highway, " + cpu_simd_target() +
          ") + OpenMP attention for every full-attention mode and the gdn / kda / mamba2 "
          "layers; the default without a GPU",
      /*auto_selectable=*/true);
}

void register_cpu_backend(Registry& registry) { registry.add(cpu_backend_entry()); }

}  // namespace attnrt
