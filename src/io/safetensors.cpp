#include "io/safetensors.h"

#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "core/error.h"
#include "io/atomic_file.h"
#include "io/json.h"

namespace esplag {

// The format stores little-endian numbers and tensor data is written as it lies in memory.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// The reference implementation rejects larger headers; so do we, so that a corrupt
// length cannot make us allocate gigabytes before failing.
constexpr uint64_t kMaxHeaderSize = 100'000'000;

constexpr std::array<DType, 8> kSupported = {DType::f64, DType::i64, DType::f32, DType::i32,
                                             DType::bf16, DType::f16, DType::u16, DType::u8};

// Position in the reference implementation's dtype enumeration, which is ordered by
// alignment; writing tensors by descending rank keeps every tensor aligned.
int dtype_rank(DType t) {
  switch (t) {
    case DType::u8: return 1;
    case DType::u16: return 6;
    case DType::f16: return 7;
    case DType::bf16: return 8;
    case DType::i32: return 9;
    case DType::f32: return 11;
    case DType::f64: return 12;
    case DType::i64: return 13;
  }
  return 0;
}

bool parse_dtype(const std::string& s, DType* out) {
  for (DType t : kSupported)
    if (dtype_safetensors(t) == s) {
      *out = t;
      return true;
    }
  return false;
}

bool is_other_safetensors_dtype(const std::string& s) {
  static const std::set<std::string> others = {"BOOL",    "I8",      "I16", "U32",     "U64",     "F8_E5M2",
                                               "F8_E4M3", "F8_E8M0", "F4",  "F6_E2M3", "F6_E3M2", "C64"};
  return others.count(s) != 0;
}

std::string supported_list() {
  std::string s;
  for (DType t : kSupported) s += (s.empty() ? "" : ", ") + dtype_safetensors(t);
  return s;
}

std::string offsets_str(uint64_t b, uint64_t e) { return detail::concat("[", b, ", ", e, "]"); }

// Builds the entry for one tensor of the header, checking its structure and that the
// shape, dtype and offsets agree and fit the buffer.
SafetensorsEntry parse_entry(const std::string& path, const std::string& name, const json& v, uint64_t buffer_size) {
  auto bad = [&](const auto&... why) { fail(path, ": tensor '", name, "': ", why...); };
  if (!v.is_object()) bad("header entry is a JSON ", v.type_name(), ", expected an object with dtype, shape, data_offsets");
  SafetensorsEntry e;
  e.name = name;

  const auto dt = v.find("dtype");
  if (dt == v.end() || !dt->is_string()) bad("\"dtype\" is missing or not a string");
  const std::string dts = dt->get<std::string>();
  if (!parse_dtype(dts, &e.dtype)) {
    if (is_other_safetensors_dtype(dts)) bad("unsupported dtype '", dts, "' (supported: ", supported_list(), ")");
    bad("unknown dtype '", dts, "' (supported: ", supported_list(), ")");
  }

  const auto sh = v.find("shape");
  if (sh == v.end() || !sh->is_array()) bad("\"shape\" is missing or not an array");
  uint64_t numel = 1;
  bool overflow = false;
  for (const json& d : *sh) {
    if (!d.is_number_unsigned()) bad("shape ", sh->dump(), " holds ", d.dump(), ", expected non-negative integers");
    const uint64_t dim = d.get<uint64_t>();
    if (dim > uint64_t(INT64_MAX)) overflow = true;
    e.shape.push_back(static_cast<int64_t>(dim));
    overflow = overflow || __builtin_mul_overflow(numel, dim, &numel);
  }
  uint64_t nbytes = 0;
  overflow = overflow || __builtin_mul_overflow(numel, uint64_t(dtype_size(e.dtype)), &nbytes) ||
             nbytes > uint64_t(INT64_MAX);
  if (overflow) bad("shape ", sh->dump(), " of ", dts, " overflows the addressable size");

  const auto off = v.find("data_offsets");
  if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
      !(*off)[1].is_number_unsigned())
    bad("\"data_offsets\" is missing or not a pair of non-negative integers [begin, end]");
  e.begin = (*off)[0].get<uint64_t>();
  e.end = (*off)[1].get<uint64_t>();
  if (e.end < e.begin) bad("data_offsets ", offsets_str(e.begin, e.end), " end before they begin");
  if (e.end - e.begin != nbytes)
    bad("shape ", shape_str(e.shape), " of ", dts, " needs ", nbytes, " bytes but data_offsets ",
        offsets_str(e.begin, e.end), " span ", e.end - e.begin);
  if (e.end > buffer_size)
    bad("data_offsets ", offsets_str(e.begin, e.end), " run past the end of the data buffer (", buffer_size,
        " bytes; file truncated?)");
  return e;
}

// Parses and validates a header: the metadata and the tensors in buffer order.
void parse_header(const std::string& path, const std::string& text, uint64_t buffer_size, SafetensorsHeader* out) {
  // nlohmann keeps the last of duplicate keys silently; a file that names one tensor
  // twice is corrupt, so the parser callback watches the top-level keys.
  std::set<std::string> seen;
  std::string duplicate;
  const json root = parse_json(text, path + ": header", [&](int depth, json::parse_event_t event, json& parsed) {
    if (depth == 1 && event == json::parse_event_t::key && duplicate.empty()) {
      const std::string& k = parsed.get_ref<const std::string&>();
      if (!seen.insert(k).second) duplicate = k;
    }
    return true;
  });
  if (!root.is_object()) fail(path, ": header is a JSON ", root.type_name(), ", expected an object");
  if (!duplicate.empty()) fail(path, ": header names '", duplicate, "' more than once");

  for (const auto& [key, value] : root.items()) {
    if (key == "__metadata__") {
      if (value.is_null()) continue;
      if (!value.is_object()) fail(path, ": \"__metadata__\" is a JSON ", value.type_name(), ", expected an object");
      for (const auto& [mk, mv] : value.items()) {
        if (!mv.is_string())
          fail(path, ": metadata value for key '", mk, "' is a JSON ", mv.type_name(), ", expected a string");
        out->metadata[mk] = mv.get<std::string>();
      }
      continue;
    }
    out->tensors.push_back(parse_entry(path, key, value, buffer_size));
  }

  auto& ts = out->tensors;
  std::sort(ts.begin(), ts.end(), [](const SafetensorsEntry& a, const SafetensorsEntry& b) {
    if (a.begin != b.begin) return a.begin < b.begin;
    if (a.end != b.end) return a.end < b.end;
    return a.name < b.name;
  });
  uint64_t covered = 0;
  for (size_t i = 0; i < ts.size(); ++i) {
    const SafetensorsEntry& e = ts[i];
    if (e.begin < covered)
      fail(path, ": tensor '", e.name, "' (data_offsets ", offsets_str(e.begin, e.end), ") overlaps tensor '",
           ts[i - 1].name, "' (data_offsets ", offsets_str(ts[i - 1].begin, ts[i - 1].end), ")");
    if (e.begin > covered)
      fail(path, ": bytes [", covered, ", ", e.begin, ") of the data buffer belong to no tensor (the format ",
           "requires tensors to be packed; next tensor '", e.name, "')");
    covered = e.end;
  }
  if (covered != buffer_size)
    fail(path, ": the data buffer holds ", buffer_size, " bytes but the tensors cover only ", covered,
         " (trailing garbage or a header that lost tensors)");
}

struct OpenFile {
  std::FILE* f = nullptr;
  ~OpenFile() {
    if (f) std::fclose(f);
  }
};

void read_exact(std::FILE* f, void* dst, uint64_t size, uint64_t offset, const std::string& path, const char* what) {
  if (size == 0) return;
  const size_t n = std::fread(dst, 1, static_cast<size_t>(size), f);
  if (n != size) {
    const int err = std::ferror(f) ? errno : 0;
    fail(path, ": reading ", what, " (", size, " bytes at offset ", offset, ") failed: ",
         err ? std::strerror(err) : "unexpected end of file (was it changed while being read?)");
  }
}

// Opens `path` and reads and validates its header; the stream is left at the data buffer.
SafetensorsHeader open_and_read_header(const std::string& path, OpenFile& file) {
  file.f = std::fopen(path.c_str(), "rbe");
  if (file.f == nullptr) {
    const int err = errno;
    struct stat st;
    if (::stat(path.c_str(), &st) != 0 && err == ENOENT) fail("cannot read safetensors file '", path, "': file does not exist");
    fail("cannot read safetensors file '", path, "': ", std::strerror(err));
  }
  struct stat st;
  if (::fstat(::fileno(file.f), &st) != 0) fail("cannot read safetensors file '", path, "': ", std::strerror(errno));
  if (!S_ISREG(st.st_mode)) fail("cannot read safetensors file '", path, "': not a regular file");

  SafetensorsHeader h;
  h.file_size = static_cast<uint64_t>(st.st_size);
  if (h.file_size < 8)
    fail(path, ": not a safetensors file: ", h.file_size, " bytes, shorter than the 8-byte header length");
  unsigned char len[8];
  read_exact(file.f, len, 8, 0, path, "the header length");
  for (int i = 7; i >= 0; --i) h.header_size = (h.header_size << 8) | len[i];
  if (h.header_size > h.file_size - 8)
    fail(path, ": header length ", h.header_size, " runs past the end of the file (", h.file_size,
         " bytes): truncated or not a safetensors file");
  if (h.header_size > kMaxHeaderSize)
    fail(path, ": header length ", h.header_size, " exceeds the format's limit of ", kMaxHeaderSize, " bytes");
  h.data_start = 8 + h.header_size;
  std::string text(static_cast<size_t>(h.header_size), '\0');
  read_exact(file.f, text.data(), h.header_size, 8, path, "the header");
  parse_header(path, text, h.file_size - h.data_start, &h);
  return h;
}

// Checks that `s` can be written as a JSON string (valid UTF-8).
bool json_encodable(const std::string& s) {
  try {
    (void)json(s).dump();
    return true;
  } catch (const json::type_error&) {
    return false;
  }
}

}  // namespace

void save_safetensors(const std::string& path, const std::vector<Tensor>& tensors,
                      const std::map<std::string, std::string>& metadata) {
  std::set<std::string> names;
  for (const Tensor& t : tensors) {
    ESPLAG_CHECK(!t.name().empty(), "cannot save '", path, "': a tensor of shape ", shape_str(t.shape()),
                 " has no name");
    ESPLAG_CHECK(t.name() != "__metadata__", "cannot save '", path,
                 "': '__metadata__' is reserved by the format and cannot name a tensor");
    ESPLAG_CHECK(names.insert(t.name()).second, "cannot save '", path, "': two tensors are named '", t.name(), "'");
    ESPLAG_CHECK(t.device() == Device::cpu, "cannot save '", path, "': tensor '", t.name(), "' is on ",
                 device_name(t.device()), "; copy it to the host first");
    ESPLAG_CHECK(t.raw() != nullptr || t.numel() == 0, "cannot save '", path, "': tensor '", t.name(),
                 "' has no data");
  }

  std::vector<const Tensor*> order;
  for (const Tensor& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(), [](const Tensor* a, const Tensor* b) {
    const int ra = dtype_rank(a->dtype()), rb = dtype_rank(b->dtype());
    if (ra != rb) return ra > rb;
    return a->name() < b->name();
  });

  ordered_json header = ordered_json::object();
  if (!metadata.empty()) {
    ordered_json meta = ordered_json::object();
    for (const auto& [k, v] : metadata) meta[k] = v;
    header["__metadata__"] = std::move(meta);
  }
  uint64_t offset = 0;
  for (const Tensor* t : order) {
    ordered_json shape = ordered_json::array();
    for (int64_t d : t->shape()) shape.push_back(static_cast<uint64_t>(d));
    const uint64_t n = t->nbytes();
    header[t->name()] = ordered_json{{"dtype", dtype_safetensors(t->dtype())},
                                     {"shape", std::move(shape)},
                                     {"data_offsets", {offset, offset + n}}};
    offset += n;
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const ordered_json::type_error&) {
    for (const auto& [k, v] : metadata) {
      ESPLAG_CHECK(json_encodable(k), "cannot save '", path, "': metadata key is not valid UTF-8");
      ESPLAG_CHECK(json_encodable(v), "cannot save '", path, "': metadata value for key '", k,
                   "' is not valid UTF-8");
    }
    for (const Tensor* t : order)
      ESPLAG_CHECK(json_encodable(t->name()), "cannot save '", path, "': a tensor name is not valid UTF-8");
    throw;
  }
  text.append((8 - text.size() % 8) % 8, ' ');

  write_file_atomic(path, [&](FileSink& sink) {
    unsigned char len[8];
    uint64_t n = text.size();
    for (int i = 0; i < 8; ++i, n >>= 8) len[i] = static_cast<unsigned char>(n & 0xff);
    sink.write(len, 8);
    sink.write(text);
    for (const Tensor* t : order) sink.write(t->raw(), t->nbytes());
  });
}

SafetensorsHeader read_safetensors_header(const std::string& path) {
  OpenFile file;
  return open_and_read_header(path, file);
}

std::map<std::string, std::string> read_safetensors_metadata(const std::string& path) {
  return read_safetensors_header(path).metadata;
}

SafetensorsFile load_safetensors(const std::string& path) {
  OpenFile file;
  SafetensorsHeader h = open_and_read_header(path, file);
  SafetensorsFile out;
  out.metadata = std::move(h.metadata);
  // The tensors are packed in buffer order, so one sequential pass reads them all.
  for (const SafetensorsEntry& e : h.tensors) {
    Tensor t = Tensor::zeros(e.shape, e.dtype, e.name);
    read_exact(file.f, t.raw(), e.end - e.begin, h.data_start + e.begin, path,
               ("the data of tensor '" + e.name + "'").c_str());
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

}  // namespace esplag
