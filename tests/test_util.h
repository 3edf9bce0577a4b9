// Helpers shared by the test files: expected errors and their messages, text checks, small layer
// specs, random buffers, and running the command-line tool.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <iterator>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "attnrt/core/error.h"
#include "attnrt/core/tensor.h"
#include "attnrt/model/model_spec.h"
#include "attnrt/runtime/attention_runtime.h"

namespace attnrt::test {

// Runs fn and expects an attnrt::Error whose message contains every fragment.
inline void expect_error(const std::function<void()>& fn, const std::vector<std::string>& fragments) {
  try {
    fn();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const std::string& f : fragments) {
      EXPECT_NE(msg.find(f), std::string::npos) << "missing '" << f << "' in: " << msg;
    }
    return;
  }
  ADD_FAILURE() << "no attnrt::Error thrown; expected one mentioning '" << fragments.front() << "'";
}

// The message of the attnrt::Error that fn throws, or `if_none` where it throws none.
inline std::string error_or(const std::function<void()>& fn, const std::string& if_none) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return if_none;
}

// The message of the attnrt::Error that fn throws; a failure, and "", where it throws none.
inline std::string error_of(const std::function<void()>& fn) {
  bool returned = false;
  std::string msg = error_or(
      [&] {
        fn();
        returned = true;
      },
      "");
  if (returned) ADD_FAILURE() << "expected attnrt::Error";
  return msg;
}

// Expects `text` to contain every fragment.
inline void expect_contains(const std::string& text, const std::vector<std::string>& fragments) {
  for (const std::string& f : fragments) {
    EXPECT_NE(text.find(f), std::string::npos) << "missing '" << f << "' in:\n" << text;
  }
}

// A full-attention layer `id`: `hq` query and `hkv` KV heads of `dim`, values of `v_dim` (0: dim).
inline LayerSpec attention_layer(int id, int hq, int hkv, int dim, int v_dim = 0) {
  LayerSpec l;
  l.layer_id = id;
  l.num_q_heads = hq;
  l.num_kv_heads = hkv;
  l.head_dim = dim;
  l.v_head_dim = v_dim > 0 ? v_dim : dim;
  return l;
}

// A buffer of `dtype` and `shape` filled with N(0, 1) values drawn from `rng`.
inline HostBuffer random_buffer(DType dtype, std::initializer_list<int64_t> shape,
                                std::mt19937& rng) {
  HostBuffer b(dtype, shape);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (int64_t i = 0; i < b.numel(); ++i) {
    store_from_float(b.data(), dtype, static_cast<size_t>(i), dist(rng));
  }
  return b;
}

// Fills t (any float dtype) with N(0, 1) samples of rng.
inline void fill_normal(const TensorView& t, std::mt19937& rng) {
  std::normal_distribution<float> d(0.f, 1.f);
  for (int64_t i = 0; i < t.numel(); ++i) store_from_float(t.data, t.dtype, i, d(rng));
}

// Fills t with NaN, so that an element a call should write and does not shows up.
inline void poison(const TensorView& t) {
  for (int64_t i = 0; i < t.numel(); ++i) {
    store_from_float(t.data, t.dtype, i, std::numeric_limits<float>::quiet_NaN());
  }
}

// Every element of got within tol * (1 + |want|) of want (NaN fails); names the first few.
inline void expect_close(const TensorView& got, const TensorView& want, double tol,
                         const std::string& what) {
  ASSERT_EQ(got.numel(), want.numel());
  int64_t bad = 0;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = load_as_float(got.data, got.dtype, i);
    const double e = load_as_float(want.data, want.dtype, i);
    if (!(std::abs(g - e) <= tol * (1.0 + std::abs(e)))) {
      if (bad++ < 3) ADD_FAILURE() << what << "[" << i << "] = " << g << ", expected " << e;
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

// A model of `layers`: activations of `dtype`, sequences of up to `max_context_len` tokens.
inline ModelSpec make_model(std::string name, DType dtype, int max_context_len,
                            std::vector<LayerSpec> layers) {
  return ModelSpec{.name = std::move(name),
                   .dtype = dtype,
                   .max_context_len = max_context_len,
                   .layers = std::move(layers)};
}

// Every dimension of two linear-attention layers agrees.
inline void expect_same_linear_dims(const LinearSpec& a, const LinearSpec& b) {
  const auto dims = [](const LinearSpec& s) {
    return std::tuple(s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim, s.d_state,
                      s.n_groups, s.conv_kernel, s.chunk_size);
  };
  EXPECT_EQ(dims(a), dims(b));
}

// The row of `rows` named `name`.
template <typename Row>
const Row& by_name(const std::vector<Row>& rows, const std::string& name) {
  for (const Row& r : rows) {
    if (r.name == name) return r;
  }
  throw std::runtime_error("no row " + name);
}

// The whole text of a file ("" where it cannot be read).
inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Exit status (-1: did not exit normally), stdout and stderr of a command.
struct CommandResult {
  int status = -1;
  std::string out, err;
};

// Runs `'cli' args` in a shell, stdin from /dev/null, stdout and stderr captured in files of `dir`.
inline CommandResult run_cli(const std::string& cli, const std::string& args,
                             const std::filesystem::path& dir) {
  const std::string out = (dir / "stdout.txt").string(), err = (dir / "stderr.txt").string();
  const std::string cmd = "'" + cli + "' " + args + " >'" + out + "' 2>'" + err + "' </dev/null";
  const int raw = std::system(cmd.c_str());
  CommandResult r;
  r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

// A test of the command-line tool (its path in ATTNRT_CLI, which ctest sets) in a folder of its
// own.
class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* cli = std::getenv("ATTNRT_CLI");
    if (cli == nullptr || *cli == '\0') GTEST_SKIP() << "ATTNRT_CLI is not set (ctest sets it)";
    cli_ = cli;
    dir_ = std::filesystem::path(::testing::TempDir()) /
           ("attnrt_cli_" + std::to_string(getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  CommandResult run(const std::string& args) { return run_cli(cli_, args, dir_); }

  std::string cli_;
  std::filesystem::path dir_;
};

// A runtime's config for host tests: sizes as given, CUDA graphs off.
inline RuntimeConfig host_config(int max_requests, int64_t kv_slots, int max_num_tokens,
                                 int max_context_len = 0) {
  RuntimeConfig c;
  c.max_requests = max_requests;
  c.kv_slots = kv_slots;
  c.max_num_tokens = max_num_tokens;
  if (max_context_len > 0) c.max_context_len = max_context_len;
  c.cuda_graphs = false;
  return c;
}

// A new request row of `len` tokens: slots from the runtime's allocator, written into the row;
// returns the row and the slots.
inline std::pair<int, std::vector<int64_t>> new_request(AttentionRuntime& rt, int32_t len) {
  const int row = rt.req_to_token().alloc();
  const std::vector<int32_t> zero{0}, lens{len};
  const std::vector<int64_t> none{-1};
  std::vector<int64_t> slots = rt.allocator().alloc_extend(zero, lens, none);
  rt.req_to_token().write(row, 0, slots);
  return {row, std::move(slots)};
}

}  // namespace attnrt::test
