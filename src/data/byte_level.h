// GPT-2's byte-level conventions, shared by the BPE tokenizer and the BPE trainer.
//
// Vocabulary strings: GPT-2 stores each token as a printable Unicode string in which every
// byte stands for itself if it is a printable Latin-1 character ('!'..'~', '¡'..'¬',
// '®'..'ÿ') and otherwise for the code point 256 + k (k counting the remaining bytes in
// order): space is 'Ġ' (U+0120), newline 'Ċ' (U+010A).
//
// Pre-tokenisation: the GPT-2 pattern
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// implemented as a hand-written scanner over bytes with these classes:
//   letter     ASCII A-Z a-z and every byte >= 0x80
//   number     ASCII 0-9
//   space      ' ', \t, \n, \v, \f, \r
//   other      every remaining ASCII byte
// Treating all non-ASCII bytes as letters keeps multi-byte UTF-8 characters whole. It
// differs from the Unicode-aware pattern only for non-ASCII digits, punctuation and
// spaces (for example '—', '“', U+00A0), which here join the neighbouring letters.
#pragma once
#include <cstdint>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

namespace esplag::byte_level {

// The vocabulary string (UTF-8) that stands for byte b.
const std::string& byte_to_unicode(unsigned char b);

// Vocabulary form of raw bytes: the concatenation of byte_to_unicode of each byte.
std::string encode_bytes(std::string_view bytes);

// Inverse of encode_bytes. Returns false (leaving *out unspecified) if `s` holds a
// character that stands for no byte.
bool decode_to_bytes(std::string_view s, std::string* out);

// End (exclusive) of the pre-token that starts at text[begin] (begin < text.size()).
size_t pretoken_end(std::string_view text, size_t begin);

// All pre-tokens of `text`, in order; they concatenate back to `text`.
std::vector<std::string_view> pretokenize(std::string_view text);

// Calls fn(piece) for each pre-token of `text`.
template <typename Fn>
void for_each_pretoken(std::string_view text, Fn&& fn) {
  size_t i = 0;
  while (i < text.size()) {
    const size_t j = pretoken_end(text, i);
    fn(text.substr(i, j - i));
    i = j;
  }
}

// Offsets 0 = p_0 < p_1 < ... < p_k = text.size() cutting `text` into pieces of about
// `target` bytes (or more), such that pre-tokenising the pieces one by one gives exactly
// the pre-tokens of the whole text. A cut is placed only after a lone '\n' that follows a
// non-space byte and precedes a non-space byte, where the pattern always ends a pre-token.
std::vector<size_t> safe_cuts(std::string_view text, size_t target);

}  // namespace esplag::byte_level
