#include "data/byte_level.h"

#include <array>
#include <cstdint>

namespace esplag::byte_level {

namespace {

std::string utf8(uint32_t cp) {
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {  // every stand-in is below U+0800
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

bool stands_for_itself(int b) { return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); }

struct Tables {
  std::array<std::string, 256> to_unicode;
  std::array<int, 512> from_code_point;  // code point -> byte, -1 for none
  Tables() {
    from_code_point.fill(-1);
    int next = 256;
    for (int b = 0; b < 256; ++b) {
      const int cp = stands_for_itself(b) ? b : next++;
      to_unicode[b] = utf8(static_cast<uint32_t>(cp));
      from_code_point[cp] = b;
    }
  }
};

const Tables& tables() {
  static const Tables t;
  return t;
}

enum Class : unsigned char { kOther, kLetter, kNumber, kSpace };

struct ClassTable {
  std::array<unsigned char, 256> c{};
  ClassTable() {
    for (int b = 0; b < 256; ++b) {
      if ((b >= 'a' && b <= 'z') || (b >= 'A' && b <= 'Z') || b >= 0x80)
        c[b] = kLetter;
      else if (b >= '0' && b <= '9')
        c[b] = kNumber;
      else if (b == ' ' || b == '\t' || b == '\n' || b == '\v' || b == '\f' || b == '\r')
        c[b] = kSpace;
      else
        c[b] = kOther;
    }
  }
};

const ClassTable kClasses;

inline unsigned char cls(char ch) { return kClasses.c[static_cast<unsigned char>(ch)]; }

}  // namespace

const std::string& byte_to_unicode(unsigned char b) { return tables().to_unicode[b]; }

std::string encode_bytes(std::string_view bytes) {
  const auto& t = tables();
  std::string out;
  out.reserve(bytes.size() * 2);
  for (const char c : bytes) out += t.to_unicode[static_cast<unsigned char>(c)];
  return out;
}

bool decode_to_bytes(std::string_view s, std::string* out) {
  const auto& t = tables();
  out->clear();
  size_t i = 0;
  while (i < s.size()) {
    const auto c0 = static_cast<unsigned char>(s[i]);
    uint32_t cp;
    if (c0 < 0x80) {
      cp = c0;
      i += 1;
    } else if ((c0 & 0xE0) == 0xC0 && i + 1 < s.size() && (static_cast<unsigned char>(s[i + 1]) & 0xC0) == 0x80) {
      cp = ((c0 & 0x1F) << 6) | (static_cast<unsigned char>(s[i + 1]) & 0x3F);
      i += 2;
    } else {
      return false;  // a longer sequence or broken UTF-8: code points >= U+0800 stand for no byte
    }
    if (cp >= t.from_code_point.size() || t.from_code_point[cp] < 0) return false;
    *out += static_cast<char>(t.from_code_point[cp]);
  }
  return true;
}

size_t pretoken_end(std::string_view text, size_t i) {
  const size_t n = text.size();
  const char c = text[i];
  // 's|'t|'re|'ve|'m|'ll|'d (case-sensitive, as in GPT-2)
  if (c == '\'' && i + 1 < n) {
    const char a = text[i + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return i + 2;
    if (i + 2 < n) {
      const char b = text[i + 2];
      if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return i + 3;
    }
  }
  // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': an optional space, then a run of one class
  size_t start = i;
  if (c == ' ' && i + 1 < n && cls(text[i + 1]) != kSpace) start = i + 1;
  const unsigned char k = cls(text[start]);
  if (k != kSpace) {
    size_t j = start + 1;
    while (j < n && cls(text[j]) == k) ++j;
    return j;
  }
  // '\s+(?!\S)' then '\s+': a whitespace run, leaving its last character to start the next
  // pre-token when a non-space follows (so " word" keeps its space).
  size_t j = i + 1;
  while (j < n && cls(text[j]) == kSpace) ++j;
  if (j < n && j - i >= 2) return j - 1;
  return j;
}

std::vector<std::string_view> pretokenize(std::string_view text) {
  std::vector<std::string_view> out;
  for_each_pretoken(text, [&](std::string_view p) { out.push_back(p); });
  return out;
}

std::vector<size_t> safe_cuts(std::string_view text, size_t target) {
  std::vector<size_t> cuts{0};
  if (target == 0) target = 1;
  size_t next = target;
  while (next < text.size()) {
    size_t p = next;
    while (p < text.size() && !(p >= 2 && text[p - 1] == '\n' && cls(text[p - 2]) != kSpace && cls(text[p]) != kSpace))
      ++p;
    if (p >= text.size()) break;
    cuts.push_back(p);
    next = p + target;
  }
  cuts.push_back(text.size());
  return cuts;
}

}  // namespace esplag::byte_level
