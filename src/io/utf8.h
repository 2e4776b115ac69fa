// UTF-8 validation for the text files a user hands the engine (YAML configs and recipes
// must be Unicode: bytes that are not UTF-8 would not survive being written back).
#pragma once
#include <cstddef>
#include <string_view>

namespace esplag {

// The offset of the first byte that does not start or continue a well-formed UTF-8
// sequence (overlong forms, surrogates and code points above U+10FFFF are not), or npos.
size_t invalid_utf8_at(std::string_view text);

}  // namespace esplag
