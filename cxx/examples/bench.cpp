// muse_spark_bench: the speculative step's latency and the generated tokens/s of the C++ embedding over an
// aoti engine directory, batch size by batch size.
//
//   muse_spark_bench --engine DIR [--batches 1,8,32] [--max-tokens N] [--prompt-len L] [--warmup K]
//                    [--json FILE] [--threads N] [--no-verify] [--no-cuda-graphs]
//
// For each batch size B (those above the engine's max_batch are skipped, saying so on stderr), B requests
// of the same prompt (L token ids, (7 + 31·j) mod vocab) generate N tokens each, greedy, ignoring EOS,
// through a muse_spark::Generator: one iteration admits them all (their prefills), then every iteration is
// one speculative step over all B. The rows are alike, so the requests finish at the same step: every
// timed step runs with all slots busy. K steps of the same batch run first, untimed (a first call of a
// package allocates and warms up). A CUDA engine's device is synchronized around every timed iteration
// (Engine::synchronize).
//
// One JSON object a line on stdout, per batch size: {"batch", "step_ms_median", "step_ms_mean" (the
// speculative steps; null without one), "tokens_per_s" (every generated token over the time from the
// admission to the last step: end to end, prefills included), "steps" (speculative steps), "accepted_per_step"
// (accepted drafts per request and step), "tokens", "seconds"}; with --json, the list of them in FILE.
// An engine that cannot run here: the reason on stderr, exit status 2. Bad arguments: exit status 64.
#include <muse_spark/engine.h>

#include "arguments.h"

#include <algorithm>
#include <chrono>
#include <fstream>
#include <iostream>
#include <numeric>
#include <sstream>
#include <string>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

std::vector<int64_t> parse_sizes(const std::string& s, const std::string& flag) {
  std::vector<int64_t> out = muse_spark_examples::parse_integers(s, flag, "a batch size >= 1", 1);
  if (out.empty()) throw std::invalid_argument(flag + " needs at least one batch size");
  return out;
}

int64_t parse_count(const std::string& s, const std::string& flag, int64_t least) {
  return muse_spark_examples::parse_integer(s, flag, "an integer >= " + std::to_string(least), least);
}

std::string number(double x, int digits) {
  std::ostringstream o;
  o.setf(std::ios::fixed);
  o.precision(digits);
  o << x;
  return o.str();
}

struct Result {
  int64_t batch = 0, steps = 0, tokens = 0;
  bool cuda_graphs = false;
  double step_ms_median = 0, step_ms_mean = 0, tokens_per_s = 0, accepted_per_step = 0, seconds = 0;

  std::string json() const {
    auto ms = [&](double v) { return steps ? number(v, 4) : std::string("null"); };
    return "{\"batch\": " + std::to_string(batch) + ", \"step_ms_median\": " + ms(step_ms_median) +
           ", \"step_ms_mean\": " + ms(step_ms_mean) + ", \"tokens_per_s\": " + number(tokens_per_s, 2) +
           ", \"steps\": " + std::to_string(steps) + ", \"accepted_per_step\": " + number(accepted_per_step, 4) +
           ", \"tokens\": " + std::to_string(tokens) + ", \"seconds\": " + number(seconds, 6) +
           ", \"cuda_graphs\": " + (cuda_graphs ? "true" : "false") + "}";
  }
};

// B requests of `prompt` admitted at once (the Generator's first iteration: their prefills).
void admit(muse_spark::Generator& gen, int64_t batch, const std::vector<int64_t>& prompt,
           const muse_spark::SamplingParams& params) {
  for (int64_t i = 0; i < batch; ++i) gen.add(prompt, params);
  gen.step();
}

Result run_batch(muse_spark::Engine& engine, int64_t batch, const std::vector<int64_t>& prompt,
                 const muse_spark::SamplingParams& params, int64_t warmup) {
  if (warmup > 0) {  // (its own Generator: the timed run starts from free slots)
    muse_spark::Generator gen(engine);
    admit(gen, batch, prompt, params);
    for (int64_t k = 0; k < warmup && gen.has_work(); ++k) gen.step();
    engine.synchronize();
  }
  muse_spark::Generator gen(engine);
  std::vector<int64_t> ids;
  for (int64_t i = 0; i < batch; ++i) ids.push_back(gen.add(prompt, params));
  std::vector<double> step_ms;
  engine.synchronize();
  const auto start = Clock::now();
  gen.step();  // the admission: every request's prefill (batch <= max_batch: all slots are free)
  engine.synchronize();
  while (gen.has_work()) {  // from here, each iteration is one speculative step over the whole batch
    const auto t0 = Clock::now();
    gen.step();
    engine.synchronize();
    step_ms.push_back(std::chrono::duration<double, std::milli>(Clock::now() - t0).count());
  }
  Result r;
  r.batch = batch;
  r.cuda_graphs = engine.cuda_graphs();
  r.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  int64_t request_steps = 0, accepted = 0;
  for (int64_t id : ids) {
    const muse_spark::Output& o = gen.output(id);
    if (o.finish_reason == "error") throw std::runtime_error("a benchmark request failed: " + o.error);
    r.tokens += static_cast<int64_t>(o.tokens.size());
    request_steps += o.steps;
    accepted += o.accepted_draft_tokens;
  }
  r.steps = static_cast<int64_t>(step_ms.size());
  if (request_steps != r.steps * batch)  // (alike rows give alike tokens; a kernel whose rows differ would not)
    std::cerr << "muse_spark_bench: batch " << batch << ": the requests did not all finish at the last step: "
              << "some steps ran with slots free" << std::endl;
  if (r.steps) {
    r.step_ms_mean = std::accumulate(step_ms.begin(), step_ms.end(), 0.0) / static_cast<double>(r.steps);
    std::vector<double> sorted = step_ms;
    std::sort(sorted.begin(), sorted.end());
    const size_t mid = sorted.size() / 2;
    r.step_ms_median = sorted.size() % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
  }
  r.tokens_per_s = r.seconds > 0 ? static_cast<double>(r.tokens) / r.seconds : 0.0;
  r.accepted_per_step = request_steps ? static_cast<double>(accepted) / static_cast<double>(request_steps) : 0.0;
  return r;
}

int usage(const std::string& why) {
  std::cerr << "muse_spark_bench: " << why << "\n"
            << "usage: muse_spark_bench --engine DIR [--batches 1,8,32] [--max-tokens N] [--prompt-len L]\n"
               "       [--warmup K] [--json FILE] [--threads N] [--no-verify] [--no-cuda-graphs]\n";
  return 64;
}

}  // namespace

int main(int argc, char** argv) {
  std::string engine_dir, json_path;
  std::vector<int64_t> batches = {1, 8, 32};
  int64_t max_tokens = 64, prompt_len = 32, warmup = 2;
  muse_spark::OpenOptions options;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument(a + " needs a value");
        return argv[++i];
      };
      if (a == "--engine") {
        engine_dir = value();
      } else if (a == "--batches") {
        batches = parse_sizes(value(), a);
      } else if (a == "--max-tokens") {
        max_tokens = parse_count(value(), a, 1);
      } else if (a == "--prompt-len") {
        prompt_len = parse_count(value(), a, 1);
      } else if (a == "--warmup") {
        warmup = parse_count(value(), a, 0);
      } else if (a == "--json") {
        json_path = value();
      } else if (!muse_spark_examples::engine_flag(a, value, options)) {
        return usage("unknown argument " + a);
      }
    }
  } catch (const std::exception& e) {
    return usage(e.what());
  }
  if (engine_dir.empty()) return usage("--engine is required");

  std::unique_ptr<muse_spark::Engine> engine = muse_spark_examples::open_engine(engine_dir, options);
  if (!engine) return 2;
  std::vector<int64_t> prompt(static_cast<size_t>(prompt_len));
  for (int64_t j = 0; j < prompt_len; ++j) prompt[static_cast<size_t>(j)] = (7 + 31 * j) % engine->vocab_size();
  muse_spark::SamplingParams params;
  params.max_tokens = max_tokens;
  params.temperature = 0.0;
  params.ignore_eos = true;  // every request generates N tokens: the batch stays full to the end
  try {
    engine->validate(prompt, params);
  } catch (const muse_spark::RequestError& e) {  // (--prompt-len + --max-tokens past the engine's max_seq)
    return usage(e.what());
  }
  std::ofstream json_out;
  if (!json_path.empty()) {  // (opened first: a long run does not end on a file it cannot write)
    json_out.open(json_path);
    if (!json_out) return usage("--json: cannot write " + json_path);
  }
  std::cerr << "muse_spark_bench: " << engine_dir << " on " << engine->device() << ", max_batch "
            << engine->max_batch() << ", γ " << engine->gamma()
            << (engine->cuda_graphs() ? ", CUDA graphs (" + std::to_string(engine->programmatic_edges()) +
                                            " programmatic edges)" : std::string())
            << "; prompt " << prompt_len << " tokens, "
            << max_tokens << " generated per request, " << warmup << " warm-up steps" << std::endl;
  std::vector<Result> results;
  try {
    for (int64_t b : batches) {
      if (b > engine->max_batch()) {
        std::cerr << "muse_spark_bench: batch " << b << " exceeds the engine's max_batch " << engine->max_batch()
                  << ": skipped" << std::endl;
        continue;
      }
      results.push_back(run_batch(*engine, b, prompt, params, warmup));
      std::cout << results.back().json() << std::endl;
    }
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 1;
  }
  if (json_out.is_open()) {
    json_out << "[";
    for (size_t i = 0; i < results.size(); ++i) json_out << (i ? ",\n " : "") << results[i].json();
    json_out << "]\n";
    if (!json_out.flush()) {
      std::cerr << "error: cannot write " << json_path << std::endl;
      return 1;
    }
  }
  return 0;
}
