// The step validator: a request table and a ForwardBatch decoded from the input, then begin_step on
// an AttentionRuntime over `reference` or `cpu` (models with full, sliding-window, MLA, DSA and
// linear layers; speculative decoding on or off). A batch that begin_step accepts must be safe to
// run: the full-attention layers then run forward on it.
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "attnrt/core/error.h"
#include "attnrt/runtime/attention_runtime.h"

namespace {

using namespace attnrt;

constexpr int kMaxRequests = 6;
constexpr int kMaxContext = 160;
constexpr int64_t kSlots = 512;

struct Setup {
  const char* model;
  int layers;  // the model's first layers
  const char* backend;
  bool speculative;
};

constexpr std::array<Setup, 10> kSetups = {{
    {"demo", 4, "reference", false},
    {"demo", 4, "cpu", false},
    {"demo", 4, "reference", true},
    {"demo", 4, "cpu", true},
    {"deepseek-v3", 1, "reference", true},
    {"deepseek-v3", 1, "cpu", false},
    {"deepseek-v3.2", 1, "reference", false},
    {"deepseek-v3.2", 1, "cpu", true},
    {"qwen3-next-80b", 4, "cpu", true},
    {"nemotron-h-8b", 2, "reference", false},
}};

AttentionRuntime& runtime(size_t i) {
  static std::array<std::unique_ptr<AttentionRuntime>, kSetups.size()> runtimes;
  if (!runtimes[i]) {
    const Setup& s = kSetups[i];
    ModelSpec model = model_preset(s.model);
    model.layers.resize(static_cast<size_t>(s.layers));
    Options o;
    o.attention_backend = s.backend;
    if (s.speculative) {
      o.speculative_num_steps = 3;
      o.speculative_eagle_topk = 2;
      o.speculative_num_draft_tokens = 4;
    }
    o.num_threads = 1;
    RuntimeConfig c;
    c.max_requests = kMaxRequests;
    c.kv_slots = kSlots;
    c.max_num_tokens = 128;
    c.max_context_len = kMaxContext;
    c.cuda_graphs = false;
    runtimes[i] = std::make_unique<AttentionRuntime>(std::move(model), o, c);
  }
  return *runtimes[i];
}

// Mostly small values near the valid range, sometimes the extremes.
template <typename T>
T value(FuzzedDataProvider& p, T lo, T hi) {
  switch (p.ConsumeIntegralInRange<int>(0, 15)) {
    case 0:
      return std::numeric_limits<T>::min();
    case 1:
      return std::numeric_limits<T>::max();
    case 2:
      return p.ConsumeIntegral<T>();
    default:
      return p.ConsumeIntegralInRange<T>(lo, hi);
  }
}

template <typename T>
std::vector<T> vec(FuzzedDataProvider& p, int bs, T lo, T hi) {
  const int n = p.ConsumeBool() ? bs : p.ConsumeIntegralInRange<int>(0, bs + 2);
  std::vector<T> v(static_cast<size_t>(n));
  for (T& x : v) x = value<T>(p, lo, hi);
  return v;
}

void run_layers(AttentionRuntime& rt, const ForwardBatch& batch) {
  const int64_t t = batch.num_tokens();
  for (const LayerSpec& l : rt.model().layers) {
    if (l.kind != LayerKind::full && l.kind != LayerKind::swa) continue;
    HostBuffer q(rt.model().dtype, {t, l.num_q_heads, l.head_dim});
    HostBuffer k(rt.model().dtype, {t, l.num_kv_heads, l.head_dim});
    HostBuffer v(rt.model().dtype, {t, l.num_kv_heads, l.v_head_dim});
    HostBuffer out(rt.model().dtype, {t, l.num_q_heads, l.v_head_dim});
    for (HostBuffer* b : {&q, &k, &v}) std::memset(b->data(), 0, b->bytes());
    AttnArgs args;
    args.q = q.view();
    args.k = k.view();
    args.v = v.view();
    args.out = out.view();
    rt.forward(l.layer_id, args);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider p(data, size);
  AttentionRuntime& rt = runtime(p.ConsumeIntegralInRange<size_t>(0, kSetups.size() - 1));

  // The request table: every row free, then a few rows written.
  ReqToTokenPool& table = rt.req_to_token();
  for (int row = 0; row < table.size(); ++row) {
    if (table.is_allocated(row)) table.free(row);
  }
  const int rows = p.ConsumeIntegralInRange<int>(0, kMaxRequests);
  for (int i = 0; i < rows; ++i) {
    const int row = table.alloc();
    std::vector<int64_t> slots(p.ConsumeIntegralInRange<size_t>(0, kMaxContext));
    for (int64_t& s : slots) s = value<int64_t>(p, 0, kSlots);
    try {
      table.write(row, 0, slots);
    } catch (const Error&) {
    }
  }

  ForwardBatch b;
  b.mode = static_cast<ForwardMode>(p.ConsumeIntegralInRange<int>(0, 8));
  b.batch_size = value<int>(p, 0, kMaxRequests);
  const int bs = std::min(std::max(b.batch_size, 0), kMaxRequests + 1);
  b.req_pool_indices = vec<int64_t>(p, bs, -1, kMaxRequests);
  b.seq_lens = vec<int32_t>(p, bs, -1, kMaxContext + 2);
  b.extend_prefix_lens = vec<int32_t>(p, bs, -1, kMaxContext + 2);
  b.extend_seq_lens = vec<int32_t>(p, bs, -1, 40);
  b.extend_start_loc = vec<int32_t>(p, bs, -1, 140);
  const int tokens = p.ConsumeIntegralInRange<int>(0, 140);
  b.out_cache_loc = vec<int64_t>(p, tokens, -1, kSlots);
  b.positions = vec<int64_t>(p, tokens, -1, kMaxContext + 2);
  if (p.ConsumeBool()) {
    SpecInfo s;
    s.draft_token_num = value<int>(p, -1, 8);
    s.topk = value<int>(p, -1, 3);
    s.parents = vec<int32_t>(p, std::min(std::max(bs, 0) * 8, 64), -2, 8);
    s.accept_length = vec<int32_t>(p, bs, -1, 8);
    b.spec_info = std::move(s);
  }
  try {
    rt.begin_step(b);
  } catch (const Error&) {
    return 0;
  }
  // A request row may hold keys the step's checks do not look at (begin_step checks its write
  // slots): a key inside a window whose slot has no SWA slot is refused by the layer's forward
  // with an attnrt::Error before its pool changes (tests/test_swa_absent_keys.cpp).
  try {
    run_layers(rt, b);
  } catch (const Error&) {
  }
  rt.end_step();
  return 0;
}
