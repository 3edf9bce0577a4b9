// The NCCL communicator (communicator.h, docs/dcp.md "Over NCCL"): its errors where NCCL cannot
// be used, and on a GPU machine the collectives of a group of every visible GPU (one per rank,
// a thread each) against the data each rank sent, a group joined through a unique id, and the
// misuse errors.
#include <gtest/gtest.h>

#include <numeric>
#include <random>
#include <thread>
#include <vector>

#include "attnrt/core/device.h"
#include "attnrt/runtime/communicator.h"
#include "tests/test_cuda_util.h"
#include "tests/test_util.h"

namespace attnrt {
namespace {

#define SKIP_WITHOUT_NCCL()                                                               \
  do {                                                                                    \
    SKIP_WITHOUT_GPU();                                                                   \
    if (const std::string why = nccl_unavailable_reason(); !why.empty())                  \
      GTEST_SKIP() << "NCCL unavailable: " << why;                                         \
  } while (0)

TEST(Nccl, UnavailableSaysWhyAndWhatToDo) {
  const std::string why = nccl_unavailable_reason();
  if (why.empty()) {
    // Usable: the size-only factory cannot make a rank and says what to call instead.
    test::expect_error([] { make_communicator("nccl", 2); },
                       {"'nccl' of 2 ranks", "make_nccl_communicator", "make_nccl_group"});
    EXPECT_GE(nccl_version(), 21800);
    return;
  }
  test::expect_error([] { make_communicator("nccl", 2); },
                     {"'nccl'", why, "one GPU per rank", "in_process"});
  // The library loads without a GPU (where it is installed): its version, or why not.
  if (built_with_cuda()) {
    try {
      EXPECT_GE(nccl_version(), 21800);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("libnccl.so.2"), std::string::npos) << e.what();
    }
  }
  test::expect_error([] { nccl_unique_id(); }, {"NCCL:", why});
  test::expect_error([] { make_nccl_communicator(NcclUniqueId{}, 1, 0, 0); }, {"NCCL:", why});
  const int devices[] = {0};
  test::expect_error([&] { make_nccl_group(devices); }, {"NCCL:", why});
}

#ifdef ATTNRT_HAS_CUDA

struct DeviceFloats {
  float* ptr = nullptr;
  size_t n = 0;
  DeviceFloats(int device, size_t count) : n(count) {
    cudaSetDevice(device);
    EXPECT_EQ(cudaMalloc(reinterpret_cast<void**>(&ptr), std::max<size_t>(n, 1) * sizeof(float)), cudaSuccess);
  }
  ~DeviceFloats() { cudaFree(ptr); }
  std::span<float> span() const { return {ptr, n}; }
};

// Every rank sends rank-and-destination-specific random blocks of random sizes to every rank
// (itself included) and gathers one block from each; each rank on its own thread and GPU.
TEST(Nccl, GroupOfEveryGpuMovesEachRanksBlocks) {
  SKIP_WITHOUT_NCCL();
  const int n = std::min(query_cuda().device_count, 8);
  std::vector<int> devices(n);
  std::iota(devices.begin(), devices.end(), 0);
  auto comms = make_nccl_group(devices);
  ASSERT_EQ(comms.size(), static_cast<size_t>(n));
  EXPECT_EQ(comms[0]->name(), "nccl");
  EXPECT_EQ(comms[0]->size(), n);

  const uint32_t seed = test::test_seed();
  std::mt19937 rng(seed);
  // counts[s][d]: floats rank s sends to rank d; data[s][d]: those floats.
  std::vector<std::vector<int64_t>> counts(n, std::vector<int64_t>(n));
  std::vector<std::vector<std::vector<float>>> data(n, std::vector<std::vector<float>>(n));
  std::normal_distribution<float> value(0.f, 1.f);
  for (int s = 0; s < n; ++s) {
    for (int d = 0; d < n; ++d) {
      counts[s][d] = std::uniform_int_distribution<int64_t>(0, 3000)(rng);
      for (int64_t i = 0; i < counts[s][d]; ++i) data[s][d].push_back(value(rng));
    }
  }
  const int64_t gather_count = 777;
  std::vector<std::vector<float>> gather(n);
  for (int s = 0; s < n; ++s) {
    for (int64_t i = 0; i < gather_count; ++i) gather[s].push_back(value(rng));
  }

  std::vector<std::vector<float>> received(n), gathered(n);
  std::vector<std::string> errors(n);
  auto rank_main = [&](int r) {
    try {
      std::vector<int64_t> send_counts = counts[r], recv_counts(n);
      std::vector<float> send;
      for (int d = 0; d < n; ++d) {
        recv_counts[d] = counts[d][r];
        send.insert(send.end(), data[r][d].begin(), data[r][d].end());
      }
      const int64_t recv_total = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
      DeviceFloats dsend(devices[r], send.size()), drecv(devices[r], recv_total);
      DeviceFloats gsend(devices[r], gather_count), grecv(devices[r], gather_count * n);
      // Poisoned receive buffers: an unwritten element shows.
      cudaMemset(drecv.ptr, 0xff, std::max<int64_t>(recv_total, 1) * sizeof(float));
      cudaMemset(grecv.ptr, 0xff, gather_count * n * sizeof(float));
      cudaMemcpy(dsend.ptr, send.data(), send.size() * sizeof(float), cudaMemcpyHostToDevice);
      cudaMemcpy(gsend.ptr, gather[r].data(), gather_count * sizeof(float), cudaMemcpyHostToDevice);
      cudaDeviceSynchronize();
      comms[r]->all_to_all(r, dsend.span(), send_counts, drecv.span(), recv_counts);
      comms[r]->all_gather(r, gsend.span(), grecv.span());
      comms[r]->barrier(r);
      received[r].resize(recv_total);
      gathered[r].resize(gather_count * n);
      cudaMemcpy(received[r].data(), drecv.ptr, recv_total * sizeof(float), cudaMemcpyDeviceToHost);
      cudaMemcpy(gathered[r].data(), grecv.ptr, gather_count * n * sizeof(float),
                 cudaMemcpyDeviceToHost);
    } catch (const std::exception& e) {
      errors[r] = e.what();
    }
  };
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) threads.emplace_back(rank_main, r);
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < n; ++r) ASSERT_EQ(errors[r], "") << "rank " << r << " (seed " << seed << ")";

  for (int r = 0; r < n; ++r) {
    std::vector<float> want, want_gather;
    for (int s = 0; s < n; ++s) {
      want.insert(want.end(), data[s][r].begin(), data[s][r].end());
      want_gather.insert(want_gather.end(), gather[s].begin(), gather[s].end());
    }
    EXPECT_EQ(received[r], want) << "all_to_all at rank " << r << " (seed " << seed << ")";
    EXPECT_EQ(gathered[r], want_gather) << "all_gather at rank " << r << " (seed " << seed << ")";
  }
}

// The multi-process way in: an id from nccl_unique_id(), every rank joining with it (here the
// one-rank group of device 0), then a collective.
TEST(Nccl, UniqueIdJoinsAGroup) {
  SKIP_WITHOUT_NCCL();
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  {
    auto comm = make_nccl_communicator(nccl_unique_id(), 1, 0, 0, stream);
    EXPECT_EQ(comm->size(), 1);
    std::vector<float> host(1000);
    std::iota(host.begin(), host.end(), 1.f);
    DeviceFloats a(0, host.size()), b(0, host.size());
    cudaMemcpy(a.ptr, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice);
    cudaMemset(b.ptr, 0xff, host.size() * sizeof(float));
    const int64_t counts[] = {static_cast<int64_t>(host.size())};
    comm->all_to_all(0, a.span(), counts, b.span(), counts);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    std::vector<float> back(host.size());
    cudaMemcpy(back.data(), b.ptr, back.size() * sizeof(float), cudaMemcpyDeviceToHost);
    EXPECT_EQ(back, host);
  }
  cudaStreamDestroy(stream);
}

TEST(Nccl, MisuseIsAnErrorThatNamesIt) {
  SKIP_WITHOUT_NCCL();
  const int devices[] = {0};
  auto comms = make_nccl_group(devices);
  Communicator& c = *comms[0];
  DeviceFloats buf(0, 64);
  const int64_t one[] = {8}, two[] = {8, 8}, too_many[] = {100};
  test::expect_error([&] { c.all_to_all(1, buf.span(), one, buf.span(), one); },
                     {"all_to_all called for rank 1", "communicator of rank 0", "its own rank"});
  test::expect_error([&] { c.all_to_all(0, buf.span(), two, buf.span(), two); },
                     {"has 2 send and 2 recv counts", "group has 1 ranks"});
  test::expect_error([&] { c.all_to_all(0, buf.span(), too_many, buf.span(), too_many); },
                     {"sends 100 floats from a buffer of 64"});
  test::expect_error([&] { c.all_gather(0, buf.span(), buf.span().first(10)); },
                     {"all_gather of rank 0 sends 64 floats", "buffer of 10", "needs 64"});
  const int twice[] = {0, 0};
  test::expect_error([&] { make_nccl_group(twice); },
                     {"ranks 0 and 1 are both on device 0", "one GPU per rank"});
  const int absent[] = {query_cuda().device_count};
  test::expect_error([&] { make_nccl_group(absent); }, {"device", "CUDA devices 0.."});
  test::expect_error([] { make_nccl_communicator(NcclUniqueId{}, 2, 2, 0); },
                     {"rank 2 of a group of 2", "ranks are 0..size-1"});
  test::expect_error([] { wrap_nccl_comm(nullptr); }, {"null ncclComm_t"});
}

#endif  // ATTNRT_HAS_CUDA

}  // namespace
}  // namespace attnrt
