#include "tools/io/npy.h"

#include <fmt/ranges.h>

#include <bit>
#include <cstring>
#include <fstream>
#include <sstream>
#include <optional>
#include <string_view>

#include "attnrt/core/error.h"

namespace attnrt {

static_assert(std::endian::native == std::endian::little,
              "the .npy reader and writer assume a little-endian host");

namespace {

constexpr char kMagic[] = "\x93NUMPY";
constexpr size_t kMagicLen = 6;

struct Descr {
  std::string_view text;
  DType dtype;
};
// Written with the first spelling; '=' (native) and '|' are read as little endian too.
constexpr Descr kDescrs[] = {
    {"<f4", DType::f32},  {"<f2", DType::f16}, {"<u2", DType::bf16}, {"<i4", DType::i32},
    {"<i8", DType::i64},  {"|u1", DType::u8},  {"=f4", DType::f32},  {"=f2", DType::f16},
    {"=u2", DType::bf16}, {"=i4", DType::i32}, {"=i8", DType::i64},  {"<u1", DType::u8},
    {"=u1", DType::u8},   {"|b1", DType::u8},
};

std::string_view descr_of(DType t) {
  switch (t) {
    case DType::f32:
      return "<f4";
    case DType::f16:
      return "<f2";
    case DType::bf16:
      return "<u2";
    case DType::i32:
      return "<i4";
    case DType::i64:
      return "<i8";
    case DType::u8:
    case DType::e4m3:
    case DType::e5m2:
      return "|u1";
  }
  return "";
}

std::string shape_str(std::span<const int64_t> shape) {
  return fmt::format("[{}]", fmt::join(shape, ", "));
}

// The header is a Python dict literal; numpy writes the three keys in a fixed form, but other
// writers vary spacing, quote style and key order, so each key is looked up on its own.
class HeaderParser {
 public:
  HeaderParser(std::string_view text, const std::string& path) : text_(text), path_(path) {}

  std::string_view value_of(std::string_view key) const {
    for (char q : {'\'', '"'}) {
      const std::string quoted = fmt::format("{}{}{}", q, key, q);
      const size_t at = text_.find(quoted);
      if (at == std::string_view::npos) continue;
      size_t p = text_.find(':', at + quoted.size());
      if (p == std::string_view::npos) break;
      ++p;
      while (p < text_.size() && text_[p] == ' ') ++p;
      return text_.substr(p);
    }
    fail("{}: malformed .npy header: no '{}' entry in {}", path_, key, text_);
  }

  std::string descr() const {
    std::string_view v = value_of("descr");
    if (v.empty() || (v[0] != '\'' && v[0] != '"')) bad("descr");
    const size_t end = v.find(v[0], 1);
    if (end == std::string_view::npos) bad("descr");
    return std::string(v.substr(1, end - 1));
  }

  bool fortran_order() const {
    std::string_view v = value_of("fortran_order");
    if (v.starts_with("True")) return true;
    if (v.starts_with("False")) return false;
    bad("fortran_order");
  }

  std::vector<int64_t> shape() const {
    std::string_view v = value_of("shape");
    if (v.empty() || v[0] != '(') bad("shape");
    const size_t end = v.find(')');
    if (end == std::string_view::npos) bad("shape");
    std::vector<int64_t> dims;
    std::string_view body = v.substr(1, end - 1);
    size_t p = 0;
    while (p < body.size()) {
      while (p < body.size() && (body[p] == ' ' || body[p] == ',')) ++p;
      if (p >= body.size()) break;
      int64_t x = 0;
      size_t digits = 0;
      while (p < body.size() && body[p] >= '0' && body[p] <= '9') {
        x = x * 10 + (body[p] - '0');
        ++p;
        ++digits;
        if (x > (int64_t{1} << 48)) bad("shape");
      }
      if (digits == 0) bad("shape");
      while (p < body.size() && body[p] == 'L') ++p;  // Python 2 longs
      dims.push_back(x);
    }
    return dims;
  }

 private:
  [[noreturn]] void bad(std::string_view key) const {
    fail("{}: malformed .npy header: cannot parse '{}' in {}", path_, key, text_);
  }
  std::string_view text_;
  const std::string& path_;
};

int64_t product(std::span<const int64_t> shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// Bytes of the data of `shape` in `dtype`; nullopt when the extents other than 0 multiply past
// 2^62 bytes, so that neither the size nor any stride of a view (an empty array's included)
// overflows.
std::optional<int64_t> data_bytes(std::span<const int64_t> shape, DType dtype) {
  int64_t n = static_cast<int64_t>(dtype_size(dtype));
  bool empty = false;
  for (int64_t d : shape) {
    if (d == 0) {
      empty = true;
      continue;
    }
    if (n > (int64_t{1} << 62) / d) return std::nullopt;
    n *= d;
  }
  return empty ? 0 : n;
}

}  // namespace

int64_t NpyArray::numel() const { return product(shape); }

TensorView NpyArray::view() const {
  ATTNRT_CHECK(static_cast<int>(shape.size()) <= kMaxDims,
               "{}: array has {} dims; a tensor view holds at most {}",
               origin.empty() ? "array" : origin, shape.size(), kMaxDims);
  TensorView v;
  v.data = const_cast<uint8_t*>(bytes.data());
  v.dtype = dtype;
  v.ndim = static_cast<int>(shape.size());
  int64_t stride = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = shape[d];
    v.strides[d] = stride;
    stride *= shape[d];
  }
  return v;
}

void NpyArray::expect(DType want, std::span<const int64_t> want_shape) {
  const std::string where = origin.empty() ? std::string("array") : origin;
  const bool raw_fp8 = is_fp8(want) && dtype == DType::u8;
  ATTNRT_CHECK(dtype == want || raw_fp8, "{}: dtype {} ('{}'), expected {} ('{}')", where,
               dtype_name(dtype), descr_of(dtype), dtype_name(want), descr_of(want));
  bool same = want_shape.size() == shape.size();
  for (size_t i = 0; same && i < shape.size(); ++i) {
    same = want_shape[i] < 0 || want_shape[i] == shape[i];
  }
  if (!same) {
    fail("{}: shape {} does not match the expected {} (-1 = any)", where, shape_str(shape),
         shape_str(want_shape));
  }
  if (raw_fp8) dtype = want;
}

NpyArray make_npy(DType dtype, std::span<const int64_t> shape, const void* data) {
  NpyArray a;
  a.dtype = dtype;
  a.shape.assign(shape.begin(), shape.end());
  for (int64_t d : shape) {
    ATTNRT_CHECK(d >= 0, "make_npy: shape {} has a negative extent", shape_str(shape));
  }
  const size_t n = static_cast<size_t>(product(shape)) * dtype_size(dtype);
  a.bytes.resize(n);
  if (n > 0 && data != nullptr) std::memcpy(a.bytes.data(), data, n);
  return a;
}

NpyArray npy_from_tensor_f32(const TensorView& t) {
  ATTNRT_CHECK(is_float(t.dtype), "npy_from_tensor_f32: tensor {} is not of a float dtype",
               t.describe());
  ATTNRT_CHECK(t.device.kind == DeviceKind::cpu,
               "npy_from_tensor_f32: tensor {} is not in host memory", t.describe());
  NpyArray a;
  a.dtype = DType::f32;
  a.shape.assign(t.shape.begin(), t.shape.begin() + t.ndim);
  const int64_t n = t.numel();
  a.bytes.resize(static_cast<size_t>(n) * 4);
  float* out = a.as<float>();
  // Walk the logical indices in C order and gather through the strides.
  std::array<int64_t, kMaxDims> idx{};
  for (int64_t i = 0; i < n; ++i) {
    int64_t off = 0;
    for (int d = 0; d < t.ndim; ++d) off += idx[d] * t.strides[d];
    out[i] = load_as_float(t.data, t.dtype, static_cast<size_t>(off));
    for (int d = t.ndim - 1; d >= 0; --d) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
  return a;
}

void write_npy(const std::string& path, const NpyArray& array) {
  write_npy(path, array.dtype, array.shape, array.bytes.data());
}

void write_npy(const std::string& path, DType dtype, std::span<const int64_t> shape,
               const void* data) {
  // Python tuple syntax: "()", "(5,)", "(2, 3)".
  std::string dims = fmt::format("{}", fmt::join(shape, ", "));
  if (shape.size() == 1) dims += ",";
  std::string dict = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': ({}), }}",
                                 descr_of(dtype), dims);
  // Total header (magic, version, length field, dict, padding, '\n') is a multiple of 64 bytes.
  const bool v1 = dict.size() + 1 + kMagicLen + 4 <= 65535;
  const size_t prefix = kMagicLen + 2 + (v1 ? 2 : 4);
  const size_t total = (prefix + dict.size() + 1 + 63) / 64 * 64;
  dict.append(total - prefix - dict.size() - 1, ' ');
  dict.push_back('\n');

  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  ATTNRT_CHECK(out.good(), "cannot create '{}' for writing", path);
  out.write(kMagic, kMagicLen);
  const char version[2] = {static_cast<char>(v1 ? 1 : 2), 0};
  out.write(version, 2);
  const auto len = static_cast<uint32_t>(dict.size());
  out.write(reinterpret_cast<const char*>(&len), v1 ? 2 : 4);
  out.write(dict.data(), static_cast<std::streamsize>(dict.size()));
  const auto n =
      static_cast<std::streamsize>(product(shape) * static_cast<int64_t>(dtype_size(dtype)));
  if (n > 0) out.write(static_cast<const char*>(data), n);
  out.flush();
  ATTNRT_CHECK(out.good(), "writing '{}' failed (disk full or not writable?)", path);
}

NpyArray parse_npy(std::string_view file, const std::string& path) {
  const auto file_size = static_cast<int64_t>(file.size());
  if (file.size() < kMagicLen + 2 || std::memcmp(file.data(), kMagic, kMagicLen) != 0) {
    fail("{}: not a .npy file (bad magic; expected \\x93NUMPY)", path);
  }
  const int major = static_cast<uint8_t>(file[kMagicLen]);
  ATTNRT_CHECK(major >= 1 && major <= 3,
               "{}: .npy format version {}.{} is not supported (1.0, 2.0 and 3.0 are)", path, major,
               static_cast<uint8_t>(file[kMagicLen + 1]));
  const size_t len_bytes = major == 1 ? 2 : 4;
  ATTNRT_CHECK(file.size() >= kMagicLen + 2 + len_bytes,
               "{}: truncated .npy header (the file ends inside the header length, {} bytes)", path,
               file_size);
  uint32_t header_len = 0;
  std::memcpy(&header_len, file.data() + kMagicLen + 2, len_bytes);
  const int64_t data_start = static_cast<int64_t>(kMagicLen + 2 + len_bytes) + header_len;
  ATTNRT_CHECK(data_start <= file_size,
               "{}: truncated .npy header ({} header bytes announced, file has {} bytes)", path,
               header_len, file_size);
  const std::string header(file.substr(kMagicLen + 2 + len_bytes, header_len));
  const HeaderParser parser(header, path);
  const std::string descr = parser.descr();
  std::optional<DType> dtype;
  for (const auto& d : kDescrs) {
    if (d.text == descr) dtype = d.dtype;
  }
  if (!dtype) {
    if (descr.size() == 3 && descr[0] == '>') {
      fail(
          "{}: big-endian data ('{}') is not supported; save it little endian "
          "(array.astype(array.dtype.newbyteorder('<')))",
          path, descr);
    }
    fail(
        "{}: dtype '{}' is not supported; supported: '<f4' float32, '<f2' float16, '<u2' bf16 "
        "bits, '<i4' int32, '<i8' int64, '|u1' uint8 / fp8 bytes",
        path, descr);
  }
  if (parser.fortran_order()) {
    fail("{}: Fortran-order data is not supported; save a C-order array (np.ascontiguousarray)",
         path);
  }
  NpyArray a;
  a.dtype = *dtype;
  a.shape = parser.shape();
  a.origin = path;
  ATTNRT_CHECK(a.shape.size() <= static_cast<size_t>(kMaxDims),
               "{}: {} dims; at most {} are supported", path, a.shape.size(), kMaxDims);
  const int64_t have = file_size - data_start;
  const std::optional<int64_t> want = data_bytes(a.shape, a.dtype);
  ATTNRT_CHECK(want.has_value(),
               "{}: shape {} of '{}' is too large: its extents other than 0 span more than 2^62 "
               "bytes",
               path, shape_str(a.shape), descr);
  ATTNRT_CHECK(have == *want, "{}: shape {} of '{}' needs {} data bytes, the file has {} ({})",
               path, shape_str(a.shape), descr, *want, have,
               have < *want ? "truncated" : "trailing bytes");
  a.bytes.assign(file.begin() + data_start, file.end());
  return a;
}

NpyArray read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open '{}': no such file or not readable", path);
  std::ostringstream text;
  text << in.rdbuf();
  ATTNRT_CHECK(!in.bad(), "{}: read error", path);
  return parse_npy(text.str(), path);
}

}  // namespace attnrt
