// Muse Spark DSpark: C++ embedding of an `aoti` engine directory (docs/cxx.md; docs/design.md, section 8).
//
// The library loads an engine built by `muse-spark build --backend aoti` with the AOTI C++
// package loader and runs lossless speculative generation over it: prompt chunks through the
// prefill packages, then speculative steps (draft block + Markov loop, the target layers, the
// verification, the draft context) through the step packages of the smallest batch bucket that
// fits, with in-flight batching (requests join when a slot is free and leave when they finish).
// Its tokens are the Python runtime's (`muse_spark.runtime.Generator` over `AOTIEngine`), token
// for token, greedy and sampled given the same seeds. It takes and returns token ids.
//
// It refuses, with an EngineError that says why (the Python runtime's message where it refuses the
// same), an engine that is not an aoti engine, was built by another muse-spark (package layout,
// embedding section, kernel options or plugin versions it does not know), for another device kind or
// compute capability, with another torch than the one this library links, whose manifest does not
// hold together (limits, file names outside the directory, schedule) or whose files do not match
// the manifest's hashes. It follows the manifest's confidence schedule as the Python runtime does.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace muse_spark {

// An engine directory this library cannot run here; the message says why.
class EngineError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A request that cannot be served; nothing was allocated or run for it.
class RequestError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

struct SamplingParams {
  int64_t max_tokens = 16;
  double temperature = 0.0;  // 0 (or below 1e-5) = greedy
  uint64_t seed = 0;         // keys the sampling noise with the position: a request's output is its own
  std::vector<int64_t> stop_token_ids;
  bool ignore_eos = false;   // otherwise the target's eos ids stop a request too
};

struct Output {
  std::vector<int64_t> tokens;  // the generated ids (the first from the prompt's prefill)
  std::string finish_reason;    // "stop", "length", "cancelled" or "error"; empty while it runs
  std::string error;            // why, for "error" (the request alone failed)
  int64_t steps = 0;            // speculative steps the request took part in
  int64_t accepted_draft_tokens = 0;
  // per speculative step: the draft's confidence head over its γ drafts (DSpark's c_k; zeros for a
  // draft without the head)
  std::vector<std::vector<float>> confidence;
};

struct OpenOptions {
  int64_t max_batch = 0;       // request slots; 0 = the engine's max_batch
  bool verify_hashes = true;   // sha256 of every engine file against the manifest
  // A CUDA engine's steps captured in CUDA graphs, one per batch bucket, and replayed (chained where
  // the manifest's chained_steps is on and no schedule is); off: the packages run call by call.
  bool cuda_graphs = true;
};

// Called with (request index, tokens) each time a request emits tokens.
using TokenCallback = std::function<void(size_t, const std::vector<int64_t>&)>;

class Engine {
 public:
  // Load an engine directory (throws EngineError).
  static std::unique_ptr<Engine> open(const std::string& engine_dir, const OpenOptions& options = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  int64_t gamma() const;
  int64_t max_seq() const;
  int64_t max_batch() const;
  int64_t vocab_size() const;
  std::string device() const;  // "cpu" or "cuda:N"
  bool cuda_graphs() const;     // whether its steps replay CUDA graphs (a CUDA engine, OpenOptions::cuda_graphs)
  // the edges into the manifest's pdl_kernels its captured graphs launch programmatically (PDL; 0 without)
  int64_t programmatic_edges() const;
  // Wait until the engine's device has finished the work queued on it (a no-op on CPU): a caller that
  // times steps on a CUDA engine (muse_spark_bench) needs it, the packages' kernels run asynchronously.
  void synchronize() const;

  // Throws RequestError, with the Python runtime's message, for a request that cannot be served.
  void validate(const std::vector<int64_t>& prompt, const SamplingParams& params) const;

  // Generate every request (a Generator over this engine, run until all have finished). A request
  // that fails validation or whose prefill fails finishes with "error" and its reason; the others
  // are served. `params` has one entry per prompt, or one for all.
  std::vector<Output> generate(const std::vector<std::vector<int64_t>>& prompts,
                               const std::vector<SamplingParams>& params,
                               const TokenCallback& on_tokens = nullptr);

  struct Impl;

 private:
  friend class Generator;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// What one scheduler iteration did for one request.
struct Event {
  int64_t request = -1;         // the id add() returned
  std::vector<int64_t> tokens;  // emitted now (clipped at a stop token and max_tokens)
  bool finished = false;
  std::vector<float> confidence;  // a speculative step's: the confidence head over its γ drafts (else empty)
  std::string finish_reason;    // once finished: "stop", "length", "cancelled" or "error"
  std::string error;
};

// Requests that arrive and leave over time (runtime/generator.py's Generator): add() validates a
// request and queues it; each step() either admits queued requests (their prefill: the first token)
// while slots are free, or runs one speculative step over every active request. One Generator at a
// time owns an engine's slots and caches; the engine must outlive it. Neither is thread-safe: one
// thread drives an engine and its generator.
class Generator {
 public:
  explicit Generator(Engine& engine);  // throws std::logic_error if the engine already has one
  ~Generator();
  Generator(const Generator&) = delete;
  Generator& operator=(const Generator&) = delete;

  int64_t add(const std::vector<int64_t>& prompt, const SamplingParams& params);  // throws RequestError
  void cancel(int64_t request);  // a queued or active request finishes "cancelled", its slot freed
  bool has_work() const;         // requests queued or active
  std::vector<Event> step();     // one iteration: the requests that emitted tokens or finished
  const Output& output(int64_t request) const;  // everything a request has emitted so far

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

// The package layout this library drives (the manifest's aoti.layout) and the version of the
// manifest's embedding section it reads.
const char* package_layout();
int embedding_version();
// torch.__version__ of the torch this library was built against.
const char* torch_version();
// Whether this build can check an engine's file hashes (OpenSSL's libcrypto found at build time).
bool checks_hashes();

}  // namespace muse_spark
