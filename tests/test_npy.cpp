#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>

#include "attnrt/core/error.h"
#include "tools/io/npy.h"
#include "tests/test_util.h"
#include "tools/io/npy.h"

using namespace attnrt;

namespace {

class NpyTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("attnrt_npy_" + std::to_string(std::random_device{}()));
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string path(const char* name) const { return (dir_ / name).string(); }

  // Writes a file by hand: magic, version, header dict padded to `align`, then `data_bytes`.
  std::string raw_file(const char* name, int major, const std::string& dict, size_t data_bytes,
                       const char* magic = "\x93NUMPY") const {
    std::string header = dict;
    const size_t prefix = 6 + 2 + (major == 1 ? 2 : 4);
    while ((prefix + header.size() + 1) % 64 != 0) header.push_back(' ');
    header.push_back('\n');
    std::string bytes(magic, 6);
    bytes.push_back(static_cast<char>(major));
    bytes.push_back(0);
    const auto len = static_cast<uint32_t>(header.size());
    bytes.append(reinterpret_cast<const char*>(&len), major == 1 ? 2 : 4);
    bytes += header;
    std::mt19937 rng(3);
    for (size_t i = 0; i < data_bytes; ++i) bytes.push_back(static_cast<char>(rng()));
    const std::string p = path(name);
    std::ofstream(p, std::ios::binary) << bytes;
    return p;
  }

  std::filesystem::path dir_;
};

using attnrt::test::error_of;

// A header dict as NumPy writes it.
std::string npy_dict(const std::string& descr, const std::string& shape = "(2,)",
                     const std::string& fortran = "False") {
  return "{'descr': '" + descr + "', 'fortran_order': " + fortran + ", 'shape': " + shape + ", }";
}

}  // namespace

TEST_F(NpyTest, RoundTripsEveryDtypeAndShape) {
  std::mt19937 rng(11);
  const DType dtypes[] = {DType::f32, DType::f16, DType::bf16, DType::i32, DType::i64, DType::u8};
  const std::vector<std::vector<int64_t>> shapes = {{}, {1}, {7}, {3, 5}, {2, 0, 4}, {2, 3, 4, 5}};
  for (DType t : dtypes) {
    for (const auto& shape : shapes) {
      SCOPED_TRACE(std::string(dtype_name(t)) + " ndim " + std::to_string(shape.size()));
      int64_t n = 1;
      for (int64_t d : shape) n *= d;
      std::vector<uint8_t> data(static_cast<size_t>(n) * dtype_size(t));
      for (auto& b : data) b = static_cast<uint8_t>(rng());
      const std::string p = path("a.npy");
      write_npy(p, t, shape, data.data());
      const NpyArray a = read_npy(p);
      EXPECT_EQ(a.dtype, t);
      EXPECT_EQ(a.shape, shape);
      EXPECT_EQ(a.bytes, data);
      EXPECT_EQ(a.origin, p);
      // NumPy aligns the data to 64 bytes.
      EXPECT_EQ((std::filesystem::file_size(p) - data.size()) % 64, 0u);
    }
  }
}

TEST_F(NpyTest, WritesTheHeaderNumpyWrites) {
  const float data[6] = {1, 2, 3, 4, 5, 6};
  const std::string p = path("golden.npy");
  write_npy(p, DType::f32, std::vector<int64_t>{2, 3}, data);
  std::ifstream in(p, std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  // np.save(np.arange(1, 7, dtype='<f4').reshape(2, 3)) writes exactly this 128-byte header.
  std::string want("\x93NUMPY\x01\x00\x76\x00", 10);
  want += "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  want.append(127 - want.size(), ' ');
  want += "\n";
  ASSERT_EQ(bytes.size(), 128u + sizeof data);
  EXPECT_EQ(bytes.substr(0, 128), want);
  EXPECT_EQ(std::memcmp(bytes.data() + 128, data, sizeof data), 0);

  write_npy(p, DType::i64, std::vector<int64_t>{5}, std::vector<int64_t>(5, 9).data());
  std::ifstream in1(p, std::ios::binary);
  std::string one((std::istreambuf_iterator<char>(in1)), std::istreambuf_iterator<char>());
  EXPECT_NE(one.find("'descr': '<i8', 'fortran_order': False, 'shape': (5,), }"),
            std::string::npos);
}

TEST_F(NpyTest, ReadsVersion2AndOtherWritersHeaders) {
  const std::string p = raw_file(
      "v2.npy", 2, R"({"shape": (4, 2), "fortran_order": False, "descr": "<i4"})", 4 * 2 * 4);
  const NpyArray a = read_npy(p);
  EXPECT_EQ(a.dtype, DType::i32);
  EXPECT_EQ(a.shape, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(a.bytes.size(), 32u);
}

TEST_F(NpyTest, BadFilesNameTheFileAndTheProblem) {
  struct Case {
    std::string file;
    const char* expect;
  };
  const Case cases[] = {
      {raw_file("magic.npy", 1, npy_dict("<f4", "(1,)"), 4, "\x93NUMPZ"), "bad magic"},
      {raw_file("version.npy", 4, npy_dict("<f4", "(1,)"), 4),
       "format version 4.0 is not supported"},
      {raw_file("big.npy", 1, npy_dict(">f4"), 8), "big-endian data ('>f4')"},
      {raw_file("complex.npy", 1, npy_dict("<c8"), 16), "dtype '<c8' is not supported"},
      {raw_file("fortran.npy", 1, npy_dict("<f4", "(2, 2)", "True"), 16), "Fortran-order data"},
      {raw_file("short.npy", 1, npy_dict("<f4", "(2, 3)"), 20),
       "needs 24 data bytes, the file has 20 (truncated)"},
      {raw_file("long.npy", 1, npy_dict("<i8"), 17),
       "needs 16 data bytes, the file has 17 (trailing bytes)"},
      {raw_file("noshape.npy", 1, "{'descr': '<f4', 'fortran_order': False, }", 4),
       "no 'shape' entry"},
      {raw_file("badshape.npy", 1, npy_dict("<f4", "(a,)"), 4), "cannot parse 'shape'"},
      {path("missing.npy"), "cannot open"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.file);
    const std::string msg = error_of([&] { read_npy(c.file); });
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.file), std::string::npos) << msg;
  }
}

TEST_F(NpyTest, ExpectChecksDtypeAndShapeAndRelabelsFp8Bytes) {
  std::vector<uint8_t> bytes(2 * 3 * 4);
  std::mt19937 rng(5);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  const std::string p = path("e.npy");
  write_npy(p, DType::e4m3, std::vector<int64_t>{2, 3, 4}, bytes.data());
  NpyArray a = read_npy(p);
  EXPECT_EQ(a.dtype, DType::u8);
  a.expect(DType::e4m3, {2, -1, 4});
  EXPECT_EQ(a.dtype, DType::e4m3);
  EXPECT_EQ(a.bytes, bytes);

  NpyArray b = read_npy(p);
  std::string msg = error_of([&] { b.expect(DType::u8, {2, 4, 3}); });
  EXPECT_NE(msg.find("shape [2, 3, 4] does not match the expected [2, 4, 3]"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find(p), std::string::npos) << msg;
  msg = error_of([&] { b.expect(DType::f32, {2, 3, 4}); });
  EXPECT_NE(msg.find("dtype uint8 ('|u1'), expected fp32 ('<f4')"), std::string::npos) << msg;
  msg = error_of([&] { b.expect(DType::u8, {24}); });
  EXPECT_NE(msg.find("does not match"), std::string::npos) << msg;
}

TEST_F(NpyTest, TensorToFloat32FollowsStrides) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> dist(-4.f, 4.f);
  const int64_t rows = 5, cols = 7;
  std::vector<uint16_t> bf(rows * cols);
  for (auto& x : bf) x = float_to_bf16(dist(rng));
  // A transposed view: element (i, j) of the view is bf[j * cols + i].
  TensorView t(bf.data(), DType::bf16, {cols, rows});
  t.strides = {1, cols};
  const NpyArray a = npy_from_tensor_f32(t);
  ASSERT_EQ(a.shape, (std::vector<int64_t>{cols, rows}));
  for (int64_t i = 0; i < cols; ++i) {
    for (int64_t j = 0; j < rows; ++j) {
      EXPECT_EQ(a.as<float>()[i * rows + j], bf16_to_float(bf[j * cols + i]));
    }
  }
  std::vector<int32_t> ints(4);
  const std::string msg =
      error_of([&] { npy_from_tensor_f32(TensorView(ints.data(), DType::i32, {4})); });
  EXPECT_NE(msg.find("not of a float dtype"), std::string::npos) << msg;
}

// Issue 21 (fuzz_npy): extents each within the parser's 2^48 bound whose product overflowed int64
// (undefined behaviour: the size check, or the strides of an empty array's view). Such a shape is
// refused before any arithmetic overflows, and so is a file that ends inside its header length.
TEST_F(NpyTest, ShapesTooLargeToAddressAreRefused) {
  const std::string huge =
      raw_file("huge.npy", 1, npy_dict("<f4", "(1099511627776, 1099511627776, 1099511627776)"), 0);
  const std::string msg = error_of([&] { read_npy(huge); });
  EXPECT_NE(msg.find("is too large"), std::string::npos) << msg;
  EXPECT_NE(msg.find(huge), std::string::npos) << msg;
  // An empty array's view still has strides: the extents other than 0 must not overflow them.
  const std::string empty =
      raw_file("empty.npy", 1, npy_dict("<f4", "(0, 1099511627776, 1099511627776)"), 0);
  EXPECT_NE(error_of([&] { read_npy(empty); }).find("is too large"), std::string::npos);
  const NpyArray fine = read_npy(raw_file("fine.npy", 1, npy_dict("<f4", "(0, 1024, 1024)"), 0));
  EXPECT_EQ(fine.view().strides[0], 1024 * 1024);
  const std::string cut = path("cut.npy");
  std::ofstream(cut, std::ios::binary) << std::string("\x93NUMPY\x02\x00\x10", 9);
  EXPECT_NE(error_of([&] { read_npy(cut); }).find("truncated .npy header"), std::string::npos);
}

TEST_F(NpyTest, ParseNpyReadsTheFileBytesFromMemory) {
  const std::string file = raw_file("one.npy", 1, npy_dict("<i4", "(1,)"), 4);
  std::ifstream in(file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const NpyArray a = parse_npy(bytes, "in memory");
  EXPECT_EQ(a.dtype, DType::i32);
  EXPECT_EQ(a.shape, std::vector<int64_t>{1});
  EXPECT_EQ(a.origin, "in memory");
  EXPECT_EQ(a.bytes.size(), 4u);
  const std::string msg = error_of([&] { parse_npy(bytes.substr(0, 12), "cut"); });
  EXPECT_NE(msg.find("cut: truncated .npy header"), std::string::npos) << msg;
}
