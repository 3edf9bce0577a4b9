#include "backends/reference/reference_backend.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>

#include "attnrt/backend/dsa.h"
#include "attnrt/backend/selection.h"
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

// The output row (and lse) of a row that met a NaN or an infinity.
void write_nan_row(const AttnArgs& args, int64_t row, int h, int dv) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (int d = 0; d < dv; ++d) {
    store_from_float(args.out.data, args.out.dtype, offset3(args.out, row, h, d), nan);
  }
  if (!args.lse.empty()) {
    args.lse.ptr<float>()[row * args.lse.strides[0] + h * args.lse.strides[1]] = nan;
  }
}

}  // namespace

ReferenceBackend::ReferenceBackend(const BackendContext& ctx)
    : OnePathAttnBackend(ctx),
      num_threads_(host_num_threads(ctx.options, "reference backend", omp_get_num_procs())) {}

int ReferenceBackend::threads_for(int64_t work) const {
  return omp_threads_for(work, int64_t{1} << 20, num_threads_);
}

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
  planned_ = false;
  mha_.plan("reference", ctx_, batch, plan.layout);
  plan_ = std::move(plan);
  planned_ = true;
}

bool ReferenceBackend::planned_for(const ForwardBatch& batch) const {
  return planned_ && plan_.mode == batch.mode &&
         static_cast<int>(plan_.layout.query_lens.size()) == batch.batch_size &&
         plan_.layout.num_tokens == batch.num_tokens();
}

void ReferenceBackend::set_sample(std::vector<int64_t> tokens, std::vector<int> heads) {
  std::sort(tokens.begin(), tokens.end());
  tokens.erase(std::unique(tokens.begin(), tokens.end()), tokens.end());
  sample_tokens_ = std::move(tokens);
  sample_heads_ = std::move(heads);
}

void ReferenceBackend::attend(const AttnArgs& args, const LayerSpec& layer,
                              const ForwardBatch& batch) {
  const bool planned = planned_for(batch);
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

  const double cap = layer.logit_cap;
  const int64_t window = layer.sliding_window;
  const bool causal = layer.causal();
  const bool tree = is_target_verify(batch.mode);
  // Which keys query row t of request i sees: the mode's mask, then the window on positions
  // (§8.4, §8.5).
  auto request_keys = [&](int i, int32_t t, std::vector<uint8_t>& vis) {
    const int64_t k0 = plan_.key_start[i];
    const int32_t nkeys = l.kv_len(i), prefix = l.prefix_lens[i];
    vis.assign(nkeys, 0);
    if (!causal) {
      std::fill(vis.begin(), vis.end(), uint8_t{1});
    } else if (tree) {
      const int32_t* parents =
          batch.spec_info->parents.data() + static_cast<size_t>(i) * l.query_lens[i];
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
  // scheduling bug, so it is reported rather than silently attended, before anything is stored.
  if (kv.slot_map != nullptr) {
    std::vector<uint8_t> vis;
    for (int i = 0; i < bs; ++i) {
      const int64_t k0 = plan_.key_start[i];
      for (int32_t t = 0; t < l.query_lens[i]; ++t) {
        request_keys(i, t, vis);
        for (int32_t j = 0; j < l.kv_len(i); ++j) {
          ATTNRT_CHECK(!vis[j] || slots[k0 + j] != 0,
                       "reference backend: layer {} request {} key {} (full slot {}) is inside the "
                       "window of query {} but has no slot in the SWA pool",
                       layer.layer_id, i, j, plan_.key_slots[k0 + j], t);
        }
      }
    }
  }

  if (args.save_kv && !args.k.empty()) {
    ctx_.kv_cache->store_step_kv(layer.layer_id, args.k, args.v);
    if (layer.has_indexer()) ctx_.kv_cache->store_step_index_k(layer.layer_id, args.indexer.k);
  }
  const bool dsa = layer.has_indexer();
  const IndexKeyView index_keys = dsa ? ctx_.kv_cache->index_keys(layer.layer_id) : IndexKeyView{};

  const double scale = layer.scaling > 0.f ? double{layer.scaling} : 1.0 / std::sqrt(static_cast<double>(dqk));
  const double qk_scale = scale * kv.k_scale;
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
    const int32_t nkeys = l.kv_len(i);

    auto visible_keys = [&](int32_t t, std::vector<uint8_t>& vis) { request_keys(i, t, vis); };

    // DSA (docs/dsa.md): the index keys of the request, dequantised.
    std::vector<double> ikeys;
    if (dsa) {
      const int di = index_keys.dim;
      ikeys.resize(static_cast<size_t>(nkeys) * di);
      for (int32_t j = 0; j < nkeys; ++j) {
        const int64_t s = plan_.key_slots[k0 + j];
        const uint8_t* codes = index_keys.codes(s);
        const double ks = index_keys.scale(s);
        for (int d = 0; d < di; ++d) ikeys[static_cast<size_t>(j) * di + d] = e4m3_to_float(codes[d]) * ks;
      }
    }
    // The selection of query t: of the keys `vis` marks, the index_topk of highest index score
    // (ties: the lower token index), all of them when there are no more; `vis` keeps only those.
    auto select_keys = [&](int64_t row, std::vector<uint8_t>& vis) {
      const IndexerSpec& ix = layer.indexer;
      const int di = ix.index_head_dim;
      std::vector<float> qh(di), qr(di);
      std::vector<double> w(ix.index_n_heads);
      std::vector<std::vector<double>> qd(ix.index_n_heads, std::vector<double>(di));
      for (int h = 0; h < ix.index_n_heads; ++h) {
        for (int d = 0; d < di; ++d) {
          qh[d] = load_as_float(args.indexer.q.data, args.indexer.q.dtype,
                                offset3(args.indexer.q, row, h, d));
        }
        round_index_query(qh.data(), di, qr.data());
        for (int d = 0; d < di; ++d) qd[h][d] = qr[d];
        const TensorView& wt = args.indexer.weights;
        w[h] = load_as_float(wt.data, wt.dtype, row * wt.strides[0] + h * wt.strides[1]);
      }
      const double c = index_score_scale(layer);
      std::vector<std::pair<double, int32_t>> ranked;  // (score, token index)
      for (int32_t j = 0; j < nkeys; ++j) {
        if (!vis[j]) continue;
        const double* kr = ikeys.data() + static_cast<size_t>(j) * di;
        double score = 0.0;
        for (int h = 0; h < ix.index_n_heads; ++h) {
          double dot = 0.0;
          for (int d = 0; d < di; ++d) dot += qd[h][d] * kr[d];
          score += w[h] * std::max(dot, 0.0);
        }
        ranked.emplace_back(c * score, j);
      }
      std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
        return dsa_ranks_before(a.first, a.second, b.first, b.second);
      });
      if (ranked.size() > static_cast<size_t>(ix.index_topk)) ranked.resize(ix.index_topk);
      std::fill(vis.begin(), vis.end(), uint8_t{0});
      for (const auto& [score, j] : ranked) vis[j] = 1;
      if (!args.indexer.topk.empty()) {
        const TensorView& out = args.indexer.topk;
        int32_t* dst = out.ptr<int32_t>() + row * out.strides[0];
        int n = 0;
        for (int32_t j = 0; j < nkeys; ++j) {
          if (vis[j]) dst[(n++) * out.strides[1]] = j;
        }
        for (; n < ix.index_topk; ++n) dst[n * out.strides[1]] = -1;
      }
    };

    kbuf.resize(static_cast<size_t>(nkeys) * hkv * dqk);
    vbuf.resize(static_cast<size_t>(nkeys) * hkv * dv);
#pragma omp parallel for schedule(static) \
    num_threads(threads_for(int64_t{nkeys} * hkv * (dqk + dv)))
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

    // DSA: the selection is per query row (not per head), so it is made once per row up front.
    std::vector<std::vector<uint8_t>> selected(dsa ? rows.size() : 0);
#pragma omp parallel for schedule(dynamic) \
    num_threads(threads_for(static_cast<int64_t>(selected.size()) * nkeys * 64))
    for (size_t r = 0; r < selected.size(); ++r) {
      visible_keys(rows[r], selected[r]);
      select_keys(l.query_start[i] + rows[r], selected[r]);
    }

    // One task per (row, head): a decode request has a single row.
    const auto nh = static_cast<int64_t>(heads.size());
    const int64_t tasks = static_cast<int64_t>(rows.size()) * nh;
#pragma omp parallel for schedule(dynamic) \
    num_threads(threads_for(tasks * nkeys * (dqk + dv)))
    for (int64_t task = 0; task < tasks; ++task) {
      const int32_t t = rows[task / nh];
      const int h = heads[task % nh];
      const int64_t row = l.query_start[i] + t;
      std::vector<uint8_t> own;
      if (!dsa) visible_keys(t, own);
      const std::vector<uint8_t>& vis = dsa ? selected[task / nh] : own;
      std::vector<double> q(dqk), scores(nkeys), acc(dv);
      const int g = h / group;
      // A NaN or an infinity in q, or in K or V of a visible key, makes the row NaN
      // (docs/backends.md, "NaN and infinity"); IEEE arithmetic alone would let some through (an
      // infinite score capped by tanh, a -inf score weighted 0).
      bool finite = true;
      for (int d = 0; d < dqk; ++d) {
        q[d] = load_as_float(args.q.data, args.q.dtype, offset3(args.q, row, h, d));
        finite = finite && std::isfinite(q[d]);
      }
      double m = -std::numeric_limits<double>::infinity();
      for (int32_t j = 0; j < nkeys; ++j) {
        if (!vis[j]) continue;
        const double* kr = kbuf.data() + (static_cast<size_t>(j) * hkv + g) * dqk;
        double dot = 0.0;
        for (int d = 0; d < dqk; ++d) dot += q[d] * kr[d];
        finite = finite && std::isfinite(dot);
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
        for (int d = 0; d < dv; ++d) {
          acc[d] += p * vr[d];
          finite = finite && std::isfinite(vr[d]);
        }
      }
      if (!finite) {
        write_nan_row(args, row, h, dv);
        continue;
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

namespace {

// One head of one query row against key rows [k0, k1) of k / v ([rows, heads, dim], the query's
// head): o = softmax(scale * q.k, capped) V; returns the log-sum-exp (-inf without keys).
double attend_rows(const TensorView& q, int64_t row, int h, const TensorView& k,
                   const TensorView& v, int64_t k0, int64_t k1, double scale, double cap,
                   std::vector<double>& o) {
  const int dqk = static_cast<int>(q.shape[2]), dv = static_cast<int>(v.shape[2]);
  std::vector<double> qd(dqk), s(k1 - k0);
  for (int d = 0; d < dqk; ++d) qd[d] = load_as_float(q.data, q.dtype, offset3(q, row, h, d));
  bool finite = std::all_of(qd.begin(), qd.end(), [](double x) { return std::isfinite(x); });
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t j = k0; j < k1; ++j) {
    double dot = 0.0;
    for (int d = 0; d < dqk; ++d) dot += qd[d] * load_as_float(k.data, k.dtype, offset3(k, j, h, d));
    finite = finite && std::isfinite(dot);
    double x = scale * dot;
    if (cap > 0.0) x = cap * std::tanh(x / cap);
    s[j - k0] = x;
    m = std::max(m, x);
  }
  o.assign(dv, 0.0);
  if (k1 <= k0) return -std::numeric_limits<double>::infinity();
  double den = 0.0;
  for (int64_t j = k0; j < k1; ++j) {
    const double p = std::exp(s[j - k0] - m);
    den += p;
    for (int d = 0; d < dv; ++d) {
      const double x = load_as_float(v.data, v.dtype, offset3(v, j, h, d));
      o[d] += p * x;
      finite = finite && std::isfinite(x);
    }
  }
  if (!finite) {
    o.assign(dv, std::numeric_limits<double>::quiet_NaN());
    return std::numeric_limits<double>::quiet_NaN();
  }
  for (double& x : o) x /= den;
  return m + std::log(den);
}

float* lse_at(const TensorView& lse, int64_t row, int h) {
  return lse.ptr<float>() + row * lse.strides[0] + h * lse.strides[1];
}

}  // namespace

void ReferenceBackend::forward_mla_mha(const MlaMhaArgs& args, const LayerSpec& layer,
                                       const ForwardBatch& batch) {
  mha_.check_causal("reference", ctx_, planned_for(batch), args, layer, batch);
  if (args.save_kv) ctx_.kv_cache->store_step_kv(layer.layer_id, args.latent, TensorView());
  const StepLayout& l = plan_.layout;
  const double scale = layer.softmax_scale(), cap = layer.logit_cap;
  const int hq = layer.num_q_heads, dv = static_cast<int>(args.v.shape[2]);
  for (int i = 0; i < batch.batch_size; ++i) {
    const int64_t q0 = l.query_start[i];
#pragma omp parallel for schedule(dynamic) \
    num_threads(threads_for(int64_t{l.query_lens[i]} * l.query_lens[i] / 2 * hq * (args.q.shape[2] + dv)))
    for (int32_t t = 0; t < l.query_lens[i]; ++t) {
      std::vector<double> o;
      for (int h = 0; h < hq; ++h) {
        // Query t of the request sees its extend tokens 0 .. t.
        const double lse = attend_rows(args.q, q0 + t, h, args.k, args.v, q0, q0 + t + 1, scale,
                                       cap, o);
        for (int d = 0; d < dv; ++d) {
          store_from_float(args.out.data, args.out.dtype, offset3(args.out, q0 + t, h, d),
                           static_cast<float>(o[d]));
        }
        if (!args.lse.empty()) *lse_at(args.lse, q0 + t, h) = static_cast<float>(lse);
      }
    }
  }
  mha_.causal_done(layer.layer_id);
}

void ReferenceBackend::forward_mla_prefix_chunk(int chunk, const MlaChunkArgs& args,
                                                const LayerSpec& layer,
                                                const ForwardBatch& batch) {
  mha_.check_chunk("reference", planned_for(batch), chunk, args, layer, batch);
  const PrefixChunk& c = mha_.chunks().chunks[chunk];
  const StepLayout& l = plan_.layout;
  const double scale = layer.softmax_scale(), cap = layer.logit_cap;
  const int hq = layer.num_q_heads, dv = static_cast<int>(args.v.shape[2]);
  for (int i = 0; i < batch.batch_size; ++i) {
    if (c.lens[i] == 0) continue;
    const int64_t q0 = l.query_start[i];
#pragma omp parallel for schedule(dynamic) \
    num_threads(threads_for(int64_t{l.query_lens[i]} * c.lens[i] * hq * (args.q.shape[2] + dv)))
    for (int32_t t = 0; t < l.query_lens[i]; ++t) {
      std::vector<double> o;
      for (int h = 0; h < hq; ++h) {
        // Every key of the chunk precedes the request's queries: no mask.
        const double b = attend_rows(args.q, q0 + t, h, args.k, args.v, c.cu_seqlens[i],
                                     c.cu_seqlens[i + 1], scale, cap, o);
        float* lse = lse_at(args.lse, q0 + t, h);
        const double a = *lse, m = std::max(a, b);
        const double wa = std::exp(a - m), wb = std::exp(b - m);
        for (int d = 0; d < dv; ++d) {
          const size_t at = offset3(args.out, q0 + t, h, d);
          const double oa = load_as_float(args.out.data, args.out.dtype, at);
          store_from_float(args.out.data, args.out.dtype, at,
                           static_cast<float>((wa * oa + wb * o[d]) / (wa + wb)));
        }
        *lse = static_cast<float>(m + std::log(wa + wb));
      }
    }
  }
  mha_.chunk_done(chunk);
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
