// Numbers of the training log as text: durations (the ETA), token rates and sizes.
#pragma once
#include <cstdint>
#include <string>

namespace esplag {

// "12m05s" below an hour, "3h07m" from there on (hours uncapped: "41666h40m"), "?" for a
// negative or non-finite number of seconds (no estimate yet).
std::string format_duration(double seconds);

// "850", "12.3K", "1.25M" tokens per second.
std::string format_rate(double tokens_per_s);

// "512 bytes", "3.4 MiB", "2.3 GiB".
std::string format_bytes(uint64_t bytes);

}  // namespace esplag
