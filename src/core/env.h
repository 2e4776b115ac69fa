// On/off switches read from the environment, spelled the same way everywhere.
#pragma once
#include <cctype>
#include <cstdlib>
#include <string>

namespace esplag {

// The switch `name`: unset or empty gives `default_on`; "0", "off", "false" or "no" (any
// case) turn it off; anything else turns it on.
inline bool env_flag(const char* name, bool default_on) {
  const char* e = std::getenv(name);
  if (!e || !*e) return default_on;
  std::string v(e);
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return !(v == "0" || v == "off" || v == "false" || v == "no");
}

}  // namespace esplag
