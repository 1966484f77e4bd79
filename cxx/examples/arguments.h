// Command-line pieces shared by the example programs: a parser for an integer and one for a comma-separated
// list of them, each saying which flag and value it refused; the flags both take for opening an engine; and
// the engine's opening with their error report.
#pragma once

#include <ATen/Parallel.h>
#include <muse_spark/engine.h>

#include <cstdint>
#include <functional>
#include <iostream>
#include <memory>
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

// The flags of both programs that say how the engine runs: --threads N (torch's intra-op threads; default
// torch's choice), --no-verify (skip the hash check), --no-cuda-graphs (a CUDA engine's packages called one
// by one). → whether `flag` was one of them (`value` gives its value).
inline bool engine_flag(const std::string& flag, const std::function<std::string()>& value,
                        muse_spark::OpenOptions& options) {
  if (flag == "--threads") {
    at::set_num_threads(static_cast<int>(parse_integer(value(), flag, "an integer >= 1", 1)));
  } else if (flag == "--no-verify") {
    options.verify_hashes = false;
  } else if (flag == "--no-cuda-graphs") {
    options.cuda_graphs = false;
  } else {
    return false;
  }
  return true;
}

// The engine at `dir`, or null after its reason on stderr (an engine that cannot run here: exit status 2).
inline std::unique_ptr<muse_spark::Engine> open_engine(const std::string& dir, const muse_spark::OpenOptions& options) {
  try {
    return muse_spark::Engine::open(dir, options);
  } catch (const muse_spark::EngineError& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return nullptr;
  }
}

}  // namespace muse_spark_examples
