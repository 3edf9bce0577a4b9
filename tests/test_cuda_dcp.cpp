// Decode context parallelism on one GPU (docs/dcp.md "Ranks on one GPU"): a DcpAttention of 2 and
// 3 `cuda` ranks sharing the GPU against one `reference` runtime holding every token, fed the same
// batches and q/k/v, for EXTEND over a prefix, DECODE, chain TARGET_VERIFY and tree TARGET_VERIFY
// (with its accepted paths committed), GQA with soft-cap, sinks and a sliding window, and
// DeepSeek-V3's MLA (absorbed form, 576 / 512), at page size 1 and (full attention, no tree) 16
// and 64; with host tensors (the ranks' backend stages them)
// and with GPU tensors (gather, pack, the device all-to-all and the merge kernel in GPU memory).
// Outputs are poisoned (NaN) first. Also the merge kernel against dcp_merge, bit for bit on most
// elements, and the device communicator's blocks element for element. Fresh random inputs every
// run (ATTNRT_TEST_SEED replays one); skips, with the reason, where no CUDA device is usable.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "attnrt/batch/forward_batch.h"
#include "attnrt/runtime/attention_runtime.h"
#include "attnrt/runtime/communicator.h"
#include "attnrt/runtime/dcp.h"
#include "tests/test_cuda_util.h"
#include "tests/cuda_dcp_models.h"
#include "tests/dcp_steps.h"
#include "tests/test_util.h"

#ifdef ATTNRT_HAS_CUDA
#include <cuda_runtime_api.h>

#include "backends/cuda/kernels/gpu_hold.h"
#include "src/runtime/dcp_device.h"
#endif

namespace attnrt {
namespace {

#ifdef ATTNRT_HAS_CUDA

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Case {
  int ranks;
  bool gpu_tensors;
  int page = 1;  // the cuda ranks' page size (the oracle's is 1)
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return "n" + std::to_string(info.param.ranks) + (info.param.gpu_tensors ? "_gpu" : "_host") +
         "_tensors" + (info.param.page > 1 ? "_page" + std::to_string(info.param.page) : "");
}

// bf16 outputs of the cuda kernels against the reference's on the same bf16 inputs.
constexpr double kOutTol = 2e-2, kLseTol = 1e-2;

// One `reference` runtime (the oracle, which also hands out the global batch's slots) and a group
// of `cuda` ranks on the GPU, fed the same batches and q/k/v.
class Harness {
 public:
  Harness(ModelSpec model, const Case& c, uint32_t seed, bool tree = false)
      : model_(std::move(model)), case_(c), rng_(seed) {
    Options one;
    one.attention_backend = "reference";
    one.page_size = 1;
    Options group = one;
    group.attention_backend = "cuda";
    group.dcp_size = c.ranks;
    group.page_size = c.page;
    if (tree) {
      group.speculative_num_steps = 3;
      group.speculative_eagle_topk = 2;
      group.speculative_num_draft_tokens = 6;
    }
    const RuntimeConfig cfg = test::host_config(6, 4096, 256);
    one_ = std::make_unique<AttentionRuntime>(model_, one, cfg);
    dcp_ = std::make_unique<DcpAttention>(model_, group, cfg);
  }

  DcpAttention& dcp() { return *dcp_; }
  int rand_int(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }

  std::vector<int64_t> alloc_requests(int n) {
    std::vector<int64_t> rows;
    for (int i = 0; i < n; ++i) rows.push_back(one_->req_to_token().alloc());
    return rows;
  }

  void place(ForwardBatch& b) { test::place_on(*one_, b); }

  // Runs the step on both, every layer with fresh q/k/v, and compares out and lse; the failure
  // names the step, the layer, the tensor and the element (token * heads * dims + ...).
  ForwardBatch run_and_compare(ForwardBatch b, const std::string& step) {
    place(b);
    const int64_t T = b.num_tokens();
    one_->begin_step(b);
    dcp_->begin_step(b);
    for (const LayerSpec& l : model_.layers) {
      const int hq = l.num_q_heads, hkv = l.num_kv_heads, dqk = l.head_dim;
      const int dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
      const bool mla = l.kind == LayerKind::mla;
      HostBuffer q = test::random_buffer(DType::bf16, {T, hq, dqk}, rng_);
      HostBuffer k = test::random_buffer(DType::bf16, {T, hkv, dqk}, rng_);
      HostBuffer v = test::random_buffer(DType::bf16, {T, hkv, dv}, rng_);
      std::vector<float> sinks(hq);
      for (float& s : sinks) s = std::normal_distribution<float>(0.f, 1.f)(rng_);
      HostBuffer out1(DType::bf16, {T, hq, dv}), outn(DType::bf16, {T, hq, dv});
      HostBuffer lse1(DType::f32, {T, hq}), lsen(DType::f32, {T, hq});
      for (const HostBuffer* p : {&out1, &outn, &lse1, &lsen}) test::poison(p->view());
      AttnArgs a;
      a.q = q.view();
      a.k = k.view();
      if (!mla) a.v = v.view();
      a.sinks = l.has_sinks ? sinks.data() : nullptr;
      a.out = out1.view();
      a.lse = lse1.view();
      one_->forward(l.layer_id, a);
      if (case_.gpu_tensors) {
        test::DevTensor dq(q.view()), dk(k.view()), dvv(v.view()), dout(outn.view()),
            dlse(lsen.view());  // poisoned outputs uploaded as they are
        AttnArgs g = a;
        g.q = dq.view;
        g.k = dk.view;
        g.v = mla ? TensorView() : dvv.view;
        g.out = dout.view;
        g.lse = dlse.view;
        dcp_->forward(l.layer_id, g);
        dout.download(outn.view());
        dlse.download(lsen.view());
      } else {
        a.out = outn.view();
        a.lse = lsen.view();
        dcp_->forward(l.layer_id, a);
      }
      const std::string name = model_.name + " " + step + " on " + std::to_string(case_.ranks) +
                               " cuda ranks (" + (case_.gpu_tensors ? "GPU" : "host") +
                               " tensors, page_size " + std::to_string(case_.page) + "), layer " +
                               std::to_string(l.layer_id);
      test::expect_close(outn.view(), out1.view(), kOutTol, name + " out [T, Hq, Dv]");
      test::expect_close(lsen.view(), lse1.view(), kLseTol, name + " lse [T, Hq]");
    }
    one_->end_step();
    dcp_->end_step();
    return b;
  }

  void commit(const ForwardBatch& verify, const std::vector<std::vector<int32_t>>& paths) {
    test::commit_accepted(*one_, *dcp_, model_, verify, paths);
  }

  std::vector<int32_t> random_path(const int32_t* parents, int n) {
    return test::random_path(parents, n, rng_);
  }

  // Cached prefixes of random lengths in [0, max_prefix] (the first at least 1), stored by an
  // EXTEND step from 0 (itself compared).
  std::vector<int32_t> fill(const std::vector<int64_t>& rows, int max_prefix) {
    std::vector<int32_t> prefix;
    std::vector<int64_t> fill_rows;
    std::vector<int32_t> fill_lens;
    for (size_t i = 0; i < rows.size(); ++i) {
      prefix.push_back(rand_int(i == 0 ? 1 : 0, max_prefix));
      if (prefix.back() > 0) {
        fill_rows.push_back(rows[i]);
        fill_lens.push_back(prefix.back());
      }
    }
    run_and_compare(
        make_extend_batch(fill_rows, std::vector<int32_t>(fill_rows.size(), 0), fill_lens),
        "prefill");
    return prefix;
  }

  std::vector<int32_t> random_tree(int n) {
    std::vector<int32_t> p(n, -1);
    for (int t = 1; t < n; ++t) p[t] = rand_int(0, t - 1);
    if (n >= 3) p[2] = 0;
    return p;
  }

 private:
  ModelSpec model_;
  Case case_;
  std::mt19937 rng_;
  std::unique_ptr<AttentionRuntime> one_;
  std::unique_ptr<DcpAttention> dcp_;
};

class CudaDcp : public testing::TestWithParam<Case> {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    seed_ = test::test_seed();
    trace_.emplace(__FILE__, __LINE__, "ATTNRT_TEST_SEED=" + std::to_string(seed_));
  }
  uint32_t seed_ = 0;
  std::optional<testing::ScopedTrace> trace_;
};

TEST_P(CudaDcp, ExtendOverAPrefixThenDecode) {
  for (const ModelSpec& model : {test::dcp_gqa_model(), test::dcp_mla_model()}) {
    Harness h(model, GetParam(), seed_);
    const auto rows = h.alloc_requests(h.rand_int(1, 4));
    std::vector<int32_t> prefix = h.fill(rows, 70);
    std::vector<int32_t> ext, seq;
    for (size_t i = 0; i < rows.size(); ++i) ext.push_back(h.rand_int(1, 19));
    h.run_and_compare(make_extend_batch(rows, prefix, ext), "extend over a prefix");
    for (size_t i = 0; i < rows.size(); ++i) seq.push_back(prefix[i] + ext[i] + 1);
    h.run_and_compare(make_decode_batch(rows, seq), "decode");
    for (int32_t& s : seq) ++s;
    h.run_and_compare(make_decode_batch(rows, seq), "decode 2");
  }
}

TEST_P(CudaDcp, ChainVerifyThenDecodeAfterAcceptance) {
  for (const ModelSpec& model : {test::dcp_gqa_model(), test::dcp_mla_model()}) {
    Harness h(model, GetParam(), seed_);
    const auto rows = h.alloc_requests(h.rand_int(1, 4));
    std::vector<int32_t> prefix = h.fill(rows, 70);
    const int n = 5;
    h.run_and_compare(
        make_verify_batch(rows, prefix, SpecInfo::chain(static_cast<int>(rows.size()), n)),
        "chain verify");
    std::vector<int32_t> seq;
    for (int32_t p : prefix) seq.push_back(p + h.rand_int(0, n - 1) + 2);
    h.run_and_compare(make_decode_batch(rows, seq), "decode after chain verify");
  }
}

TEST_P(CudaDcp, TreeVerifyThenDecodeAfterCommit) {
  for (const ModelSpec& model : {test::dcp_gqa_model(), test::dcp_mla_model()}) {
    Harness h(model, GetParam(), seed_, /*tree=*/true);
    const auto rows = h.alloc_requests(h.rand_int(1, 4));
    std::vector<int32_t> prefix = h.fill(rows, 70);
    const int n = 6;
    SpecInfo spec;
    spec.draft_token_num = n;
    spec.topk = 2;
    for (size_t i = 0; i < rows.size(); ++i) {
      for (int32_t p : h.random_tree(n)) spec.parents.push_back(p);
    }
    const ForwardBatch v = h.run_and_compare(make_verify_batch(rows, prefix, spec), "tree verify");
    std::vector<std::vector<int32_t>> paths;
    std::vector<int32_t> seq;
    for (size_t i = 0; i < rows.size(); ++i) {
      paths.push_back(h.random_path(spec.parents.data() + i * n, n));
      seq.push_back(prefix[i] + static_cast<int32_t>(paths.back().size()) + 1);
    }
    h.commit(v, paths);
    h.run_and_compare(make_decode_batch(rows, seq), "decode after tree commit");
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CudaDcp,
                         testing::Values(Case{2, false}, Case{2, true}, Case{3, false},
                                         Case{3, true}),
                         case_name);

// Prefills each request with a prompt whose local counts on the ranks end around a page edge
// (n * page global tokens per local page), one request a step; returns the prompt lengths.
template <class H>
std::vector<int32_t> prefill_near_page_edges(H& h, const std::vector<int64_t>& rows, int n, int page) {
  std::vector<int32_t> prefix;
  for (const int64_t row : rows) {
    prefix.push_back(std::clamp(n * page + h.rand_int(-n - 1, n + 1), 1, 240));
    h.run_and_compare(make_extend_batch({row}, {0}, {prefix.back()}), "prefill");
  }
  return prefix;
}

// cuda ranks at page_size 16 and 64 (docs/dcp.md): a DECODE entry reads its request's own row, an
// EXTEND / chain-verify entry a key-list copy of a row prefix; both are whole pages and a partial
// last one, which the cuda plan reads as pages. Full-attention models (GQA with soft-cap and
// sinks, DeepSeek-V3's MLA), ragged lengths across page edges on the ranks.
class CudaDcpPaged : public CudaDcp {};

TEST_P(CudaDcpPaged, ExtendOverAPrefixThenDecodes) {
  const int page = GetParam().page, n = GetParam().ranks;
  for (const ModelSpec& model : {test::dcp_full_model(), test::dcp_mla_model()}) {
    Harness h(model, GetParam(), seed_);
    const auto rows = h.alloc_requests(3);
    const std::vector<int32_t> prefix = prefill_near_page_edges(h, rows, n, page);
    std::vector<int32_t> ext, seq;
    for (size_t i = 0; i < rows.size(); ++i) ext.push_back(h.rand_int(1, 19));
    h.run_and_compare(make_extend_batch(rows, prefix, ext), "extend over a prefix");
    for (size_t i = 0; i < rows.size(); ++i) seq.push_back(prefix[i] + ext[i]);
    for (int step = 0; step < 2 * n + 1; ++step) {
      for (int32_t& s : seq) ++s;
      h.run_and_compare(make_decode_batch(rows, seq), "decode " + std::to_string(step));
    }
  }
}

TEST_P(CudaDcpPaged, ChainVerifyThenDecodeAfterAcceptance) {
  const int page = GetParam().page, n = GetParam().ranks;
  for (const ModelSpec& model : {test::dcp_full_model(), test::dcp_mla_model()}) {
    Harness h(model, GetParam(), seed_);
    const auto rows = h.alloc_requests(3);
    const std::vector<int32_t> prefix = prefill_near_page_edges(h, rows, n, page);
    std::vector<int32_t> seq;
    for (int32_t p : prefix) seq.push_back(p + 1);
    h.run_and_compare(make_decode_batch(rows, seq), "decode");
    const int nd = 5;
    h.run_and_compare(make_verify_batch(rows, seq, SpecInfo::chain(3, nd)), "chain verify");
    for (int32_t& s : seq) s += h.rand_int(0, nd - 1) + 2;
    h.run_and_compare(make_decode_batch(rows, seq), "decode after chain verify");
    for (int32_t& s : seq) ++s;
    h.run_and_compare(make_decode_batch(rows, seq), "decode 2 after chain verify");
  }
}

INSTANTIATE_TEST_SUITE_P(Pages, CudaDcpPaged,
                         testing::Values(Case{2, false, 16}, Case{2, true, 16}, Case{3, true, 16},
                                         Case{2, true, 64}, Case{3, false, 64},
                                         Case{3, true, 64}),
                         case_name);

// A tree TARGET_VERIFY step on cuda ranks with page_size > 1 is refused at begin_step, naming the
// page size, the mode and what is allowed, before anything is stored; the group goes on with a
// chain verify and a decode.
TEST(CudaDcpErrors, TreeVerifyWithPagesIsRefused) {
  SKIP_WITHOUT_GPU();
  const uint32_t seed = test::test_seed();
  SCOPED_TRACE("ATTNRT_TEST_SEED=" + std::to_string(seed));
  Harness h(test::dcp_full_model(), Case{2, true, 16}, seed, /*tree=*/true);
  const auto rows = h.alloc_requests(2);
  h.run_and_compare(make_extend_batch(rows, {0, 0}, {37, 20}), "prefill");
  SpecInfo spec;
  spec.draft_token_num = 6;
  spec.topk = 2;
  for (int i = 0; i < 2; ++i) {
    for (int32_t p : {-1, 0, 0, 1, 2, 3}) spec.parents.push_back(p);
  }
  ForwardBatch tree = make_verify_batch(rows, {37, 20}, spec);
  tree.out_cache_loc.assign(tree.positions.size(), 0);
  std::vector<size_t> held;
  for (int r = 0; r < 2; ++r) held.push_back(h.dcp().rank(r).local_row(static_cast<int>(rows[0])).size());
  test::expect_error([&] { h.dcp().begin_step(tree); },
                     {"tree TARGET_VERIFY", "page_size 16", "page_size 1", "chain verify"});
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(h.dcp().rank(r).local_row(static_cast<int>(rows[0])).size(), held[r])
        << "rank " << r << ": the refused step stored something";
  }
  h.run_and_compare(make_verify_batch(rows, {37, 20}, SpecInfo::chain(2, 6)), "chain verify");
  h.run_and_compare(make_decode_batch(rows, {40, 22}), "decode after chain verify");
}

// The merge kernel against dcp_merge (double accumulation both): random partials of 3 ranks, some
// empty (lse -inf), a row empty on every rank, with and without sinks, into a poisoned fp32 out.
TEST(CudaDcpMerge, KernelMatchesHostMerge) {
  SKIP_WITHOUT_GPU();
  const uint32_t seed = test::test_seed();
  SCOPED_TRACE("ATTNRT_TEST_SEED=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const int n = 3, hq = 5, dv = 24;
  const int64_t T = 7;
  for (const bool with_sinks : {false, true}) {
    // Every rank's packed partial of every head ([T, hq, dv + 1]).
    std::vector<std::vector<float>> part(n, std::vector<float>(T * hq * (dv + 1)));
    std::normal_distribution<float> dist(0.f, 3.f);
    for (int r = 0; r < n; ++r) {
      for (int64_t t = 0; t < T; ++t) {
        for (int h = 0; h < hq; ++h) {
          float* p = part[r].data() + (t * hq + h) * (dv + 1);
          for (int j = 0; j < dv; ++j) p[j] = dist(rng);
          const bool empty = t == 3 || (t + h + r) % 4 == 0;
          p[dv] = empty ? -kInf : dist(rng);
        }
      }
    }
    std::vector<float> sinks(hq);
    for (float& s : sinks) s = dist(rng);
    // Rank d's receive buffer: n blocks [T, heads(d), dv + 1], source rank order.
    for (int d = 0; d < n; ++d) {
      const int h0 = dcp_head_begin(d, hq, n), h1 = dcp_head_begin(d + 1, hq, n), m = h1 - h0;
      std::vector<float> recv;
      for (int s = 0; s < n; ++s) {
        for (int64_t t = 0; t < T; ++t) {
          for (int h = h0; h < h1; ++h) {
            const float* p = part[s].data() + (t * hq + h) * (dv + 1);
            recv.insert(recv.end(), p, p + dv + 1);
          }
        }
      }
      HostBuffer out(DType::f32, {T, hq, dv}), lse(DType::f32, {T, hq});
      test::poison(out.view());
      test::poison(lse.view());
      test::DevTensor dout(out.view()), dlse(lse.view());
      test::DeviceMemory dsinks(hq * sizeof(float));
      dsinks.upload(sinks.data());
      std::unique_ptr<DcpDeviceRank> dev = make_dcp_device_rank(nullptr);
      dev->set_entries(0, {}, T);
      const std::span<float> r = dev->recv(static_cast<int64_t>(recv.size()));
      ASSERT_EQ(cudaMemcpy(r.data(), recv.data(), recv.size() * sizeof(float),
                           cudaMemcpyHostToDevice),
                cudaSuccess);
      dev->merge(n, h0, h1, dv, with_sinks ? dsinks.as<float>() : nullptr, dout.view, dlse.view);
      dev->synchronize();
      dout.download(out.view());
      dlse.download(lse.view());
      for (int64_t t = 0; t < T; ++t) {
        for (int h = 0; h < hq; ++h) {
          const float* o = out.view().ptr<float>() + (t * hq + h) * dv;
          const float l = lse.view().ptr<float>()[t * hq + h];
          const std::string at = "rank " + std::to_string(d) + " row " + std::to_string(t) +
                                 " head " + std::to_string(h) +
                                 (with_sinks ? " (sinks)" : " (no sinks)");
          if (h < h0 || h >= h1) {  // another rank's head: untouched
            EXPECT_TRUE(std::isnan(o[0]) && std::isnan(l)) << at << ": written, not its head";
            continue;
          }
          std::vector<const float*> parts;
          for (int s = 0; s < n; ++s) parts.push_back(part[s].data() + (t * hq + h) * (dv + 1));
          std::vector<float> want(dv);
          const float want_lse = dcp_merge(
              parts, dv, with_sinks ? std::optional<float>(sinks[h]) : std::nullopt, want.data());
          EXPECT_TRUE(l == want_lse || std::abs(l - want_lse) <= 1e-6f * (1 + std::abs(want_lse)))
              << at << ": lse " << l << ", dcp_merge " << want_lse;
          for (int j = 0; j < dv; ++j) {
            EXPECT_NEAR(o[j], want[j], 1e-6 * (1 + std::abs(want[j])))
                << at << " column " << j << ": merge kernel vs dcp_merge";
          }
        }
      }
    }
  }
}

// The device communicator of 3 ranks on the GPU: random blocks of random sizes (zero included)
// between every pair, into poisoned receive buffers; an all_gather; a mismatched count named.
TEST(CudaDcpCommunicator, DeviceInProcessMovesBlocks) {
  SKIP_WITHOUT_GPU();
  const uint32_t seed = test::test_seed();
  SCOPED_TRACE("ATTNRT_TEST_SEED=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const int n = 3;
  std::unique_ptr<Communicator> comm = make_communicator("device_in_process", n);
  EXPECT_TRUE(comm->device_buffers());
  // counts[s][d]: floats rank s sends to rank d.
  std::vector<std::vector<int64_t>> counts(n, std::vector<int64_t>(n));
  for (auto& row : counts) {
    for (int64_t& c : row) c = std::uniform_int_distribution<int>(0, 3)(rng) == 0 ? 0 : 1 + rng() % 40;
  }
  std::vector<std::vector<float>> send(n);
  std::vector<std::unique_ptr<test::DeviceMemory>> dsend, drecv;
  std::vector<std::vector<int64_t>> recv_counts(n, std::vector<int64_t>(n));
  std::vector<int64_t> recv_total(n, 0);
  for (int s = 0; s < n; ++s) {
    for (int d = 0; d < n; ++d) {
      for (int64_t i = 0; i < counts[s][d]; ++i) send[s].push_back(1000.f * s + 100.f * d + i);
      recv_counts[d][s] = counts[s][d];
      recv_total[d] += counts[s][d];
    }
  }
  for (int r = 0; r < n; ++r) {
    dsend.push_back(std::make_unique<test::DeviceMemory>(send[r].size() * sizeof(float)));
    if (!send[r].empty()) dsend.back()->upload(send[r].data());
    drecv.push_back(std::make_unique<test::DeviceMemory>(recv_total[r] * sizeof(float)));
    std::vector<float> nan(recv_total[r], std::numeric_limits<float>::quiet_NaN());
    if (!nan.empty()) drecv.back()->upload(nan.data());
  }
  for (int r = 0; r < n; ++r) {
    comm->all_to_all(r, {dsend[r]->as<float>(), send[r].size()}, counts[r],
                     {drecv[r]->as<float>(), static_cast<size_t>(recv_total[r])}, recv_counts[r]);
  }
  comm->barrier(0);
  comm->barrier(1);
  comm->barrier(2);
  for (int d = 0; d < n; ++d) {
    std::vector<float> got(recv_total[d]);
    if (!got.empty()) drecv[d]->download(got.data());
    size_t at = 0;
    for (int s = 0; s < n; ++s) {
      for (int64_t i = 0; i < counts[s][d]; ++i, ++at) {
        EXPECT_EQ(got[at], 1000.f * s + 100.f * d + i)
            << "rank " << d << " block from rank " << s << " element " << i;
      }
    }
  }
  // all_gather of 5 floats per rank.
  std::vector<std::unique_ptr<test::DeviceMemory>> gs, gr;
  for (int r = 0; r < n; ++r) {
    std::vector<float> v(5);
    for (int i = 0; i < 5; ++i) v[i] = 10.f * r + i;
    gs.push_back(std::make_unique<test::DeviceMemory>(5 * sizeof(float)));
    gs.back()->upload(v.data());
    gr.push_back(std::make_unique<test::DeviceMemory>(5 * n * sizeof(float)));
  }
  for (int r = 0; r < n; ++r) {
    comm->all_gather(r, {gs[r]->as<float>(), 5}, {gr[r]->as<float>(), static_cast<size_t>(5 * n)});
  }
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  for (int d = 0; d < n; ++d) {
    std::vector<float> got(5 * n);
    gr[d]->download(got.data());
    for (int s = 0; s < n; ++s) {
      for (int i = 0; i < 5; ++i) {
        EXPECT_EQ(got[s * 5 + i], 10.f * s + i) << "all_gather: rank " << d << " block " << s;
      }
    }
  }
  // Counts that do not pair up.
  std::vector<int64_t> one(n, 1), two(n, 2);
  test::DeviceMemory buf(16 * sizeof(float));
  const std::span<float> b(buf.as<float>(), 16);
  comm->all_to_all(0, b, one, b, one);
  comm->all_to_all(1, b, one, b, one);
  test::expect_error([&] { comm->all_to_all(2, b, two, b, one); },
                     {"rank 2 sends 2 floats to rank 0, which expects 1"});
}

// A rank over NCCL: skipped, with the reason, without a GPU or where NCCL cannot be loaded.
class CudaDcpNccl : public testing::Test {
 protected:
  void SetUp() override {
    SKIP_WITHOUT_GPU();
    if (const std::string why = nccl_unavailable_reason(); !why.empty()) {
      GTEST_SKIP() << "NCCL: " << why;
    }
    seed_ = test::test_seed();
    trace_.emplace(__FILE__, __LINE__, "ATTNRT_TEST_SEED=" + std::to_string(seed_));
  }
  uint32_t seed_ = 0;
  std::optional<testing::ScopedTrace> trace_;
};

// The NCCL path of a rank (one rank per GPU): a DcpRank over a group of 1 GPU
// (make_nccl_group({0})), GPU tensors, its all-to-all a send to itself through NCCL, against one
// `reference` runtime: an EXTEND prefill of two requests, an EXTEND over the prefix and two decodes,
// every layer of the GQA model. Skips, with the reason, where NCCL cannot be loaded.
TEST_F(CudaDcpNccl, OneRankGroupMatchesReference) {
  std::mt19937 rng(seed_);
  const std::vector<int> devices = {0};
  std::vector<std::unique_ptr<Communicator>> comms = make_nccl_group(devices);
  ASSERT_EQ(comms.size(), 1u);
  const ModelSpec model = test::dcp_gqa_model();
  Options ref_opts;
  ref_opts.attention_backend = "reference";
  ref_opts.page_size = 1;
  Options o = ref_opts;
  o.attention_backend = "cuda";
  const RuntimeConfig cfg = test::host_config(4, 2048, 64);
  AttentionRuntime ref(model, ref_opts, cfg);
  DcpRank rank(0, model, o, cfg, *comms[0]);
  const std::vector<int64_t> rows = {ref.req_to_token().alloc(), ref.req_to_token().alloc()};
  auto step = [&](ForwardBatch b, const std::string& what) {
    test::place_on(ref, b);
    const StepLayout lay = make_step_layout(b);
    const int64_t T = b.num_tokens();
    ref.begin_step(b);
    rank.check_step(b, lay);
    rank.begin_step(b);
    for (const LayerSpec& l : model.layers) {
      const int hq = l.num_q_heads, hkv = l.num_kv_heads, d = l.head_dim, dv = l.v_head_dim;
      HostBuffer q = test::random_buffer(DType::bf16, {T, hq, d}, rng);
      HostBuffer k = test::random_buffer(DType::bf16, {T, hkv, d}, rng);
      HostBuffer v = test::random_buffer(DType::bf16, {T, hkv, dv}, rng);
      std::vector<float> sinks(hq, 0.5f);
      HostBuffer out1(DType::bf16, {T, hq, dv}), outn(DType::bf16, {T, hq, dv});
      HostBuffer lse1(DType::f32, {T, hq}), lsen(DType::f32, {T, hq});
      for (const HostBuffer* p : {&out1, &outn, &lse1, &lsen}) test::poison(p->view());
      AttnArgs a{.q = q.view(), .k = k.view(), .v = v.view(), .out = out1.view(),
                 .lse = lse1.view()};
      a.sinks = l.has_sinks ? sinks.data() : nullptr;
      ref.forward(l.layer_id, a);
      test::DevTensor dq(q.view()), dk(k.view()), dvv(v.view()), dout(outn.view()),
          dlse(lsen.view());
      AttnArgs g = a;
      g.q = dq.view;
      g.k = dk.view;
      g.v = dvv.view;
      g.out = dout.view;
      g.lse = dlse.view;
      rank.forward(l.layer_id, g);
      rank.merge(l.layer_id, g);
      rank.synchronize();
      dout.download(outn.view());
      dlse.download(lsen.view());
      const std::string name = "1 cuda rank over NCCL, " + what + ", layer " +
                               std::to_string(l.layer_id);
      test::expect_close(outn.view(), out1.view(), kOutTol, name + " out [T, Hq, Dv]");
      test::expect_close(lsen.view(), lse1.view(), kLseTol, name + " lse [T, Hq]");
    }
    ref.end_step();
    rank.end_step();
  };
  step(make_extend_batch(rows, {0, 0}, {37, 20}), "prefill");
  step(make_extend_batch(rows, {37, 20}, {5, 9}), "extend over a prefix");
  step(make_decode_batch(rows, {43, 30}), "decode");
  step(make_decode_batch(rows, {44, 31}), "decode 2");
}

// ---- ranks on an engine's stream (DcpAttention / DcpRank::set_stream, docs/dcp.md) -------------

// A GPU delay on the step's stream before every layer's inputs are copied there: work that is not
// in that stream's order (a kernel on the legacy stream, an exchange on another) runs long before
// the inputs have arrived, or reads outputs not written yet.
constexpr uint64_t kInputDelayNs = 2'000'000;

// How a group is driven: begin_step; one layer with GPU tensors, ordered after the work queued on
// `stream` and before the work queued there after it; end_step.
struct Driver {
  std::function<void(const ForwardBatch&)> begin;
  std::function<void(int, const AttnArgs&)> forward;
  std::function<void()> end;
  cudaStream_t stream = nullptr;  // where the inputs are made and the outputs read back
};

Driver drive(DcpAttention& g, cudaStream_t stream) {
  return {[&g](const ForwardBatch& b) { g.begin_step(b); },
          [&g](int layer, const AttnArgs& a) { g.forward(layer, a); }, [&g] { g.end_step(); },
          stream};
}

// Prompts of 3 requests, an extend over them, two decodes, a chain verify and two decodes after a
// random acceptance.
std::vector<ForwardBatch> stream_steps(std::mt19937& rng) {
  auto rand_int = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  const std::vector<int64_t> rows = {0, 1, 2};
  std::vector<int32_t> len = {rand_int(1, 60), rand_int(1, 60), rand_int(1, 60)};
  std::vector<ForwardBatch> steps = {make_extend_batch(rows, {0, 0, 0}, len)};
  const std::vector<int32_t> ext = {rand_int(1, 9), rand_int(1, 9), rand_int(1, 9)};
  steps.push_back(make_extend_batch(rows, len, ext));
  for (size_t i = 0; i < rows.size(); ++i) len[i] += ext[i];
  for (int step = 0; step < 4; ++step) {
    if (step == 2) {
      steps.push_back(make_verify_batch(rows, len, SpecInfo::chain(3, 4)));
      for (int32_t& l : len) l += rand_int(1, 4);  // the accepted drafts
    }
    for (int32_t& l : len) ++l;
    steps.push_back(make_decode_batch(rows, len));
  }
  for (ForwardBatch& b : steps) b.out_cache_loc.assign(b.positions.size(), 0);
  return steps;
}

// Every layer of every step through `d`, the inputs of (step, layer) drawn from `seed`: copied
// from pinned memory on d.stream behind kInputDelayNs, the outputs poisoned (NaN) there first and
// read back into pinned memory after the forward; the host waits once per step. Returns the bytes
// of each layer's out and lse.
std::vector<std::vector<uint8_t>> run_steps(const Driver& d, const ModelSpec& model,
                                            const std::vector<ForwardBatch>& steps, uint32_t seed) {
  std::vector<std::vector<uint8_t>> results;
  for (size_t i = 0; i < steps.size(); ++i) {
    const ForwardBatch& b = steps[i];
    const int64_t T = b.num_tokens();
    d.begin(b);
    std::vector<std::unique_ptr<test::DeviceMemory>> dev;
    std::vector<std::unique_ptr<test::PinnedMem>> pinned;
    std::vector<std::pair<const uint8_t*, size_t>> back;  // the outputs, read after the step
    for (const LayerSpec& l : model.layers) {
      std::mt19937 rng(seed + 1000 * static_cast<uint32_t>(i) + l.layer_id);
      const int hq = l.num_q_heads, dv = l.v_head_dim > 0 ? l.v_head_dim : l.head_dim;
      const bool mla = l.kind == LayerKind::mla;
      std::vector<HostBuffer> in;
      in.push_back(test::random_buffer(DType::bf16, {T, hq, l.head_dim}, rng));
      in.push_back(test::random_buffer(DType::bf16, {T, l.num_kv_heads, l.head_dim}, rng));
      if (!mla) in.push_back(test::random_buffer(DType::bf16, {T, l.num_kv_heads, dv}, rng));
      std::vector<float> sinks(hq);
      for (float& x : sinks) x = std::normal_distribution<float>(0.f, 1.f)(rng);
      HostBuffer out(DType::bf16, {T, hq, dv}), lse(DType::f32, {T, hq});
      // Every buffer first (an allocation may wait for the device), then the delay and the copies.
      std::vector<TensorView> views;
      for (const HostBuffer* h : {&in[0], &in[1], mla ? nullptr : &in[2], &out, &lse}) {
        if (h == nullptr) continue;
        const size_t bytes = static_cast<size_t>(h->view().numel()) * dtype_size(h->view().dtype);
        dev.push_back(std::make_unique<test::DeviceMemory>(bytes));
        pinned.push_back(std::make_unique<test::PinnedMem>(bytes));
        std::memcpy(pinned.back()->ptr, h->view().data, bytes);
        TensorView v = h->view();
        v.data = dev.back()->ptr;
        v.device = Device::cuda(0);
        views.push_back(v);
      }
      EXPECT_EQ(cuda::launch_gpu_delay(kInputDelayNs, d.stream), cudaSuccess);
      const size_t first = dev.size() - views.size();
      for (size_t j = 0; j < views.size(); ++j) {
        test::DeviceMemory& m = *dev[first + j];
        const bool output = j + 2 >= views.size();
        EXPECT_EQ(output ? cudaMemsetAsync(m.ptr, 0xFF, m.bytes, d.stream)
                         : cudaMemcpyAsync(m.ptr, pinned[first + j]->ptr, m.bytes,
                                           cudaMemcpyHostToDevice, d.stream),
                  cudaSuccess);
      }
      AttnArgs a;
      a.q = views[0];
      a.k = views[1];
      if (!mla) a.v = views[2];
      a.out = views[views.size() - 2];
      a.lse = views.back();
      a.sinks = l.has_sinks ? sinks.data() : nullptr;
      d.forward(l.layer_id, a);
      for (size_t j = views.size() - 2; j < views.size(); ++j) {
        const test::DeviceMemory& m = *dev[first + j];
        EXPECT_EQ(cudaMemcpyAsync(pinned[first + j]->ptr, m.ptr, m.bytes, cudaMemcpyDeviceToHost,
                                  d.stream),
                  cudaSuccess);
        back.emplace_back(static_cast<const uint8_t*>(pinned[first + j]->ptr), m.bytes);
      }
    }
    d.end();
    EXPECT_EQ(cudaStreamSynchronize(d.stream), cudaSuccess);
    for (const auto& [p, n] : back) results.emplace_back(p, p + n);
  }
  return results;
}

// got and want output by output (each layer's out, then its lse, step after step), bit for bit.
void expect_same_bits(const std::vector<std::vector<uint8_t>>& got,
                      const std::vector<std::vector<uint8_t>>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    const auto at = std::mismatch(got[i].begin(), got[i].end(), want[i].begin());
    EXPECT_TRUE(got[i].size() == want[i].size() && at.first == got[i].end())
        << what << ": output " << i << " (" << (i % 2 ? "lse" : "out")
        << ") differs from the legacy stream's from byte " << (at.first - got[i].begin());
  }
}

Options stream_options(int ranks) {
  Options o;
  o.attention_backend = "cuda";
  o.page_size = 1;
  o.dcp_size = ranks;
  o.deterministic = true;
  return o;
}

using test::Stream;

// A group moved to a non-blocking stream (set_stream: every rank, its kernels and the device
// exchange there) whose inputs are made on that stream just before each forward gives the bits of
// the group on the legacy default stream: 2 and 3 ranks, GQA with soft-cap, sinks and a window,
// and MLA.
TEST(CudaDcpStreams, GroupOnANonBlockingStreamGivesTheLegacyStreamsBits) {
  SKIP_WITHOUT_GPU();
  const uint32_t seed = test::test_seed();
  SCOPED_TRACE("ATTNRT_TEST_SEED=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const RuntimeConfig cfg = test::host_config(6, 4096, 256);
  for (const int n : {2, 3}) {
    for (const ModelSpec& model : {test::dcp_gqa_model(), test::dcp_mla_model()}) {
      const std::vector<ForwardBatch> steps = stream_steps(rng);
      Stream s;  // outlives the ranks on it
      DcpAttention legacy(model, stream_options(n), cfg), moved(model, stream_options(n), cfg);
      moved.set_stream(s.s);
      ASSERT_EQ(moved.stream(), s.s);
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(moved.rank(r).stream(), s.s) << "rank " << r;
        EXPECT_EQ(moved.rank(r).runtime().stream(), s.s) << "rank " << r;
        EXPECT_EQ(moved.communicator().stream(r), s.s) << "rank " << r;
      }
      const auto want = run_steps(drive(legacy, nullptr), model, steps, seed);
      const auto got = run_steps(drive(moved, s.s), model, steps, seed);
      expect_same_bits(got, want, model.name + " on " + std::to_string(n) + " ranks");
    }
  }
}

// Ranks on streams of their own (a device_in_process communicator made with one stream per rank,
// which each rank takes as its stream), driven as an engine of one process would: they wait for
// the stream that made the inputs, the exchange orders itself with events, and that stream waits
// for every rank. The bits of the group on the legacy stream. A rank is not moved while its
// collective is pending.
TEST(CudaDcpStreams, RanksOnStreamsOfTheirOwnGiveTheLegacyGroupsBits) {
  SKIP_WITHOUT_GPU();
  const uint32_t seed = test::test_seed();
  SCOPED_TRACE("ATTNRT_TEST_SEED=" + std::to_string(seed));
  std::mt19937 rng(seed);
  const int n = 3;
  const ModelSpec model = test::dcp_gqa_model();
  const RuntimeConfig cfg = test::host_config(6, 4096, 256);
  const std::vector<ForwardBatch> steps = stream_steps(rng);
  Stream made, own[n];
  std::vector<void*> streams;
  for (const Stream& s : own) streams.push_back(s.s);
  std::unique_ptr<Communicator> comm = make_device_in_process_communicator(n, streams);
  std::vector<std::unique_ptr<DcpRank>> ranks;
  for (int r = 0; r < n; ++r) {
    ranks.push_back(std::make_unique<DcpRank>(r, model, stream_options(n), cfg, *comm));
    EXPECT_EQ(ranks[r]->stream(), streams[r]) << "rank " << r << " did not take its stream";
  }
  cudaEvent_t ready = nullptr, done[n] = {};
  ASSERT_EQ(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), cudaSuccess);
  for (cudaEvent_t& e : done) {
    ASSERT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
  }
  Driver d;
  d.stream = made.s;
  d.begin = [&](const ForwardBatch& b) {
    for (auto& r : ranks) r->begin_step(b);
  };
  d.forward = [&](int layer, const AttnArgs& a) {
    EXPECT_EQ(cudaEventRecord(ready, made.s), cudaSuccess);
    for (int r = 0; r < n; ++r) EXPECT_EQ(cudaStreamWaitEvent(own[r].s, ready, 0), cudaSuccess);
    for (auto& r : ranks) r->forward(layer, a);
    for (auto& r : ranks) r->merge(layer, a);
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(cudaEventRecord(done[r], own[r].s), cudaSuccess);
      EXPECT_EQ(cudaStreamWaitEvent(made.s, done[r], 0), cudaSuccess);
    }
  };
  d.end = [&] {
    for (auto& r : ranks) r->end_step();
  };
  DcpAttention legacy(model, stream_options(n), cfg);
  const auto want = run_steps(drive(legacy, nullptr), model, steps, seed);
  expect_same_bits(run_steps(d, model, steps, seed), want, "3 ranks on streams of their own");
  cudaEventDestroy(ready);
  for (cudaEvent_t e : done) cudaEventDestroy(e);

  test::DeviceMemory buf(16 * sizeof(float));
  const std::span<float> b(buf.as<float>(), 16);
  const std::vector<int64_t> one(n, 1);
  comm->all_to_all(0, b, one, b, one);
  test::expect_error([&] { ranks[0]->set_stream(nullptr); },
                     {"set_stream of rank 0 while its all_to_all is pending"});
  EXPECT_EQ(ranks[0]->stream(), streams[0]);
  for (int r = 1; r < n; ++r) comm->all_to_all(r, b, one, b, one);
  ranks[0]->set_stream(nullptr);
  EXPECT_EQ(comm->stream(0), nullptr);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// One rank over NCCL (a group of this GPU) moved to a non-blocking stream: its collectives go
// there too (the communicator's stream follows the rank's), with the bits of a group of one rank
// on the legacy stream.
TEST_F(CudaDcpNccl, OneRankOnANonBlockingStreamGivesTheLegacyGroupsBits) {
  const uint32_t seed = seed_;
  std::mt19937 rng(seed);
  const ModelSpec model = test::dcp_gqa_model();
  const RuntimeConfig cfg = test::host_config(6, 4096, 256);
  const std::vector<ForwardBatch> steps = stream_steps(rng);
  const std::vector<int> devices = {0};
  std::vector<std::unique_ptr<Communicator>> comms = make_nccl_group(devices);
  Stream s;  // outlives the rank on it
  DcpRank rank(0, model, stream_options(1), cfg, *comms[0]);
  EXPECT_EQ(rank.stream(), nullptr);
  rank.set_stream(s.s);
  EXPECT_EQ(comms[0]->stream(0), s.s);
  Driver d;
  d.stream = s.s;
  d.begin = [&](const ForwardBatch& b) { rank.begin_step(b); };
  d.forward = [&](int layer, const AttnArgs& a) {
    rank.forward(layer, a);
    rank.merge(layer, a);
  };
  d.end = [&] { rank.end_step(); };
  DcpAttention legacy(model, stream_options(1), cfg);
  const auto want = run_steps(drive(legacy, nullptr), model, steps, seed);
  expect_same_bits(run_steps(d, model, steps, seed), want, "1 rank over NCCL");
}

// page_size > 1 with cuda ranks for a model with a sliding-window layer is refused with the
// reason; without one it is taken.
TEST(CudaDcpErrors, PageSizeAndDevices) {
  SKIP_WITHOUT_GPU();
  Options o;
  o.attention_backend = "cuda";
  o.dcp_size = 2;
  o.page_size = 16;
  test::expect_error([&] { DcpAttention(test::dcp_gqa_model(), o, test::host_config(4, 1024, 64)); },
                     {"dcp_size = 2", "page_size 16", "layer 2", "sliding window (9)",
                      "page_size 1"});
  DcpAttention ok(test::dcp_full_model(), o, test::host_config(4, 1024, 64));
  EXPECT_EQ(ok.size(), 2);
}

#endif  // ATTNRT_HAS_CUDA

}  // namespace
}  // namespace attnrt
