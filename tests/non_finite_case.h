// The NaN / infinity rule of docs/backends.md as a check of one backend against reference,
// shared by the cpu test (tests/test_reliability.cpp) and the cuda one
// (tests/test_cuda_nonfinite.cpp).
#pragma once

#include <gtest/gtest.h>
#include <fmt/format.h>

#include <cmath>
#include <functional>
#include <limits>
#include <vector>

#include "attnrt/backend/registry.h"
#include "attnrt/core/dtype.h"
#include "tests/conformance/conformance.h"
#include "tests/test_util.h"

namespace attnrt::test {

// NaN and infinity (docs/backends.md): a row whose q, or the K or V of a key it attends to, holds
// a NaN or an infinity is NaN; every other row is unaffected.

struct NonFiniteCase {
  const char* what;
  conformance::CaseSpec spec;
  // Puts the bad value in; returns nothing. Rows expected NaN are given by `nan_row`.
  std::function<void(conformance::ConformanceCase&)> poison;
  std::function<bool(int64_t token, int head)> nan_row;
  // -1: a NaN row is NaN in every element; else only this output dim must be NaN (the others
  // finite): a non-finite V element on a backend that keeps the NaN in its own dim.
  int nan_dim = -1;
};

// How a backend's row holds a NaN that came from V (docs/backends.md "NaN and infinity").
enum class VNanRow { whole_row, own_dim };

// `backend` against reference on extend and decode steps of each of `dtypes`: NaN (and with
// `infinities`, an infinity) in one q row, or in the K or V row of a key that every row of a
// request attends to; those rows must be NaN on both, every other row finite and close.
inline void check_non_finite(const char* backend, const std::vector<DType>& dtypes,
                             bool infinities, VNanRow v_nan = VNanRow::whole_row) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const float inf = std::numeric_limits<float>::infinity();
  const int hq = 4, hkv = 2, d = 64;
  for (DType dt : dtypes) {
    for (ForwardMode mode : {ForwardMode::EXTEND, ForwardMode::DECODE}) {
      conformance::CaseSpec s;
      s.label = "non-finite";
      s.seed = 5;
      s.mode = mode;
      s.kv_dtype = s.act_dtype = dt;
      s.page_size = 16;
      s.prefix_lens = {40, 33};
      s.query_lens =
          mode == ForwardMode::DECODE ? std::vector<int32_t>{1, 1} : std::vector<int32_t>{5, 19};
      s.layers = {test::attention_layer(0, hq, hkv, d)};
      const int64_t t0 = s.query_lens[0];  // first token of request 1
      // Request 0's first query row, head 1: NaN or inf in q.
      auto in_q = [&](float x) {
        return [=](conformance::ConformanceCase& c) { c.values[0].q[1 * d + 3] = x; };
      };
      auto q_row = [](int64_t t, int h) { return t == 0 && h == 1; };
      // Request 1's prefix position 7 (attended by every row of request 1), kv head 1: NaN or inf
      // in K or V; q heads 2 and 3 read kv head 1.
      const int64_t key = s.prefix_lens[0] + 7;
      // An infinite K element with a positive q element gives a +inf score. (A -inf score gives
      // the key weight 0 on cpu but a NaN row on reference: the gap docs/backends.md names.)
      const int64_t T = t0 + s.query_lens[1];
      auto in_k = [&](float x) {
        return [=](conformance::ConformanceCase& c) {
          c.values[0].prefix_k[(key * hkv + 1) * d + 5] = x;
          for (int64_t t = t0; t < T; ++t) {
            for (int h = 2; h < hq; ++h) {
              float& qe = c.values[0].q[(t * hq + h) * d + 5];
              qe = std::fabs(qe) + 0.5f;
            }
          }
        };
      };
      auto in_v = [&](float x) {
        return [=](conformance::ConformanceCase& c) {
          c.values[0].prefix_v[(key * hkv + 1) * d + 5] = x;
        };
      };
      auto kv_rows = [t0](int64_t t, int h) { return t >= t0 && h >= 2; };
      std::vector<NonFiniteCase> cases = {
          {"NaN in q", s, in_q(nan), q_row},
          {"NaN in K", s, in_k(nan), kv_rows},
          {"NaN in V", s, in_v(nan), kv_rows, v_nan == VNanRow::own_dim ? 5 : -1},
      };
      if (infinities) {
        cases.push_back({"inf in q", s, in_q(-inf), q_row});
        cases.push_back({"inf in K", s, in_k(inf), kv_rows});
        cases.push_back({"inf in V", s, in_v(inf), kv_rows});
      }
      for (const NonFiniteCase& nc : cases) {
        SCOPED_TRACE(fmt::format("{} {} {}", nc.what, dtype_name(dt), forward_mode_name(mode)));
        conformance::ConformanceCase c = conformance::make_case(nc.spec);
        nc.poison(c);
        const BackendEntry& ref_entry = Registry::global().get("reference");
        const BackendEntry& cpu_entry = Registry::global().get(backend);
        auto ref_inst = conformance::materialize(c);
        auto cpu_inst = conformance::materialize(c);
        const HostBuffer ref = std::move(conformance::run_backend(ref_entry, c, *ref_inst).out[0]);
        const HostBuffer cpu = std::move(conformance::run_backend(cpu_entry, c, *cpu_inst).out[0]);
        const int64_t T = ref.view().shape[0];
        int64_t wrong = 0;
        for (int64_t t = 0; t < T; ++t) {
          for (int h = 0; h < hq; ++h) {
            for (int e = 0; e < d; ++e) {
              const size_t i = static_cast<size_t>((t * hq + h) * d + e);
              const float a = load_as_float(cpu.data(), dt, i),
                          b = load_as_float(ref.data(), dt, i);
              const bool nan_row = nc.nan_row(t, h);
              const bool want_nan = nan_row && (nc.nan_dim < 0 || e == nc.nan_dim);
              // (reference NaNs the whole row; a backend keeping V's NaN in its own dim leaves
              // the row's other elements finite, not comparable with reference's NaN.)
              const bool ok = want_nan  ? std::isnan(a) && std::isnan(b)
                              : nan_row ? std::isfinite(a)
                                        : std::isfinite(a) && std::fabs(a - b) <= 2e-2;
              if (!ok && ++wrong <= 3) {
                ADD_FAILURE() << "token " << t << " head " << h << " dim " << e << ": " << backend << " " << a
                              << ", reference " << b << (want_nan ? " (want NaN)" : "");
              }
            }
          }
        }
      }
    }
  }
}

}  // namespace attnrt::test
