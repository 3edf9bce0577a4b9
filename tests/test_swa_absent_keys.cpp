// A request row that holds a full-pool slot with no SWA slot inside some query's window (a state a
// scheduler never produces, but which begin_step does not look for: it checks the step's write
// slots, not every key of every row) is refused by the host backends (cpu in begin_step's plan,
// reference in that layer's forward), with an attnrt::Error that names the layer, the request, the
// key and the slot, before any pool changes. Found by the fuzz_batch harness (docs/RELIABILITY.md), which had taken the error for a
// crash.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/memory/kv_cache.h"
#include "attnrt/model/model_spec.h"
#include "attnrt/runtime/attention_runtime.h"
#include "tests/test_util.h"

namespace attnrt {
namespace {

TEST(SwaAbsentKeys, AKeyWithoutAnSwaSlotInsideTheWindowIsAnErrorAtForward) {
  for (const char* backend : {"reference", "cpu"}) {
    SCOPED_TRACE(backend);
    ModelSpec model = model_preset("demo");  // 3 full layers, 1 with a window of 64
    Options o;
    o.attention_backend = backend;
    o.num_threads = 1;
    AttentionRuntime rt(model, o, test::host_config(2, 512, 64, 160));
    auto [row, slots] = test::new_request(rt, 10);
    // Key 0 becomes a full slot the allocator never gave out: it has no SWA slot.
    int64_t foreign = 1;
    while (std::find(slots.begin(), slots.end(), foreign) != slots.end()) ++foreign;
    slots[0] = foreign;
    rt.req_to_token().write(row, 0, slots);
    ForwardBatch b = make_decode_batch({row}, {10});
    b.out_cache_loc = {slots[9]};
    // The cpu backend plans every layer in begin_step and refuses the step there; reference
    // checks each layer in its forward. Either call leaves every pool as it was.
    std::string error;
    try {
      rt.begin_step(b);
    } catch (const Error& e) {
      error = e.what();
    }
    std::mt19937 rng(7);
    for (const LayerSpec& l : rt.model().layers) {
      if (!error.empty()) break;
      HostBuffer q(model.dtype, {1, l.num_q_heads, l.head_dim});
      HostBuffer k(model.dtype, {1, l.num_kv_heads, l.head_dim});
      HostBuffer v(model.dtype, {1, l.num_kv_heads, l.head_dim});
      HostBuffer out(model.dtype, {1, l.num_q_heads, l.head_dim});
      for (HostBuffer* x : {&q, &k, &v}) test::fill_normal(x->view(), rng);
      AttnArgs a{.q = q.view(), .k = k.view(), .v = v.view(), .out = out.view()};
      std::vector<std::vector<char>> before;
      for (const LayerSpec& m : rt.model().layers) {
        const KVLayerView kv = rt.kv_cache().layer(m.layer_id);
        const size_t bytes = static_cast<size_t>(kv.num_rows) * kv.k_row_stride * dtype_size(kv.dtype);
        before.emplace_back(static_cast<const char*>(kv.k), static_cast<const char*>(kv.k) + bytes);
      }
      try {
        rt.forward(l.layer_id, a);
        continue;
      } catch (const Error& e) {
        error = e.what();
      }
      for (size_t m = 0; m < before.size(); ++m) {
        const KVLayerView kv = rt.kv_cache().layer(rt.model().layers[m].layer_id);
        EXPECT_EQ(std::memcmp(before[m].data(), kv.k, before[m].size()), 0)
            << "layer " << m << "'s K pool changed in the call that failed";
      }
      break;
    }
    for (const std::string& part : {std::string("request 0 key 0"),
                                    "full slot " + std::to_string(foreign),
                                    std::string("no slot in the SWA pool")}) {
      EXPECT_NE(error.find(part), std::string::npos) << "error: '" << error << "'";
    }
    EXPECT_EQ(error.rfind(std::string(backend) + " backend:", 0), 0u) << error;
    rt.end_step();
  }
}

}  // namespace
}  // namespace attnrt
