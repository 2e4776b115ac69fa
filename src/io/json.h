// Parsing the JSON of the files a user hands the engine (safetensors headers, tokenizer.json,
// state.json): every malformed input is one Error that names the file, never the JSON
// library's own exception text.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace esplag {

// Parses `text`; `what` names it in errors ("tokenizer file 'x.json'"): "<what> is not
// valid JSON (the parser stopped at byte N)", or "(a number out of range)". `callback` is
// nlohmann's parser callback (e.g. to see duplicate keys), or null.
nlohmann::json parse_json(const std::string& text, const std::string& what,
                          const nlohmann::json::parser_callback_t& callback = nullptr);

// The message of a JSON access error (a missing key, a wrong type) without the library's
// "[json.exception.type_error.302] " prefix, for an Error that names the file.
std::string json_error_text(const nlohmann::json::exception& e);

}  // namespace esplag
