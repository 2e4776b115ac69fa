#include "io/json.h"

#include "core/error.h"

namespace esplag {

nlohmann::json parse_json(const std::string& text, const std::string& what,
                          const nlohmann::json::parser_callback_t& callback) {
  try {
    return nlohmann::json::parse(text, callback);
  } catch (const nlohmann::json::parse_error& e) {
    fail(what, " is not valid JSON (the parser stopped at byte ", e.byte, ")");
  } catch (const nlohmann::json::out_of_range&) {
    fail(what, " is not valid JSON (a number out of range)");
  } catch (const nlohmann::json::exception&) {
    fail(what, " is not valid JSON");
  }
}

std::string json_error_text(const nlohmann::json::exception& e) {
  const std::string what = e.what();
  const size_t end = what.find("] ");
  return what.rfind("[json.exception.", 0) == 0 && end != std::string::npos ? what.substr(end + 2) : what;
}

}  // namespace esplag
