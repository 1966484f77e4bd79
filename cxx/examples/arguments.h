// Command-line numbers shared by the example programs: one parser for an integer and one for a
// comma-separated list of them, each saying which flag and value it refused.
#pragma once

#include <cstdint>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace muse_spark_examples {

// `s` as an integer >= least, or std::invalid_argument naming `flag` (`what`: what the value is).
inline int64_t parse_integer(const std::string& s, const std::string& flag, const std::string& what,
                             int64_t least = std::numeric_limits<int64_t>::min()) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(s, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != s.size() || s.empty() || v < least) throw std::invalid_argument(flag + ": '" + s + "' is not " + what);
  return v;
}

// "1,2,3" (empty items skipped) as integers, each checked as parse_integer checks one.
inline std::vector<int64_t> parse_integers(const std::string& s, const std::string& flag, const std::string& what,
                                           int64_t least = std::numeric_limits<int64_t>::min()) {
  std::vector<int64_t> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ','))
    if (!item.empty()) out.push_back(parse_integer(item, flag, what, least));
  return out;
}

}  // namespace muse_spark_examples
