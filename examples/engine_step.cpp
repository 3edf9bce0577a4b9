// How an engine drives attnrt: one request is prefilled in two chunks (the second on top of the
// cached first), then decoded for a few steps, on the backend auto-selected for this machine.
// Built as `attnrt_example` and run by ctest.
#include <cstdio>
#include <random>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/core/error.h"
#include "attnrt/core/tensor.h"
#include "attnrt/model/model_spec.h"
#include "attnrt/runtime/attention_runtime.h"

using namespace attnrt;

namespace {

void fill_random(HostBuffer& b, std::mt19937& rng) {
  std::normal_distribution<float> dist(0.f, 1.f);
  for (int64_t i = 0; i < b.numel(); ++i) store_from_float(b.data(), b.dtype(), i, dist(rng));
}

// Runs every attention layer of the model for the batch the runtime is stepping through.
void run_layers(AttentionRuntime& rt, int64_t tokens, std::mt19937& rng) {
  for (const LayerSpec& layer : rt.model().layers) {
    const DType dt = rt.model().dtype;
    HostBuffer q(dt, {tokens, layer.num_q_heads, layer.head_dim});
    HostBuffer k(dt, {tokens, layer.num_kv_heads, layer.head_dim});
    HostBuffer v(dt, {tokens, layer.num_kv_heads, layer.v_head_dim});
    HostBuffer out(dt, {tokens, layer.num_q_heads, layer.v_head_dim});
    fill_random(q, rng);  // in an engine: the projections of this layer's hidden states
    fill_random(k, rng);
    fill_random(v, rng);
    AttnArgs args;
    args.q = q.view();
    args.k = k.view();
    args.v = v.view();
    args.out = out.view();
    rt.forward(layer.layer_id, args);  // stores k/v at out_cache_loc, then attends
  }
}

}  // namespace

int main() try {
  std::mt19937 rng(7);
  Options options;  // attention_backend unset: auto-select (cuda on Hopper, else cpu)
  options.page_size = 16;
  RuntimeConfig config;
  config.max_requests = 4;
  config.kv_slots = 4096;
  AttentionRuntime rt(model_preset("demo"), options, config);
  for (const std::string& reason : rt.selection().reasons) std::printf("%s\n", reason.c_str());
  if (rt.kv_cache().device().kind != DeviceKind::cpu) {
    std::printf("the KV cache lives on the GPU; this example feeds host tensors, so it stops here\n");
    return 0;
  }

  const int64_t available_at_start = rt.allocator().available_size();
  const int row = rt.req_to_token().alloc();
  std::vector<int64_t> slots;  // the request's KV slots, position by position
  const int prompt = 300, chunk = 200, decode_steps = 4;

  // Chunked prefill: EXTEND steps, the second one with a cached prefix of `chunk` tokens.
  for (int start = 0; start < prompt; start += chunk) {
    const int len = std::min(chunk, prompt - start);
    const std::vector<int32_t> prefix{start}, seq{start + len};
    const std::vector<int64_t> last{slots.empty() ? -1 : slots.back()};
    std::vector<int64_t> loc = rt.allocator().alloc_extend(prefix, seq, last);
    rt.req_to_token().write(row, start, loc);  // the mapping is written before the forward
    slots.insert(slots.end(), loc.begin(), loc.end());
    ForwardBatch batch = make_extend_batch({row}, prefix, {len});
    batch.out_cache_loc = loc;
    rt.begin_step(batch);
    run_layers(rt, len, rng);
    rt.end_step();
    std::printf("EXTEND  prefix %4d + %3d new tokens\n", start, len);
  }

  // DECODE steps: seq_lens include the token being decoded.
  for (int step = 0; step < decode_steps; ++step) {
    const int seq_len = static_cast<int>(slots.size()) + 1;
    std::vector<int64_t> loc = rt.allocator().alloc_decode(std::vector<int32_t>{seq_len},
                                                           std::vector<int64_t>{slots.back()});
    rt.req_to_token().write(row, seq_len - 1, loc);
    slots.push_back(loc[0]);
    ForwardBatch batch = make_decode_batch({row}, {seq_len});
    batch.out_cache_loc = loc;
    rt.begin_step(batch);
    run_layers(rt, 1, rng);
    rt.end_step();
    std::printf("DECODE  seq_len %d\n", seq_len);
  }

  rt.allocator().free(slots);  // the request ends: its pages go back to the pool
  rt.req_to_token().free(row);
  const int64_t available_at_end = rt.allocator().available_size();
  std::printf("done: %lld of %lld KV slots available again\n",
              static_cast<long long>(available_at_end), static_cast<long long>(available_at_start));
  return available_at_end == available_at_start ? 0 : 1;
} catch (const Error& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
