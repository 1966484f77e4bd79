// muse_spark_generate: speculative generation from C++ over an aoti engine directory.
//
//   muse_spark_generate --engine DIR --prompt-ids 72,101,108 [--prompt-ids ...] [--max-tokens N]
//                       [--temperature T] [--seed S] [--stop-ids a,b] [--ignore-eos] [--stream]
//                       [--max-batch N] [--threads N] [--no-verify] [--no-cuda-graphs]
//                       [--arrivals K0,K1,...] [--cancel I@K ...]
//   muse_spark_generate --info
//
// Without --arrivals/--cancel every prompt is a request from the start (Engine::generate). With them,
// a muse_spark::Generator takes the requests over time: before scheduler iteration K, prompt i joins
// where --arrivals gives it K (default 0), and request I is cancelled where --cancel says I@K.
//
// One JSON object a line on stdout: with --stream, {"request": i, "tokens": [...]} as tokens come;
// then, for each request, {"request": i, "output_ids": [...], "finish_reason": ..., "steps": ...,
// "accepted_draft_tokens": ..., "confidence": [[γ values] per step], "error": ...}. An engine that
// cannot run here: the reason on stderr, exit status 2. Bad arguments: exit status 64.
#include <muse_spark/engine.h>

#include "arguments.h"

#include <algorithm>
#include <cstdlib>
#include <map>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

namespace {

std::vector<int64_t> parse_ids(const std::string& s, const std::string& flag) {
  return muse_spark_examples::parse_integers(s, flag, "an integer token id");
}

std::string ids_json(const std::vector<int64_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

std::string quoted(const std::string& s) {
  std::string out = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out + "\"";
}

// Requests over time through a Generator: before iteration k, the prompts arriving at k are added (a bad
// one fails alone), the cancels due at k are made, then one scheduler step runs if there is work.
std::vector<muse_spark::Output> over_time(muse_spark::Engine& engine, const std::vector<std::vector<int64_t>>& prompts,
                                          const muse_spark::SamplingParams& params,
                                          std::vector<int64_t> arrivals,
                                          const std::vector<std::pair<size_t, int64_t>>& cancels,
                                          const muse_spark::TokenCallback& on_tokens) {
  if (arrivals.empty()) arrivals.assign(prompts.size(), 0);
  muse_spark::Generator gen(engine);
  std::vector<muse_spark::Output> outs(prompts.size());
  std::vector<int64_t> id(prompts.size(), -1);
  std::map<int64_t, size_t> index;
  int64_t last = *std::max_element(arrivals.begin(), arrivals.end());
  for (const auto& c : cancels) last = std::max(last, c.second);
  for (int64_t k = 0; k <= last || gen.has_work(); ++k) {
    for (size_t i = 0; i < prompts.size(); ++i) {
      if (arrivals[i] != k) continue;
      try {
        id[i] = gen.add(prompts[i], params);
        index[id[i]] = i;
      } catch (const muse_spark::RequestError& e) {
        outs[i].finish_reason = "error";
        outs[i].error = std::string("RequestError: ") + e.what();
      }
    }
    for (const auto& c : cancels)
      if (c.second == k && id[c.first] >= 0) gen.cancel(id[c.first]);
    if (gen.has_work())
      for (const auto& ev : gen.step())
        if (on_tokens && !ev.tokens.empty()) on_tokens(index.at(ev.request), ev.tokens);
  }
  for (const auto& [request, i] : index) outs[i] = gen.output(request);
  return outs;
}

int usage(const std::string& why) {
  std::cerr << "muse_spark_generate: " << why << "\n"
            << "usage: muse_spark_generate --engine DIR --prompt-ids IDS [--prompt-ids IDS ...] [--max-tokens N]\n"
               "       [--temperature T] [--seed S] [--stop-ids IDS] [--ignore-eos] [--stream] [--max-batch N]\n"
               "       [--threads N] [--no-verify] [--no-cuda-graphs] [--arrivals K0,K1,...] [--cancel I@K ...]\n"
               "       muse_spark_generate --info\n";
  return 64;
}

}  // namespace

int main(int argc, char** argv) {
  std::string engine_dir;
  std::vector<std::vector<int64_t>> prompts;
  muse_spark::SamplingParams params;
  muse_spark::OpenOptions options;
  bool stream = false;
  std::vector<int64_t> arrivals;
  std::vector<std::pair<size_t, int64_t>> cancels;  // (prompt index, iteration)
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
        return argv[++i];
      };
      if (a == "--info") {
        std::cout << "{\"package_layout\": " << quoted(muse_spark::package_layout())
                  << ", \"embedding_version\": " << muse_spark::embedding_version()
                  << ", \"torch\": " << quoted(muse_spark::torch_version())
                  << ", \"checks_hashes\": " << (muse_spark::checks_hashes() ? "true" : "false") << "}" << std::endl;
        return 0;
      } else if (a == "--engine") {
        engine_dir = value();
      } else if (a == "--prompt-ids") {
        prompts.push_back(parse_ids(value(), a));
      } else if (a == "--max-tokens") {
        params.max_tokens = std::stoll(value());
      } else if (a == "--temperature") {
        params.temperature = std::stod(value());
      } else if (a == "--seed") {
        params.seed = std::stoull(value());
      } else if (a == "--stop-ids") {
        params.stop_token_ids = parse_ids(value(), a);
      } else if (a == "--ignore-eos") {
        params.ignore_eos = true;
      } else if (a == "--stream") {
        stream = true;
      } else if (a == "--max-batch") {
        options.max_batch = std::stoll(value());
      } else if (a == "--arrivals") {
        arrivals = parse_ids(value(), a);
      } else if (a == "--cancel") {
        std::vector<int64_t> ik = parse_ids([&] { std::string v = value(); std::replace(v.begin(), v.end(), '@', ','); return v; }(), a);
        if (ik.size() != 2 || ik[0] < 0 || ik[1] < 0) throw std::invalid_argument("--cancel takes I@K");
        cancels.emplace_back(static_cast<size_t>(ik[0]), ik[1]);
      } else if (!muse_spark_examples::engine_flag(a, value, options)) {
        return usage("unknown argument " + a);
      }
    }
  } catch (const std::exception& e) {
    return usage(e.what());
  }
  if (engine_dir.empty()) return usage("--engine is required");
  if (prompts.empty()) return usage("give at least one --prompt-ids");
  if (!arrivals.empty() && arrivals.size() != prompts.size())
    return usage("--arrivals needs one iteration per --prompt-ids");
  for (const auto& c : cancels)
    if (c.first >= prompts.size()) return usage("--cancel names a request past the prompts");

  std::unique_ptr<muse_spark::Engine> engine = muse_spark_examples::open_engine(engine_dir, options);
  if (!engine) return 2;
  muse_spark::TokenCallback on_tokens = nullptr;
  if (stream)
    on_tokens = [](size_t r, const std::vector<int64_t>& tokens) {
      std::cout << "{\"request\": " << r << ", \"tokens\": " << ids_json(tokens) << "}" << std::endl;
    };
  std::vector<muse_spark::Output> outs;
  try {
    if (arrivals.empty() && cancels.empty()) {
      outs = engine->generate(prompts, {params}, on_tokens);
    } else {
      outs = over_time(*engine, prompts, params, arrivals, cancels, on_tokens);
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
  for (size_t i = 0; i < outs.size(); ++i) {
    const auto& o = outs[i];
    std::cout << "{\"request\": " << i << ", \"output_ids\": " << ids_json(o.tokens)
              << ", \"finish_reason\": " << quoted(o.finish_reason) << ", \"steps\": " << o.steps
              << ", \"accepted_draft_tokens\": " << o.accepted_draft_tokens << ", \"confidence\": [";
    for (size_t k = 0; k < o.confidence.size(); ++k) {
      std::cout << (k ? ", [" : "[");
      for (size_t j = 0; j < o.confidence[k].size(); ++j) std::cout << (j ? ", " : "") << o.confidence[k][j];
      std::cout << "]";
    }
    std::cout << "]";
    if (!o.error.empty()) std::cout << ", \"error\": " << quoted(o.error);
    std::cout << "}" << std::endl;
  }
  return 0;
}
