// Which keys a query row sees, and the softcap transform of its logits: the one definition every
// attention kernel (attention.cuh, decode_keys_m.cuh, prefill.cuh, prefill_ws.cuh,
// attention_generic.cu) applies.
//
// Key j of a request is visible to query token t when
//  - j < the end of the CTA's split (the request's kv_len at most), and, for causal layers,
//  - j <= prefix + t (chain), or, in a TARGET_VERIFY tree, j < prefix (a cached key) or j is draft
//    u = j - prefix with bit u of the row's draft mask set;
//  - with a sliding window, qpos - kpos <= window, where qpos is prefix + t (prefix + the row's
//    depth in a tree) and kpos is j (prefix + the draft's depth for a draft key).
// Whether a layer is causal or windowed and whether a step is a tree are read from AttnParams when
// a tile needs them; at compile time a kernel only says whether it carries the tree mask at all
// (TREE): the 128-row prefill CTAs do not, and their mask code has no tree branch.
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "backends/cuda/kernels/attention_params.h"
#include "backends/cuda/kernels/common/math.cuh"

namespace attnrt::cuda {

// Keys [lo, hi) of a request.
struct KeyRange {
  int lo, hi;
};

// What the mask needs of one query row: its query position and (tree) its draft mask.
struct MaskRow {
  int qpos;
  uint64_t drafts;
};

// The rule on scalars: `causal` and `windowed` (causal with a window) as the layer sets them, query
// positions q (prefix + token, or prefix + depth in a tree). Mask below applies these; a kernel
// that reads the layer's flags once at its start and walks many requests (the persistent prefill
// CTA, prefill_ws.cuh) calls them directly with its own copies of the flags. (That CTA runs at
// ptxas' register limit: reading the flags through Mask inside its loop made ptxas rebuild the
// wgmma descriptors every tile, 8% more instructions and 1.5-2.8% slower prefill rows.)

// Whether a chain row at query position q sees key j of a split ending at hi.
__device__ __forceinline__ bool chain_visible(bool causal, bool windowed, int window, int q, int j,
                                              int hi) {
  bool vis = j < hi;
  if (causal) vis = vis && j <= q;
  if (windowed) vis = vis && q - j <= window;
  return vis;
}

// chain_visible as one key range: key base + rel is visible to the row at q iff lb <= rel <= ub
// (two compares a key where the tests above take up to five; the prefill mask's 419 -> 209
// instructions a masked tile). The window is capped at 2^30 so that q - base - window cannot
// overflow (a window that long bounds nothing).
__device__ __forceinline__ void chain_visible_range(bool causal, bool windowed, int window, int q,
                                                    int hi, int base, int& lb, int& ub) {
  ub = (causal ? min(hi - 1, q) : hi - 1) - base;
  lb = windowed ? q - base - min(window, 1 << 30) : INT_MIN;
}

// Whether keys [k0, k0 + n) of a split ending at hi may hold one that some row of tokens
// t_lo .. t_hi (query positions prefix + t) does not see: the split's end, the causal diagonal (a
// tree passes t_lo = -1: every draft key may be hidden), the window's edge.
__device__ __forceinline__ bool tile_needs_mask(bool causal, bool windowed, int window, int prefix,
                                                int k0, int n, int hi, int t_lo, int t_hi) {
  return k0 + n > hi || (causal && k0 + n - 1 > prefix + t_lo) ||
         (windowed && k0 < prefix + t_hi - window);
}

// Whether no row of tokens t_lo .. t_hi sees any of the keys [k0, k0 + n): the tile is right of
// every row's diagonal or left of every row's window (a tree passes t_lo = 0: its root sits at
// depth 0).
__device__ __forceinline__ bool tile_hidden(bool causal, bool windowed, int window, int prefix,
                                            int k0, int n, int t_lo, int t_hi) {
  return (causal && k0 > prefix + t_hi) || (windowed && k0 + n - 1 < prefix + t_lo - window);
}

template <bool TREE>
struct Mask {
  const AttnParams& p;
  const ReqInfo& req;

  __device__ __forceinline__ bool causal() const { return p.causal != 0; }
  __device__ __forceinline__ bool windowed() const { return causal() && p.window >= 0; }
  __device__ __forceinline__ bool tree() const { return TREE && causal() && p.tree != 0; }

  // Row of query token t; t >= qlen is a padding row (never stored): it gets the chain's rule.
  __device__ __forceinline__ MaskRow row(int t) const {
    const bool in_tree = tree() && t < req.qlen;
    return {req.prefix + (in_tree ? p.tree_depth[req.tree_start + t] : t),
            in_tree ? p.tree_mask[req.tree_start + t] : 0};
  }

  // Whether `r` sees key j of a split ending at hi.
  __device__ __forceinline__ bool visible(const MaskRow& r, int j, int hi) const {
    if constexpr (!TREE) return chain_visible(causal(), windowed(), p.window, r.qpos, j, hi);
    bool vis = j < hi;
    int kpos = j;
    if (vis && causal()) {
      if (tree()) {
        // A request has at most 64 drafts: the shift stays below 64.
        if (j >= req.prefix) {
          const int u = j - req.prefix;
          vis = (r.drafts >> u) & 1;
          kpos = req.prefix + p.tree_depth[req.tree_start + u];
        }
      } else {
        vis = j <= r.qpos;
      }
      if (p.window >= 0) vis = vis && r.qpos - kpos <= p.window;
    }
    return vis;
  }

  // Whether keys [k0, k0 + n) of a split ending at hi may hold one that a row of tokens
  // t_lo .. t_hi does not see: the split's end, the causal diagonal (in a tree every draft key),
  // the window's edge (a tree row's query position is at most its token's, so the chain's bound
  // covers it). Tiles that need no mask skip the per-key tests.
  __device__ __forceinline__ bool needs_mask(int k0, int n, int hi, int t_lo, int t_hi) const {
    return tile_needs_mask(causal(), windowed(), p.window, req.prefix, k0, n, hi,
                           tree() ? -1 : t_lo, t_hi);
  }

  // Whether no row of tokens t_lo .. t_hi sees any of the keys [k0, k0 + n) (the tile is right of
  // every row's diagonal or left of every row's window; a tree's root sits at depth 0).
  __device__ __forceinline__ bool hides(int k0, int n, int t_lo, int t_hi) const {
    return tile_hidden(causal(), windowed(), p.window, req.prefix, k0, n, tree() ? 0 : t_lo, t_hi);
  }

  // The keys row r of token t sees at most: none past its own token, none before its window.
  __device__ __forceinline__ KeyRange row_span(const MaskRow& r, int t) const {
    KeyRange k{0, req.kv_len};
    if (causal()) {
      k.hi = min(k.hi, req.prefix + t + 1);
      if (windowed()) k.lo = max(0, r.qpos - p.window);
    }
    return k;
  }

  // The keys that some row of tokens t_first .. t_last sees: causal rows none past their own
  // token (a tree row's drafts precede it, too), windowed rows none before their window.
  __device__ __forceinline__ KeyRange span(int t_first, int t_last) const {
    KeyRange k{0, req.kv_len};
    if (causal()) {
      k.hi = min(k.hi, req.prefix + t_last + 1);
      if (windowed()) k.lo = max(0, req.prefix + (tree() ? 0 : t_first) - p.window);
    }
    return k;
  }
};

// Split `split` of `keys`: the range cut into num_splits chunks of whole bn-key tiles. It depends
// on lengths only, so every CTA of a request derives the same chunks on the device.
__device__ __forceinline__ KeyRange split_keys(KeyRange keys, int num_splits, int split, int bn) {
  const int span = max(keys.hi - keys.lo, 0);
  const int chunk = (span + num_splits - 1) / num_splits;
  const int chunk_tiles = (chunk + bn - 1) / bn * bn;
  KeyRange k;
  k.lo = keys.lo + split * chunk_tiles;
  k.hi = min(k.lo + chunk_tiles, keys.hi);
  return k;
}

// The softcap transform of a logit x: cap * tanh(x * scale / cap), in log2 units (cap <= 0: off).
struct SoftCap {
  bool on;
  float in, out;

  __device__ __forceinline__ SoftCap(float cap, float scale)
      : on(cap > 0.f), in(cap > 0.f ? scale / cap : 0.f), out(cap * kLog2e) {}
  __device__ __forceinline__ float operator()(float x) const { return out * tanhf(x * in); }
  // The factor taking a logit to log2 units in the softmax's exponent: 1 once transformed, else
  // scale_log2 (the softmax scale times log2(e)).
  __device__ __forceinline__ float exp_scale(float scale_log2) const {
    return on ? 1.f : scale_log2;
  }
};

}  // namespace attnrt::cuda
