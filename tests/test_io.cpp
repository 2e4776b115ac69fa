// io: replace-by-rename file writes and the safetensors format. Files are checked
// byte for byte against hand-built expectations and parsed independently with
// nlohmann::json; every corruption the loader must catch is built by hand and must give
// its own error naming the file.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "io/atomic_file.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "io/utf8.h"
#include "test_util.h"

using namespace esplag;
namespace fs = std::filesystem;

namespace {

class IoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() /
           ("esplag_test_io_" + std::to_string(::getpid()) + "_" + info->test_suite_name() + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::vector<std::string> listing() const {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(dir_)) names.push_back(e.path().filename().string());
    std::sort(names.begin(), names.end());
    return names;
  }

  fs::path dir_;
};

// Independent of the library under test.
std::string slurp(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
void spit(const std::string& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}
std::string le64(uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}
uint64_t read_le64(const std::string& s) {
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(s[i]);
  return n;
}
// A safetensors file from a header text and a data buffer, as another writer might make it.
std::string st_file(const std::string& header, const std::string& data) { return le64(header.size()) + header + data; }

// Runs fn, expecting an esplag::Error whose message holds every one of `parts`.
template <typename Fn>
void expect_error(Fn&& fn, const std::vector<std::string>& parts) {
  try {
    fn();
    ADD_FAILURE() << "expected an esplag::Error mentioning '" << parts.front() << "'";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "'" << p << "' not in: " << msg;
  }
}

Tensor random_tensor(const std::string& name, const Shape& shape, DType dt, Rng& rng) {
  Tensor t = Tensor::zeros(shape, dt, name);
  auto* p = static_cast<unsigned char*>(t.raw());
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(rng.below(256));
  return t;
}

std::vector<Tensor> every_dtype_tensors() {
  Rng rng(42);
  return {random_tensor("w.f32", {2, 3}, DType::f32, rng),   random_tensor("w.f64", {3, 2}, DType::f64, rng),
          random_tensor("h.bf16", {7}, DType::bf16, rng),    random_tensor("h.f16", {3}, DType::f16, rng),
          random_tensor("idx", {5}, DType::i32, rng),        random_tensor("u16", {1, 1, 3}, DType::u16, rng),
          random_tensor("bytes", {11}, DType::u8, rng),      random_tensor("scalar", {}, DType::f32, rng),
          random_tensor("empty", {0, 4}, DType::f32, rng)};
}

const std::map<std::string, std::string> kMeta = {
    {"format", "test-1"},
    {"text", "line1\nline2 \"quoted\" \\ back\tslash"},
    {"unicode", "h\xc3\xa9llo \xe2\x9c\x93"},
    {"empty", ""}};

// Buffer order the reference writer uses: descending dtype alignment, then name.
const std::vector<std::string> kExpectedOrder = {"w.f64", "empty", "scalar", "w.f32", "idx",
                                                 "h.bf16", "h.f16", "u16",   "bytes"};

}  // namespace

// ---------------------------------------------------------------- atomic files

TEST_F(IoTest, AtomicWriteCreatesAndReplaces) {
  const std::string p = path("a.txt");
  write_file_atomic(p, std::string("hello"));
  EXPECT_EQ(slurp(p), "hello");
  write_file_atomic(p, std::string("a longer replacement"));
  EXPECT_EQ(slurp(p), "a longer replacement");
  write_file_atomic(p, std::string());
  EXPECT_TRUE(fs::exists(p));
  EXPECT_EQ(fs::file_size(p), 0u);
  EXPECT_EQ(listing(), std::vector<std::string>{"a.txt"});
}

TEST_F(IoTest, AtomicWriteStreamsThroughTemporaryFile) {
  const std::string p = path("b.bin");
  spit(p, "old");
  const std::string tmp = p + ".tmp." + std::to_string(::getpid());
  write_file_atomic(p, [&](FileSink& sink) {
    EXPECT_EQ(sink.path(), p);
    sink.write("new ");
    // Mid-write the target still holds its old content and the bytes go elsewhere.
    EXPECT_EQ(slurp(p), "old");
    EXPECT_TRUE(fs::exists(tmp));
    const std::string big(3 << 20, 'x');
    sink.write(big.data(), big.size());
    sink.write("end");
    EXPECT_EQ(sink.bytes_written(), 4u + (3u << 20) + 3u);
  });
  const std::string got = slurp(p);
  ASSERT_EQ(got.size(), 4u + (3u << 20) + 3u);
  EXPECT_EQ(got.substr(0, 4), "new ");
  EXPECT_EQ(got.substr(got.size() - 3), "end");
  EXPECT_FALSE(fs::exists(tmp));
}

TEST_F(IoTest, FailingWriterLeavesExistingFileIntact) {
  const std::string p = path("keep.txt");
  spit(p, "precious content");
  EXPECT_THROW(write_file_atomic(p,
                                 [](FileSink& sink) {
                                   sink.write("partial replacement that must never be seen");
                                   throw std::runtime_error("writer failed");
                                 }),
               std::runtime_error);
  EXPECT_EQ(slurp(p), "precious content");
  EXPECT_EQ(listing(), std::vector<std::string>{"keep.txt"});  // no temporary file left behind

  // An esplag::Error from the writer propagates unchanged too.
  expect_error([&] { write_file_atomic(p, [](FileSink&) { fail("custom reason 17"); }); }, {"custom reason 17"});
  EXPECT_EQ(slurp(p), "precious content");
  EXPECT_EQ(listing(), std::vector<std::string>{"keep.txt"});
}

TEST_F(IoTest, FailingWriterOnNewFileCreatesNothing) {
  const std::string p = path("new.txt");
  EXPECT_THROW(write_file_atomic(p, [](FileSink& s) {
    s.write("x");
    throw std::runtime_error("no");
  }),
               std::runtime_error);
  EXPECT_TRUE(listing().empty());
}

TEST_F(IoTest, AtomicWriteIntoMissingDirectoryThrows) {
  const std::string p = path("no_such_dir/f.txt");
  expect_error([&] { write_file_atomic(p, std::string("x")); },
               {p, std::strerror(ENOENT), "does not exist"});
  EXPECT_FALSE(fs::exists(dir_ / "no_such_dir"));
}

TEST_F(IoTest, AtomicWriteOverDirectoryFailsCleanly) {
  fs::create_directories(dir_ / "d");
  expect_error([&] { write_file_atomic(path("d"), std::string("x")); }, {path("d"), "renaming"});
  EXPECT_EQ(listing(), std::vector<std::string>{"d"});
}

TEST_F(IoTest, AtomicWriteKeepsPermissions) {
  const std::string p = path("private.txt");
  spit(p, "secret");
  ::chmod(p.c_str(), 0600);
  write_file_atomic(p, std::string("new secret"));
  struct stat st;
  ASSERT_EQ(::stat(p.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  EXPECT_EQ(slurp(p), "new secret");
}

TEST_F(IoTest, ReadFile) {
  const std::string p = path("r.bin");
  std::string bytes("a\0b\xff\n", 5);
  spit(p, bytes);
  EXPECT_EQ(read_file(p), bytes);
  spit(p, "");
  EXPECT_EQ(read_file(p), "");
  expect_error([&] { read_file(path("missing.txt")); }, {path("missing.txt"), "does not exist"});
  expect_error([&] { read_file(dir_.string()); }, {dir_.string(), "directory"});
}

// ---------------------------------------------------------------- safetensors

TEST_F(IoTest, SafetensorsRoundTripEveryDtype) {
  const std::string p = path("all.safetensors");
  const std::vector<Tensor> in = every_dtype_tensors();
  save_safetensors(p, in, kMeta);
  EXPECT_EQ(listing(), std::vector<std::string>{"all.safetensors"});

  const SafetensorsFile f = load_safetensors(p);
  EXPECT_EQ(f.metadata, kMeta);
  ASSERT_EQ(f.tensors.size(), in.size());
  for (const Tensor& t : in) {
    auto it = f.tensors.find(t.name());
    ASSERT_NE(it, f.tensors.end()) << t.name();
    const Tensor& got = it->second;
    EXPECT_EQ(got.name(), t.name());
    EXPECT_EQ(got.dtype(), t.dtype()) << t.name();
    EXPECT_EQ(got.shape(), t.shape()) << t.name();
    EXPECT_TRUE(got.owns_storage());
    ASSERT_EQ(got.nbytes(), t.nbytes());
    EXPECT_EQ(std::memcmp(got.raw(), t.raw(), t.nbytes()), 0) << t.name();
  }

  // Saving what was loaded gives the same bytes: the layout depends only on the content.
  std::vector<Tensor> again;
  for (const auto& [name, t] : f.tensors) again.push_back(t);
  const std::string p2 = path("again.safetensors");
  save_safetensors(p2, again, f.metadata);
  EXPECT_EQ(slurp(p2), slurp(p));
}

TEST_F(IoTest, SafetensorsHeaderFollowsTheSpec) {
  const std::string p = path("spec.safetensors");
  const std::vector<Tensor> in = every_dtype_tensors();
  save_safetensors(p, in, kMeta);
  const std::string raw = slurp(p);
  ASSERT_GE(raw.size(), 8u);
  const uint64_t n = read_le64(raw);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_LE(8 + n, raw.size());
  const std::string header = raw.substr(8, n);
  EXPECT_EQ(header.front(), '{');
  const size_t close = header.find_last_of('}');
  for (size_t i = close + 1; i < header.size(); ++i) EXPECT_EQ(header[i], ' ') << "padding must be spaces";
  EXPECT_LT(header.size() - close - 1, 8u);

  const auto js = nlohmann::ordered_json::parse(header);
  ASSERT_TRUE(js.is_object());
  auto it = js.begin();
  ASSERT_EQ(it.key(), "__metadata__");
  for (const auto& [k, v] : kMeta) EXPECT_EQ(it.value().at(k).get<std::string>(), v);
  EXPECT_EQ(it.value().size(), kMeta.size());

  const uint64_t buffer = raw.size() - 8 - n;
  uint64_t expected_begin = 0;
  std::vector<std::string> order;
  const std::map<std::string, std::pair<std::string, size_t>> dtype_of = {
      {"w.f64", {"F64", 8}}, {"w.f32", {"F32", 4}}, {"scalar", {"F32", 4}}, {"empty", {"F32", 4}},
      {"idx", {"I32", 4}},   {"h.bf16", {"BF16", 2}}, {"h.f16", {"F16", 2}}, {"u16", {"U16", 2}},
      {"bytes", {"U8", 1}}};
  for (++it; it != js.end(); ++it) {
    const std::string name = it.key();
    order.push_back(name);
    const auto& e = it.value();
    ASSERT_EQ(e.size(), 3u) << name;
    const Tensor* t = nullptr;
    for (const Tensor& x : in)
      if (x.name() == name) t = &x;
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(e.at("dtype").get<std::string>(), dtype_of.at(name).first);
    EXPECT_EQ(e.at("shape").get<std::vector<int64_t>>(), t->shape());
    const auto off = e.at("data_offsets").get<std::vector<uint64_t>>();
    ASSERT_EQ(off.size(), 2u);
    EXPECT_EQ(off[0], expected_begin) << name << ": tensors must be packed in header order";
    EXPECT_EQ(off[1] - off[0], t->nbytes()) << name;
    EXPECT_EQ((8 + n + off[0]) % dtype_of.at(name).second, 0u) << name << " is misaligned in the file";
    EXPECT_EQ(std::memcmp(raw.data() + 8 + n + off[0], t->raw(), t->nbytes()), 0) << name;
    expected_begin = off[1];
  }
  EXPECT_EQ(order, kExpectedOrder);
  EXPECT_EQ(expected_begin, buffer);
}

TEST_F(IoTest, SafetensorsBytesOfKnownTensors) {
  Tensor b = Tensor::zeros({2}, DType::f32, "b");
  b.data<float>()[0] = 1.0f;   // 0x3f800000
  b.data<float>()[1] = -2.0f;  // 0xc0000000
  Tensor a = Tensor::zeros({1}, DType::bf16, "a");
  a.data<uint16_t>()[0] = 0x3f80;  // bf16 1.0
  const std::string p = path("known.safetensors");
  save_safetensors(p, {a, b}, {{"k", "v"}});

  // F32 sorts before BF16 (larger alignment first) although "a" < "b". The header is
  // 134 bytes of JSON plus 2 spaces of padding = 136 = 0x88.
  std::string expected("\x88\0\0\0\0\0\0\0", 8);
  expected +=
      "{\"__metadata__\":{\"k\":\"v\"},"
      "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
      "\"a\":{\"dtype\":\"BF16\",\"shape\":[1],\"data_offsets\":[8,10]}}  ";
  expected += std::string("\x00\x00\x80\x3f\x00\x00\x00\xc0\x80\x3f", 10);
  ASSERT_EQ(expected.size(), 8u + 136u + 10u);
  EXPECT_EQ(slurp(p), expected);

  // No tensors and no metadata: "{}" padded to 8 bytes.
  const std::string e = path("empty.safetensors");
  save_safetensors(e, {}, {});
  EXPECT_EQ(slurp(e), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  const SafetensorsFile f = load_safetensors(e);
  EXPECT_TRUE(f.tensors.empty());
  EXPECT_TRUE(f.metadata.empty());
}

TEST_F(IoTest, SafetensorsI64RoundTrip) {
  // Values a double cannot hold exactly, so that a conversion anywhere on the way would show.
  const std::vector<int64_t> values = {(int64_t(1) << 53) + 1, -3, INT64_MAX, INT64_MIN};
  Tensor ids = Tensor::zeros({2, 2}, DType::i64, "b.ids");
  std::memcpy(ids.raw(), values.data(), ids.nbytes());
  Tensor f = Tensor::zeros({1}, DType::f64, "a.f64");
  f.data<double>()[0] = 0.5;
  const std::string p = path("i64.safetensors");
  save_safetensors(p, {f, ids}, {});

  // I64 comes after F64 in the reference's dtype enumeration, so it is written first although
  // "a.f64" < "b.ids"; both stay 8-byte aligned.
  const SafetensorsHeader h = read_safetensors_header(p);
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "b.ids");
  EXPECT_EQ(h.tensors[0].dtype, DType::i64);
  EXPECT_EQ(h.tensors[1].begin, 32u);
  EXPECT_EQ(h.data_start % 8, 0u);
  EXPECT_NE(slurp(p).find("\"b.ids\":{\"dtype\":\"I64\",\"shape\":[2,2],\"data_offsets\":[0,32]}"),
            std::string::npos);

  const Tensor got = load_safetensors(p).tensors.at("b.ids");
  EXPECT_EQ(got.dtype(), DType::i64);
  EXPECT_EQ(got.shape(), (Shape{2, 2}));
  EXPECT_EQ(std::vector<int64_t>(got.data<int64_t>(), got.data<int64_t>() + 4), values);

  // A file of another writer holding I64 is read too (it used to be refused as unsupported).
  const std::string other = path("other-i64.safetensors");
  spit(other, st_file("{\"n\":{\"dtype\":\"I64\",\"shape\":[1],\"data_offsets\":[0,8]}}",
                      std::string("\xfe\xff\xff\xff\xff\xff\xff\xff", 8)));
  EXPECT_EQ(load_safetensors(other).tensors.at("n").data<int64_t>()[0], -2);
}

TEST_F(IoTest, SafetensorsReadsFilesOfOtherWriters) {
  // Unpadded header, name order rather than alignment order, extra whitespace, a null
  // __metadata__ and an unknown extra field: all accepted by the format.
  const std::string header =
      "{ \"z\": {\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6], \"extra\": 1},\n"
      "  \"__metadata__\": null,\n"
      "  \"y\": {\"dtype\":\"I32\",\"shape\":[],\"data_offsets\":[0,4]} }";
  const std::string data("\x07\x00\x00\x00\x05\x06", 6);
  const std::string p = path("other.safetensors");
  spit(p, st_file(header, data));
  const SafetensorsFile f = load_safetensors(p);
  ASSERT_EQ(f.tensors.size(), 2u);
  EXPECT_TRUE(f.metadata.empty());
  EXPECT_EQ(f.tensors.at("y").shape(), Shape{});
  EXPECT_EQ(f.tensors.at("y").data<int32_t>()[0], 7);
  EXPECT_EQ(f.tensors.at("z").data<uint8_t>()[0], 5);
  EXPECT_EQ(f.tensors.at("z").data<uint8_t>()[1], 6);

  const SafetensorsHeader h = read_safetensors_header(p);
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "y");  // buffer order
  EXPECT_EQ(h.tensors[1].name, "z");
  EXPECT_EQ(h.tensors[1].begin, 4u);
  EXPECT_EQ(h.tensors[1].end, 6u);
  EXPECT_EQ(h.header_size, header.size());
  EXPECT_EQ(h.data_start, 8 + header.size());
  EXPECT_EQ(h.file_size, 8 + header.size() + 6);
}

TEST_F(IoTest, SafetensorsHeaderOnly) {
  const std::string p = path("h.safetensors");
  save_safetensors(p, every_dtype_tensors(), kMeta);
  const SafetensorsHeader h = read_safetensors_header(p);
  EXPECT_EQ(h.metadata, kMeta);
  std::vector<std::string> names;
  for (const auto& e : h.tensors) names.push_back(e.name);
  EXPECT_EQ(names, kExpectedOrder);
  EXPECT_EQ(h.tensors[0].dtype, DType::f64);
  EXPECT_EQ(h.tensors[0].shape, (Shape{3, 2}));
  EXPECT_EQ(h.data_start, 8 + h.header_size);
  EXPECT_EQ(h.file_size, fs::file_size(p));
  EXPECT_EQ(read_safetensors_metadata(p), kMeta);
}

TEST_F(IoTest, SafetensorsSaveRejectsBadInput) {
  const std::string p = path("bad.safetensors");
  Rng rng(1);
  save_safetensors(p, {random_tensor("keep", {2}, DType::f32, rng)}, {});
  const std::string before = slurp(p);

  expect_error([&] { save_safetensors(p, {random_tensor("x", {2}, DType::f32, rng), random_tensor("x", {1}, DType::u8, rng)}); },
               {p, "two tensors are named 'x'"});
  expect_error([&] { save_safetensors(p, {random_tensor("", {2}, DType::f32, rng)}); }, {p, "no name"});
  expect_error([&] { save_safetensors(p, {random_tensor("__metadata__", {2}, DType::f32, rng)}); }, {p, "reserved"});
  float dummy[2] = {0, 0};
  expect_error([&] { save_safetensors(p, {Tensor::borrow(dummy, {2}, DType::f32, Device::cuda, "gpu")}); },
               {p, "'gpu'", "cuda"});
  expect_error([&] { save_safetensors(p, {random_tensor("x", {2}, DType::f32, rng)}, {{"k", "bad \xff utf8"}}); },
               {p, "'k'", "UTF-8"});
  EXPECT_EQ(slurp(p), before);  // failed saves never touch the existing file
  EXPECT_EQ(listing(), std::vector<std::string>{"bad.safetensors"});
  expect_error([&] { save_safetensors(path("missing/x.safetensors"), {}); }, {path("missing/x.safetensors")});
}

TEST_F(IoTest, SafetensorsCorruptionErrors) {
  const std::string p = path("c.safetensors");
  auto check = [&](const std::string& bytes, const std::vector<std::string>& parts) {
    spit(p, bytes);
    std::vector<std::string> all = parts;
    all.push_back(p);
    expect_error([&] { load_safetensors(p); }, all);
    expect_error([&] { read_safetensors_header(p); }, all);
  };
  const std::string f32x2 = "{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";

  // Sanity: the base case loads.
  spit(p, st_file(f32x2, std::string(8, '\0')));
  EXPECT_EQ(load_safetensors(p).tensors.at("w").numel(), 2);

  check("", {"0 bytes, shorter than the 8-byte header length"});
  check("abcde", {"5 bytes, shorter than the 8-byte header length"});
  check(le64(uint64_t(1) << 40) + "{}", {"header length 1099511627776 runs past the end of the file"});
  check(le64(f32x2.size() + 1) + f32x2, {"runs past the end of the file"});
  check(st_file("{\"w\": [1, 2", ""), {"header is not valid JSON"});
  check(st_file("\xff\xfe", ""), {"header is not valid JSON"});
  check(st_file("[1,2]", ""), {"header is a JSON array, expected an object"});
  check(st_file(f32x2, std::string(4, '\0')), {"tensor 'w'", "[0, 8] run past the end of the data buffer (4 bytes"});
  check(st_file("{\"w\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]}}", std::string(8, '\0')),
        {"tensor 'w'", "run past the end of the data buffer"});
  check(st_file("{\"w\":{\"dtype\":\"Q7\",\"shape\":[2],\"data_offsets\":[0,8]}}", std::string(8, '\0')),
        {"tensor 'w'", "unknown dtype 'Q7'"});
  check(st_file("{\"w\":{\"dtype\":\"U64\",\"shape\":[1],\"data_offsets\":[0,8]}}", std::string(8, '\0')),
        {"tensor 'w'", "unsupported dtype 'U64'"});
  check(st_file("{\"w\":{\"dtype\":\"f32\",\"shape\":[2],\"data_offsets\":[0,8]}}", std::string(8, '\0')),
        {"unknown dtype 'f32'"});
  check(st_file("{\"w\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", std::string(8, '\0')),
        {"tensor 'w'", "shape [3] of F32 needs 12 bytes but data_offsets [0, 8] span 8"});
  check(st_file("{\"w\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", std::string(8, '\0')),
        {"tensor 'w'", "non-negative integers"});
  check(st_file("{\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", std::string(8, '\0')),
        {"tensor 'w'", "end before they begin"});
  check(st_file("{\"w\":{\"dtype\":\"F32\",\"shape\":[2]}}", std::string(8, '\0')), {"tensor 'w'", "data_offsets"});
  check(st_file("{\"w\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296],\"data_offsets\":[0,8]}}",
                std::string(8, '\0')),
        {"tensor 'w'", "overflows"});
  check(st_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                std::string(12, '\0')),
        {"tensor 'b'", "overlaps tensor 'a'"});
  check(st_file("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]}}",
                std::string(12, '\0')),
        {"bytes [4, 8) of the data buffer belong to no tensor"});
  check(st_file(f32x2, std::string(12, '\0')), {"the data buffer holds 12 bytes but the tensors cover only 8"});
  check(st_file("{\"__metadata__\":{\"k\":1},\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
                std::string(8, '\0')),
        {"metadata value for key 'k' is a JSON number, expected a string"});
  check(st_file("{\"__metadata__\":[\"k\"]}", ""), {"\"__metadata__\" is a JSON array"});
  check(st_file("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                "\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}",
                std::string(2, '\0')),
        {"header names 'w' more than once"});

  // A complete file cut short loses the end of its data.
  const std::string good = path("good.safetensors");
  save_safetensors(good, every_dtype_tensors(), kMeta);
  const std::string whole = slurp(good);
  check(whole.substr(0, whole.size() - 3), {"tensor 'bytes'", "run past the end of the data buffer"});

  expect_error([&] { load_safetensors(path("nope.safetensors")); }, {path("nope.safetensors"), "does not exist"});
  expect_error([&] { load_safetensors(dir_.string()); }, {dir_.string(), "not a regular file"});
}

// Found by fuzzing: a number too large for any type in the header escaped as nlohmann's
// out_of_range exception.
TEST(Safetensors, HeaderWithAnOverflowingNumberIsAnError) {
  esplag::testing::TempDir dir;
  const std::string header = R"({"a": {"dtype": "F32", "shape": [22222e222222222], "data_offsets": [0, 4]}})";
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = char((header.size() >> (8 * i)) & 0xff);
  bytes += header + std::string(4, '\0');
  esplag::testing::write_text(dir.file("n.safetensors"), bytes);
  const std::string e = esplag::testing::error_of([&] { esplag::load_safetensors(dir.file("n.safetensors")); });
  EXPECT_NE(e.find("header is not valid JSON (a number out of range)"), std::string::npos) << e;
}

TEST(Json, AccessErrorsLoseTheLibraryPrefix) {
  try {
    (void)nlohmann::json::parse(R"({"a": 1})").at("b");
    FAIL() << "no exception";
  } catch (const nlohmann::json::exception& e) {
    EXPECT_EQ(esplag::json_error_text(e), "key 'b' not found");
  }
}

TEST(Utf8, FindsTheFirstByteThatIsNotUtf8) {
  EXPECT_EQ(invalid_utf8_at("plain ascii"), std::string_view::npos);
  EXPECT_EQ(invalid_utf8_at("caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80"), std::string_view::npos);
  EXPECT_EQ(invalid_utf8_at("ab\xff"), 2u);             // never a UTF-8 byte
  EXPECT_EQ(invalid_utf8_at("a\xc3"), 1u);              // truncated sequence
  EXPECT_EQ(invalid_utf8_at("\xc0\xaf"), 0u);           // overlong '/'
  EXPECT_EQ(invalid_utf8_at("x\xed\xa0\x80"), 1u);      // a surrogate
  EXPECT_EQ(invalid_utf8_at("\xf4\x90\x80\x80"), 0u);   // above U+10FFFF
  EXPECT_EQ(invalid_utf8_at("\xe2\x28\xa1"), 0u);       // bad continuation
}
