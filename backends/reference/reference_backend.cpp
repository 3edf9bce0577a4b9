#include "backends/reference/reference_backend.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "attnrt/backend/host_attn_checks.h"
#include "attnrt/backend/host_backend_entry.h"
#include "attnrt/core/error.h"
#include "attnrt/memory/kv_cache.h"
#include "backends/reference/linear_backend.h"

namespace attnrt {

namespace {

int64_t offset3(const TensorView& t, int64_t a, int64_t b, int64_t c) {
  return a * t.strides[0] + b * t.strides[1] + c * t.strides[2];
}

}  // namespace

ReferenceBackend::ReferenceBackend(const BackendContext& ctx) : OnePathAttnBackend(ctx) {}

void ReferenceBackend::init_forward_metadata(const ForwardBatch& batch) {
  Plan plan;
  plan.layout = make_step_layout(batch);
  plan.mode = batch.mode;
  const StepLayout& l = plan.layout;
  const int bs = batch.batch_size;
  plan.key_start.assign(bs + 1, 0);
  for (int i = 0; i < bs; ++i) plan.key_start[i + 1] = plan.key_start[i] + l.kv_len(i);
  plan.key_slots.resize(plan.key_start[bs]);
  plan.key_pos.resize(plan.key_start[bs]);
  plan.query_pos.resize(l.num_tokens);
  plan.query_block.resize(l.num_tokens);
  const bool verify = is_target_verify(batch.mode);
  for (int i = 0; i < bs; ++i) {
    const int32_t* slots = checked_request_row("reference", ctx_, batch, l, i);
    const int32_t prefix = l.prefix_lens[i];
    for (int32_t j = 0; j < l.kv_len(i); ++j) {
      const int64_t k = plan.key_start[i] + j;
      plan.key_slots[k] = slots[j];
      plan.key_pos[k] = (verify && j >= prefix) ? prefix + batch.spec_info->depth(i, j - prefix) : j;
    }
    for (int32_t t = 0; t < l.query_lens[i]; ++t) {
      const int64_t q = l.query_start[i] + t;
      plan.query_pos[q] = plan.key_pos[plan.key_start[i] + prefix + t];
      plan.query_block[q] = t;
    }
  }
  plan_ = std::move(plan);
  planned_ = true;
}

void ReferenceBackend::set_sample(std::vector<int64_t> tokens, std::vector<int> heads) {
  std::sort(tokens.begin(), tokens.end());
  tokens.erase(std::unique(tokens.begin(), tokens.end()), tokens.end());
  sample_tokens_ = std::move(tokens);
  sample_heads_ = std::move(heads);
}

void ReferenceBackend::attend(const AttnArgs& args, const LayerSpec& layer,
                              const ForwardBatch& batch) {
  const bool planned = planned_ && plan_.mode == batch.mode &&
                       static_cast<int>(plan_.layout.query_lens.size()) == batch.batch_size &&
                       plan_.layout.num_tokens == batch.num_tokens();
  const KVLayerView kv = check_host_attn_call("reference", ctx_, planned, args, layer, batch);

  const StepLayout& l = plan_.layout;
  const int bs = batch.batch_size;
  const int hq = layer.num_q_heads, hkv = layer.num_kv_heads, group = hq / hkv;
  const int dqk = layer.head_dim, dv = layer.v_head_dim > 0 ? layer.v_head_dim : layer.head_dim;

  // Every key this layer reads, in this layer's slot space; range-checked before anything is
  // stored so that a bad row leaves the pool untouched.
  std::vector<int64_t> slots(plan_.key_slots.size());
  for (size_t k = 0; k < slots.size(); ++k) {
    const int64_t full = plan_.key_slots[k];
    const int64_t full_rows = kv.slot_map ? kv.slot_map_rows : kv.num_rows;
    ATTNRT_CHECK(full >= 0 && full < full_rows,
                 "reference backend: a request row holds slot {}; layer {} reads full-pool slots "
                 "[0, {})",
                 full, layer.layer_id, full_rows);
    const int64_t s = kv.pool_slot(full);
    ATTNRT_CHECK(s >= 0 && s < kv.num_rows,
                 "reference backend: full slot {} maps to slot {} of layer {}; rows are [0, {})",
                 full, s, layer.layer_id, kv.num_rows);
    slots[k] = s;
  }

  if (args.save_kv && !args.k.empty()) {
    ctx_.kv_cache->store_step_kv(layer.layer_id, args.k, args.v);
  }

  const double scale = layer.scaling > 0.f ? double{layer.scaling} : 1.0 / std::sqrt(static_cast<double>(dqk));
  const double qk_scale = scale * kv.k_scale;
  const double cap = layer.logit_cap;
  const int64_t window = layer.sliding_window;
  const bool causal = layer.causal();
  const bool tree = is_target_verify(batch.mode);

  std::vector<int> heads = sample_heads_;
  if (heads.empty()) {
    heads.resize(hq);
    for (int h = 0; h < hq; ++h) heads[h] = h;
  }
  for (int h : heads) {
    ATTNRT_CHECK(h >= 0 && h < hq, "reference backend: sampled head {}; layer {} has {} q heads", h,
                 layer.layer_id, hq);
  }

  std::vector<double> kbuf, vbuf;
  std::vector<int32_t> rows;  // the request's query rows to compute
  for (int i = 0; i < bs; ++i) {
    rows.clear();
    if (sample_tokens_.empty()) {
      for (int32_t t = 0; t < l.query_lens[i]; ++t) rows.push_back(t);
    } else {
      const int64_t first = l.query_start[i], end = first + l.query_lens[i];
      for (auto it = std::lower_bound(sample_tokens_.begin(), sample_tokens_.end(), first);
           it != sample_tokens_.end() && *it < end; ++it) {
        rows.push_back(static_cast<int32_t>(*it - first));
      }
    }
    if (rows.empty()) continue;
    const int64_t k0 = plan_.key_start[i];
    const int32_t nkeys = l.kv_len(i), prefix = l.prefix_lens[i];
    const int32_t* parents =
        tree ? batch.spec_info->parents.data() + static_cast<size_t>(i) * l.query_lens[i] : nullptr;

    // Which keys each query row sees: the mode's mask, then the window on positions (§8.4, §8.5).
    auto visible_keys = [&](int32_t t, std::vector<uint8_t>& vis) {
      vis.assign(nkeys, 0);
      if (!causal) {
        std::fill(vis.begin(), vis.end(), uint8_t{1});
      } else if (tree) {
        std::fill(vis.begin(), vis.begin() + prefix, uint8_t{1});
        for (int32_t a = t; a >= 0; a = parents[a]) vis[prefix + a] = 1;
      } else {
        std::fill(vis.begin(), vis.begin() + prefix + t + 1, uint8_t{1});
      }
      if (window >= 0) {
        const int64_t qpos = plan_.query_pos[l.query_start[i] + t];
        for (int32_t j = 0; j < nkeys; ++j) {
          const int64_t d = qpos - plan_.key_pos[k0 + j];
          if (d < 0 || d > window) vis[j] = 0;
        }
      }
    };

    // An SWA pool drops keys that left every window (mapped to slot 0); reading one would be a
    // scheduling bug, so it is reported rather than silently attended.
    if (kv.slot_map != nullptr) {
      std::vector<uint8_t> vis;
      for (int32_t t = 0; t < l.query_lens[i]; ++t) {
        visible_keys(t, vis);
        for (int32_t j = 0; j < nkeys; ++j) {
          ATTNRT_CHECK(!vis[j] || slots[k0 + j] != 0,
                       "reference backend: layer {} request {} key {} (full slot {}) is inside the "
                       "window of query {} but has no slot in the SWA pool",
                       layer.layer_id, i, j, plan_.key_slots[k0 + j], t);
        }
      }
    }

    kbuf.resize(static_cast<size_t>(nkeys) * hkv * dqk);
    vbuf.resize(static_cast<size_t>(nkeys) * hkv * dv);
#pragma omp parallel for schedule(static)
    for (int32_t j = 0; j < nkeys; ++j) {
      const int64_t s = slots[k0 + j];
      for (int g = 0; g < hkv; ++g) {
        for (int d = 0; d < dqk; ++d) {
          kbuf[(static_cast<size_t>(j) * hkv + g) * dqk + d] =
              load_as_float(kv.k, kv.dtype, s * kv.k_row_stride + g * dqk + d);
        }
        for (int d = 0; d < dv; ++d) {
          vbuf[(static_cast<size_t>(j) * hkv + g) * dv + d] =
              load_as_float(kv.v, kv.dtype, s * kv.v_row_stride + g * dv + d);
        }
      }
    }

    // One task per (row, head): a decode request has a single row.
    const auto nh = static_cast<int64_t>(heads.size());
    const int64_t tasks = static_cast<int64_t>(rows.size()) * nh;
#pragma omp parallel for schedule(dynamic)
    for (int64_t task = 0; task < tasks; ++task) {
      const int32_t t = rows[task / nh];
      const int h = heads[task % nh];
      const int64_t row = l.query_start[i] + t;
      std::vector<uint8_t> vis;
      visible_keys(t, vis);
      std::vector<double> q(dqk), scores(nkeys), acc(dv);
      const int g = h / group;
      for (int d = 0; d < dqk; ++d) {
        q[d] = load_as_float(args.q.data, args.q.dtype, offset3(args.q, row, h, d));
      }
      double m = -std::numeric_limits<double>::infinity();
      for (int32_t j = 0; j < nkeys; ++j) {
        if (!vis[j]) continue;
        const double* kr = kbuf.data() + (static_cast<size_t>(j) * hkv + g) * dqk;
        double dot = 0.0;
        for (int d = 0; d < dqk; ++d) dot += q[d] * kr[d];
        double s = qk_scale * dot;
        if (cap > 0.0) s = cap * std::tanh(s / cap);
        scores[j] = s;
        m = std::max(m, s);
      }
      const double sink = args.sinks ? double{args.sinks[h]} : 0.0;
      if (args.sinks) m = std::max(m, sink);
      double den = args.sinks ? std::exp(sink - m) : 0.0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int32_t j = 0; j < nkeys; ++j) {
        if (!vis[j]) continue;
        const double p = std::exp(scores[j] - m);
        den += p;
        const double* vr = vbuf.data() + (static_cast<size_t>(j) * hkv + g) * dv;
        for (int d = 0; d < dv; ++d) acc[d] += p * vr[d];
      }
      // Every real row sees at least itself, so den > 0; the guard keeps an all-masked row at 0.
      const double norm = den > 0.0 ? kv.v_scale / den : 0.0;
      for (int d = 0; d < dv; ++d) {
        store_from_float(args.out.data, args.out.dtype, offset3(args.out, row, h, d),
                         static_cast<float>(acc[d] * norm));
      }
      if (!args.lse.empty()) {
        const double lse = den > 0.0 ? m + std::log(den) : -std::numeric_limits<double>::infinity();
        args.lse.ptr<float>()[row * args.lse.strides[0] + h * args.lse.strides[1]] =
            static_cast<float>(lse);
      }
    }
  }
}

BackendEntry reference_backend_entry() {
  return host_backend_entry<ReferenceBackend, ReferenceLinearBackend>(
      "reference",
      "float64 CPU oracle for every full-attention mode (MHA, GQA, MLA) and the gdn / kda / mamba2 "
      "layers (slow; never auto-selected)",
      /*auto_selectable=*/false);
}

void register_reference_backend(Registry& registry) { registry.add(reference_backend_entry()); }

}  // namespace attnrt
