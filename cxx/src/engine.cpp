// The C++ embedding of an aoti engine: see include/muse_spark/engine.h, and docs/cxx.md.
//
// It mirrors the Python runtime over the same packages: runtime/aoti_engine.py (the checks, the
// prompt chunks), muse_spark/graphs/parts.py (LayeredPrefill, LayeredStep: the order of the parts and
// their flat inputs), runtime/cuda_graph.py (StaticStep: padding rows, the Markov workspace and
// its retry) and runtime/generator.py (admission, the emitted tokens, stop and length). What the
// Python runtime derives from its modules, the builder wrote into the manifest's "embedding"
// section (builder/embedder.py).
#include "muse_spark/engine.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#ifdef MUSE_SPARK_SHA256
#include <openssl/evp.h>
#endif
#include <torch/csrc/inductor/aoti_package/model_package_loader.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#ifdef MUSE_SPARK_CUDA
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime_api.h>
#endif

#ifndef MUSE_SPARK_TORCH_VERSION
#error "MUSE_SPARK_TORCH_VERSION (torch.__version__ of the torch linked) must be defined by the build"
#endif

namespace muse_spark {

using json = nlohmann::json;
using Tensors = std::vector<at::Tensor>;
using Loader = torch::inductor::AOTIModelPackageLoader;

namespace {

constexpr const char* kFormat = "muse-spark-engine";
constexpr int kSchemaVersion = 1;
constexpr const char* kLayout = "layered-7";  // muse_spark/graphs/parts.py LAYOUT
constexpr int kEmbeddingVersion = 1;          // builder/embedder.py EMBEDDING_VERSION
constexpr int kMarkovErrorWord = 2;           // muse_spark/graphs/parts.py MARKOV_ERROR_WORD (documentation)
constexpr double kGreedyBelow = 1e-5;         // runtime/generator.py GREEDY_BELOW

#ifdef MUSE_SPARK_SHA256
std::string hex_sha256(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw EngineError("cannot read " + path);
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
  std::vector<char> buf(1 << 22);
  while (in) {
    in.read(buf.data(), static_cast<std::streamsize>(buf.size()));
    if (in.gcount() > 0) EVP_DigestUpdate(ctx, buf.data(), static_cast<size_t>(in.gcount()));
  }
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  EVP_DigestFinal_ex(ctx, md, &len);
  EVP_MD_CTX_free(ctx);
  static const char* digits = "0123456789abcdef";
  std::string out;
  for (unsigned int i = 0; i < len; ++i) {
    out += digits[md[i] >> 4];
    out += digits[md[i] & 15];
  }
  return out;
}
#endif

at::ScalarType dtype_from_name(const std::string& name, const std::string& where) {
  static const std::map<std::string, at::ScalarType> names = {
      {"bfloat16", at::kBFloat16}, {"float16", at::kHalf}, {"float32", at::kFloat}, {"float64", at::kDouble},
      {"int64", at::kLong},        {"int32", at::kInt},    {"int16", at::kShort},   {"int8", at::kChar},
      {"uint8", at::kByte},        {"bool", at::kBool}};
  auto it = names.find(name);
  if (it == names.end()) throw EngineError(where + ": unknown dtype '" + name + "'");
  return it->second;
}

at::ScalarType dtype_from_safetensors(const std::string& name, const std::string& where) {
  static const std::map<std::string, at::ScalarType> names = {
      {"BF16", at::kBFloat16}, {"F16", at::kHalf}, {"F32", at::kFloat}, {"F64", at::kDouble}, {"I64", at::kLong},
      {"I32", at::kInt},       {"I16", at::kShort}, {"I8", at::kChar},  {"U8", at::kByte},    {"BOOL", at::kBool}};
  auto it = names.find(name);
  if (it == names.end()) throw EngineError(where + ": unsupported safetensors dtype '" + name + "'");
  return it->second;
}

std::string shape_str(at::IntArrayRef s) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < s.size(); ++i) o << (i ? ", " : "") << s[i];
  o << "]";
  return o.str();
}

// One safetensors file: its header, and the tensors read from it on request (each read once,
// straight into a tensor of its own: no second copy of the file in memory).
class SafetensorsFile {
 public:
  explicit SafetensorsFile(std::string path) : path_(std::move(path)), in_(path_, std::ios::binary) {
    if (!in_) throw EngineError("cannot open " + path_);
    in_.seekg(0, std::ios::end);
    size_ = static_cast<uint64_t>(in_.tellg());
    in_.seekg(0);
    unsigned char n8[8];
    if (size_ < 8 || !in_.read(reinterpret_cast<char*>(n8), 8)) throw EngineError(path_ + ": not a safetensors file");
    uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | n8[i];
    if (n > size_ - 8) throw EngineError(path_ + ": not a safetensors file (header length past the end)");
    std::string text(n, '\0');
    in_.read(text.data(), static_cast<std::streamsize>(n));
    try {
      header_ = json::parse(text);
    } catch (const json::exception& e) {
      throw EngineError(path_ + ": unreadable safetensors header: " + e.what());
    }
    data_start_ = 8 + n;
  }

  at::Tensor get(const std::string& key) {
    if (!header_.contains(key) || key == "__metadata__")
      throw EngineError(path_ + ": tensor '" + key + "' is missing");
    const json& h = header_[key];
    at::ScalarType dt = dtype_from_safetensors(h.at("dtype").get<std::string>(), path_ + ": " + key);
    std::vector<int64_t> shape = h.at("shape").get<std::vector<int64_t>>();
    uint64_t b = h.at("data_offsets")[0].get<uint64_t>(), e = h.at("data_offsets")[1].get<uint64_t>();
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(dt));
    uint64_t bytes = static_cast<uint64_t>(t.nbytes());
    if (e < b || e - b != bytes || data_start_ + e > size_)
      throw EngineError(path_ + ": tensor '" + key + "' has data offsets that do not fit its shape " +
                        shape_str(t.sizes()) + " or the file");
    in_.seekg(static_cast<std::streamoff>(data_start_ + b));
    if (bytes && !in_.read(static_cast<char*>(t.data_ptr()), static_cast<std::streamsize>(bytes)))
      throw EngineError(path_ + ": tensor '" + key + "' cannot be read");
    return t;
  }

 private:
  std::string path_;
  std::ifstream in_;
  uint64_t size_ = 0, data_start_ = 0;
  json header_;
};

Tensors pick(const Tensors& all, const std::vector<int64_t>& idx) {
  Tensors out;
  out.reserve(idx.size());
  for (int64_t i : idx) out.push_back(all[static_cast<size_t>(i)]);
  return out;
}

void append(Tensors& to, const Tensors& from) { to.insert(to.end(), from.begin(), from.end()); }

// plugins/norm.py's rms_norm, op for op (fp32: y = x·rsqrt(mean(x²)+eps), ·(1+w) or ·w; → out).
at::Tensor rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& weight, double eps, bool zero_centered,
                    at::ScalarType out) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor y = xf * at::rsqrt(xf.pow(2).mean({-1}, /*keepdim=*/true) + eps);
  if (weight.has_value()) {
    at::Tensor w = weight->to(at::kFloat);
    y = zero_centered ? y * (1.0 + w) : y * w;
  }
  return y.to(out);
}

struct Request {
  int64_t id = 0;
  std::vector<int64_t> prompt;
  SamplingParams params;
  int64_t seed = 0;  // as the graphs take it: int64 (two's complement of the uint64)
  double temperature = 0.0;
  std::set<int64_t> stop;
  int64_t slot = -1, anchor = -1, position = -1;
  bool finished = false;
  Output out;
};

}  // namespace

// ---- the engine -------------------------------------------------------------------------------
struct Engine::Impl {
  std::string dir;
  json manifest;
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kBFloat16;
  int64_t gamma = 0, max_seq = 0, max_batch = 0, vocab = 0, prefill_chunk = 0, scratch_slot = 0;
  // the last step's confidence head values, per batch row: the draft package's fifth output
  std::vector<std::vector<float>> last_confidence;
  std::set<int64_t> eos;
  bool has_generator = false;  // one Generator at a time owns the slots and caches
  Tensors weights;
  std::vector<int64_t> head_idx;
  std::vector<std::vector<int64_t>> layer_idx;
  std::set<int64_t> aux;
  int64_t last_aux = 0;
  int64_t embed_idx = 0, norm_idx = -1;
  double norm_eps = 0.0;
  bool norm_zero_centered = false;
  Tensors tk, tv, dk, dv;  // the KV caches: target per layer, draft context per layer
  std::unique_ptr<Loader> prefill_layer, prefill_finish;
  struct Bucket {
    int64_t size = 0;
    std::unique_ptr<Loader> draft, layer, verify, context;
    at::Tensor markov_ws;
  };
  std::vector<Bucket> buckets;  // ascending

  std::unique_ptr<Loader> load(const std::string& name) {
    const json& graphs = manifest.at("aoti").at("graphs");
    if (!graphs.contains(name)) throw EngineError(dir + ": the manifest lists no package '" + name + "'");
    std::string path = dir + "/" + graphs.at(name).at("file").get<std::string>();
    try {
      return std::make_unique<Loader>(path, "model", /*run_single_threaded=*/false, /*num_runners=*/1,
                                      device.is_cuda() ? device.index() : static_cast<c10::DeviceIndex>(-1));
    } catch (const std::exception& e) {
      throw EngineError("AOTI package " + path + " cannot be loaded: " + e.what());
    }
  }

  // LayeredPrefill / LayeredStep's layers: → (h, the aux streams); after_aux runs once the last
  // aux layer has run.
  std::pair<at::Tensor, Tensors> layers(Loader& layer, at::Tensor stream, at::Tensor x, const at::Tensor& positions,
                                        const at::Tensor& slots, const std::function<void(const Tensors&)>& after_aux) {
    Tensors aux_streams;
    for (size_t i = 0; i < layer_idx.size(); ++i) {
      Tensors in = pick(weights, layer_idx[i]);
      append(in, {tk[i], tv[i], stream, x, positions, slots});
      Tensors out = layer.run(in);
      stream = out.at(0);
      x = out.at(1);
      if (aux.count(static_cast<int64_t>(i))) aux_streams.push_back(stream);
      if (static_cast<int64_t>(i) == last_aux && after_aux) after_aux(aux_streams);
    }
    return {x, aux_streams};
  }

  at::TensorOptions i64() const { return at::TensorOptions().dtype(at::kLong).device(device); }

  // AOTIEngine.prefill: the prompt in static chunks (the last one padded) → the first token.
  int64_t prefill(const std::vector<int64_t>& prompt, int64_t slot, int64_t seed, double temperature) {
    const int64_t C = prefill_chunk, L = static_cast<int64_t>(prompt.size());
    at::Tensor slots = at::full({1}, slot, i64());
    at::Tensor seeds = at::full({1}, seed, i64());
    at::Tensor temps = at::full({1}, temperature, at::TensorOptions().dtype(at::kFloat).device(device));
    Tensors head = pick(weights, head_idx);
    c10::optional<at::Tensor> norm_w;
    if (norm_idx >= 0) norm_w = weights[static_cast<size_t>(norm_idx)];
    at::Tensor first;
    for (int64_t start = 0; start < L; start += C) {
      int64_t n = std::min(C, L - start);
      at::Tensor tokens = at::zeros({1, C}, at::kLong);
      std::memcpy(tokens.data_ptr<int64_t>(), prompt.data() + start, static_cast<size_t>(n) * sizeof(int64_t));
      tokens = tokens.to(device);
      at::Tensor positions = at::arange(start, start + C, at::kLong).clamp_max(max_seq - 1).unsqueeze(0).to(device);
      at::Tensor last = at::full({1}, n - 1, i64());
      // embed_and_norm: the FP32 stream entering layer 0 and its input norm, uncompiled
      at::Tensor stream = at::embedding(weights[static_cast<size_t>(embed_idx)], tokens).to(at::kFloat);
      at::Tensor x = rms_norm(stream.to(dtype), norm_w, norm_eps, norm_zero_centered, dtype);
      auto [h, aux_streams] = layers(*prefill_layer, stream, x, positions, slots, nullptr);
      Tensors in = head;
      append(in, dk);
      append(in, dv);
      in.push_back(h);
      append(in, aux_streams);
      append(in, {positions, slots, last, seeds, temps});
      first = prefill_finish->run(in).at(0);
    }
    return first.to(at::kCPU).item<int64_t>();
  }

  Bucket& bucket_for(size_t n) {
    for (Bucket& b : buckets)
      if (b.size >= static_cast<int64_t>(n)) return b;
    throw std::invalid_argument("batch of " + std::to_string(n) + " exceeds the engine's largest bucket");
  }

  // LayeredStep over a bucket's packages, the rows padded as StaticStep pads them → packed rows.
  std::vector<std::vector<int64_t>> step_once(Bucket& b, const std::vector<Request*>& batch) {
    const int64_t B = b.size;
    std::vector<int64_t> anchor(B, 0), anchor_pos(B, 0), slots(B, scratch_slot), seeds(B, 0);
    std::vector<float> temps(B, 0.0f);
    for (size_t i = 0; i < batch.size(); ++i) {
      anchor[i] = batch[i]->anchor;
      anchor_pos[i] = batch[i]->position;
      slots[i] = batch[i]->slot;
      seeds[i] = batch[i]->seed;
      temps[i] = static_cast<float>(batch[i]->temperature);
    }
    auto dev = [&](std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(device); };
    at::Tensor a = dev(anchor), ap = dev(anchor_pos), sl = dev(slots), sd = dev(seeds);
    at::Tensor tp = at::tensor(temps, at::kFloat).to(device);
    at::Tensor positions = ap.unsqueeze(1) + at::arange(gamma + 1, i64());
    Tensors head = pick(weights, head_idx);

    Tensors in = head;
    append(in, dk);
    append(in, dv);
    append(in, {b.markov_ws, a, ap, sl, sd, tp, positions});
    Tensors drafted = b.draft->run(in);  // ids, probs, stream, x, confidence (every draft is verified)
    {
      at::Tensor conf = drafted.at(4).to(at::kCPU).to(at::kFloat).contiguous();
      const float* c = conf.data_ptr<float>();
      last_confidence.clear();
      for (size_t i = 0; i < batch.size(); ++i) last_confidence.emplace_back(c + i * gamma, c + (i + 1) * gamma);
    }
    auto context = [&](const Tensors& aux_streams) {
      Tensors c = head;
      append(c, dk);
      append(c, dv);
      append(c, aux_streams);
      append(c, {positions, sl});
      b.context->run(c);
    };
    auto [h, aux_streams] = layers(*b.layer, drafted.at(2), drafted.at(3), positions, sl, context);
    Tensors v = head;
    append(v, {b.markov_ws, h, drafted.at(0), drafted.at(1), positions, sd, tp});
    at::Tensor packed = b.verify->run(v).at(0).to(at::kCPU).contiguous();
    std::vector<std::vector<int64_t>> rows;
    const int64_t W = packed.size(1);
    const int64_t* p = packed.data_ptr<int64_t>();
    for (size_t i = 0; i < batch.size(); ++i) rows.emplace_back(p + i * W, p + (i + 1) * W);
    return rows;
  }

  // StaticStep.step_host's retry: rows flagged by the fused Markov kernel (n = -1) run once more
  // on a zeroed workspace; a second failure is an error.
  std::vector<std::vector<int64_t>> step(const std::vector<Request*>& batch) {
    Bucket& b = bucket_for(batch.size());
    auto flagged = [&](const std::vector<std::vector<int64_t>>& rows) {
      if (!b.markov_ws.numel()) return false;
      for (const auto& r : rows)
        if (r[r.size() - 2] < 0) return true;
      return false;
    };
    auto rows = step_once(b, batch);
    if (flagged(rows)) {
      b.markov_ws.zero_();
      rows = step_once(b, batch);
      if (flagged(rows)) {
        b.markov_ws.zero_();
        throw EngineError("the fused Markov kernel failed twice in a row (word " +
                          std::to_string(kMarkovErrorWord) + " of its workspace): its programs were not all "
                          "resident at once");
      }
    }
    return rows;
  }
};

namespace {

json read_manifest(const std::string& dir) {
  std::ifstream in(dir + "/manifest.json");
  if (!in) {
    std::ifstream probe(dir);
    if (!probe) throw EngineError("engine directory " + dir + " does not exist");
    throw EngineError(dir + " is not an engine directory: manifest.json is missing (build one with `muse-spark build`)");
  }
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    throw EngineError(dir + ": manifest.json is not valid JSON: " + e.what());
  }
}

std::string device_kind_error(const std::string& dir, const std::string& built, const std::string& here) {
  return dir + ": engine was compiled for '" + built + "' and cannot run on '" + here +
         "' (AOTInductor packages are device-specific); rebuild it with --device " + here;
}

void check_manifest(const std::string& dir, const json& m, at::Device& device) {
  if (m.value("format", "") != kFormat)
    throw EngineError(dir + ": manifest.json is not a muse-spark engine manifest");
  if (m.value("schema_version", -1) != kSchemaVersion)
    throw EngineError(dir + ": engine schema version " + m.value("schema_version", json(nullptr)).dump() +
                      " is not supported (this library reads version " + std::to_string(kSchemaVersion) + ")");
  std::string backend = m.value("backend", "");
  if (backend != "aoti")
    throw EngineError(dir + ": backend '" + backend + "' is not an aoti engine: the C++ embedding runs aoti engines "
                      "(build one with `muse-spark build --backend aoti`)");
  if (!m.contains("aoti") || !m["aoti"].is_object())
    throw EngineError(dir + ": manifest lacks its 'aoti' section; rebuild the engine");
  std::string layout = m.at("aoti").value("layout", "");
  if (layout != kLayout)
    throw EngineError(dir + ": this aoti engine was built by another muse-spark (the packages' layout '" + layout +
                      "', this library's is '" + kLayout + "'); rebuild it");
  if (m.at("aoti").contains("kv_pool") && !m.at("aoti")["kv_pool"].is_null())
    throw EngineError(dir + ": this engine's KV caches are a paged pool (built with --kv-cache-tokens): the C++ "
                      "embedding runs engines with a cache window per slot; rebuild it without --kv-cache-tokens");
  if (!m.contains("embedding") || !m["embedding"].is_object())
    throw EngineError(dir + ": manifest lacks its 'embedding' section (the engine was built by a muse-spark "
                      "without the C++ embedding); rebuild it");
  int ev = m.at("embedding").value("version", -1);
  if (ev != kEmbeddingVersion)
    throw EngineError(dir + ": the manifest's embedding section is version " + std::to_string(ev) +
                      ", this library reads version " + std::to_string(kEmbeddingVersion) + "; rebuild the engine");
  // device kind, then torch, then compute capability: runtime/aoti_engine.py check_compatibility
  std::string kind = m.at("device").value("kind", "cpu");
  if (kind == "cuda") {
#ifdef MUSE_SPARK_CUDA
    if (c10::cuda::device_count() == 0)
      throw EngineError(dir + ": engine device is cuda but no CUDA device is available");
    device = at::Device(at::kCUDA, c10::cuda::current_device());
#else
    throw EngineError(device_kind_error(dir, "cuda", "cpu") + " (this library was built without CUDA)");
#endif
  } else if (kind == "cpu") {
    device = at::kCPU;
  } else {
    throw EngineError(dir + ": unknown device kind '" + kind + "'");
  }
  std::string built_torch = m.at("versions").value("torch", "");
  if (built_torch != MUSE_SPARK_TORCH_VERSION)
    throw EngineError(dir + ": engine was compiled with torch " + built_torch + ", this runtime has torch " +
                      MUSE_SPARK_TORCH_VERSION + ": AOTInductor packages are tied to the torch that compiled them; "
                      "rebuild the engine");
#ifdef MUSE_SPARK_CUDA
  if (device.is_cuda()) {
    const json& cc = m.at("device").at("compute_capability");
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, device.index()) != cudaSuccess)
      throw EngineError(dir + ": the properties of CUDA device " + std::to_string(device.index()) +
                        " cannot be read");
    std::string mine = std::to_string(prop.major) + "." + std::to_string(prop.minor);
    if (!cc.is_array() || cc.size() != 2 || cc[0].get<int>() != prop.major || cc[1].get<int>() != prop.minor) {
      std::string built = cc.is_array() && cc.size() == 2
                              ? std::to_string(cc[0].get<int>()) + "." + std::to_string(cc[1].get<int>())
                              : std::string("?");
      throw EngineError(dir + ": engine was compiled for compute capability " + built + " (" +
                        m.at("device").value("name", "?") + "), this device (" + prop.name + ") is " + mine +
                        ": its kernels cannot run here; rebuild the engine on it");
    }
  }
#endif
}

// Every file the manifest lists exists; with `hashes`, each matches its sha256 (runtime/engine.py).
void verify_files(const std::string& dir, const json& m, bool hashes) {
#ifndef MUSE_SPARK_SHA256
  if (hashes)
    throw EngineError(dir + ": this build of the library cannot check the engine files' hashes (OpenSSL's "
                      "libcrypto was not found when it was built): rebuild it with OpenSSL, or open the engine "
                      "with verify_hashes = false (--no-verify)");
#endif
  for (auto& [name, digest] : m.at("files").items()) {
    std::string path = dir + "/" + name;
    std::ifstream probe(path);
    if (!probe) throw EngineError(dir + ": engine file " + name + " is missing");
    if (!hashes) continue;
#ifdef MUSE_SPARK_SHA256
    std::string actual = hex_sha256(path), want = digest.get<std::string>();
    if (actual != want)
      throw EngineError(dir + ": engine file " + name + " does not match the manifest's hash (expected sha256 " +
                        want.substr(0, 16) + "…, got " + actual.substr(0, 16) +
                        "…): the engine is corrupted or was modified");
#else
    (void)digest;
#endif
  }
}

}  // namespace

std::unique_ptr<Engine> Engine::open(const std::string& engine_dir, const OpenOptions& options) {
  auto impl = std::make_unique<Impl>();
  Impl& e = *impl;
  e.dir = engine_dir;
  while (e.dir.size() > 1 && e.dir.back() == '/') e.dir.pop_back();
  e.manifest = read_manifest(e.dir);
  const json& m = e.manifest;
  try {
    check_manifest(e.dir, m, e.device);
    const int64_t engine_batch = m.at("max_batch").get<int64_t>();
    if (options.max_batch < 0 || options.max_batch > engine_batch)
      throw EngineError(e.dir + ": max_batch " + std::to_string(options.max_batch) + " must be in [1, " +
                        std::to_string(engine_batch) + "] (the engine's max_batch; 0: all of them)");
    verify_files(e.dir, m, options.verify_hashes);
    const json& a = m.at("aoti");
    const json& emb = m.at("embedding");
    e.dtype = dtype_from_name(m.at("dtype").get<std::string>(), e.dir);
    e.gamma = m.at("gamma").get<int64_t>();
    e.max_seq = m.at("max_seq").get<int64_t>();
    e.max_batch = options.max_batch ? options.max_batch : engine_batch;
    e.vocab = m.at("target_config").at("vocab_size").get<int64_t>();
    const json& eos = m.at("target_config").at("eos_token_id");
    if (eos.is_number_integer()) e.eos.insert(eos.get<int64_t>());
    else if (eos.is_array())
      for (const auto& t : eos) e.eos.insert(t.get<int64_t>());
    e.prefill_chunk = a.at("prefill_chunk").get<int64_t>();
    e.scratch_slot = a.at("scratch_slot").get<int64_t>();

    // weights: each from its engine file, cast to the dtype its graphs were compiled for
    const json& specs = a.at("weights");
    const json& sources = emb.at("weight_sources");
    if (sources.size() != specs.size())
      throw EngineError(e.dir + ": the embedding section names " + std::to_string(sources.size()) +
                        " weight sources for " + std::to_string(specs.size()) + " weights; rebuild the engine");
    std::map<std::string, std::unique_ptr<SafetensorsFile>> files;
    std::map<std::pair<std::string, std::string>, at::Tensor> loaded;  // tied weights load once
    for (size_t i = 0; i < specs.size(); ++i) {
      std::string name = specs[i][0].get<std::string>();
      std::vector<int64_t> shape = specs[i][1].get<std::vector<int64_t>>();
      at::ScalarType dt = dtype_from_name(specs[i][2].get<std::string>(), e.dir + ": weight " + name);
      auto key = std::make_pair(sources[i][0].get<std::string>(), sources[i][1].get<std::string>());
      auto hit = loaded.find(key);
      at::Tensor t;
      if (hit != loaded.end()) {
        t = hit->second;
      } else {
        auto& f = files[key.first];
        if (!f) f = std::make_unique<SafetensorsFile>(e.dir + "/" + key.first);
        t = f->get(key.second).to(dt).to(e.device);
        loaded[key] = t;
      }
      if (t.sizes() != at::IntArrayRef(shape) || t.scalar_type() != dt)
        throw EngineError(e.dir + ": weight " + name + " (" + key.first + ": " + key.second + ") has shape " +
                          shape_str(t.sizes()) + ", the graphs were compiled for " + shape_str(shape));
      e.weights.push_back(t);
    }
    e.head_idx = emb.at("head_weights").get<std::vector<int64_t>>();
    e.layer_idx = emb.at("layer_weights").get<std::vector<std::vector<int64_t>>>();
    for (int64_t i : emb.at("aux_layer_ids").get<std::vector<int64_t>>()) e.aux.insert(i);
    if (e.aux.empty()) throw EngineError(e.dir + ": the embedding section names no aux layers; rebuild the engine");
    e.last_aux = *e.aux.rbegin();
    const json& pe = emb.at("prefill_embed");
    e.embed_idx = pe.at("embedding").get<int64_t>();
    e.norm_idx = pe.at("norm").is_null() ? -1 : pe.at("norm").get<int64_t>();
    e.norm_eps = pe.at("eps").get<double>();
    e.norm_zero_centered = pe.at("zero_centered").get<bool>();
    auto check_index = [&](int64_t i) {
      if (i < 0 || i >= static_cast<int64_t>(e.weights.size()))
        throw EngineError(e.dir + ": the embedding section indexes weight " + std::to_string(i) + " of " +
                          std::to_string(e.weights.size()) + "; rebuild the engine");
    };
    for (int64_t i : e.head_idx) check_index(i);
    for (const auto& l : e.layer_idx)
      for (int64_t i : l) check_index(i);
    check_index(e.embed_idx);
    if (e.norm_idx >= 0) check_index(e.norm_idx);

    // caches: allocated once, zeroed (one slot more than max_batch: padding rows use it)
    for (const char* which : {"target", "draft"}) {
      const json& c = emb.at("caches").at(which);
      auto opts = at::TensorOptions().dtype(dtype_from_name(c.at("dtype").get<std::string>(), e.dir)).device(e.device);
      std::vector<int64_t> shape = c.at("shape").get<std::vector<int64_t>>();
      const bool target = std::string(which) == "target";
      Tensors& k = target ? e.tk : e.dk;
      Tensors& v = target ? e.tv : e.dv;
      for (int64_t i = 0; i < c.at("layers").get<int64_t>(); ++i) {
        k.push_back(at::zeros(shape, opts));
        v.push_back(at::zeros(shape, opts));
      }
    }
    if (static_cast<int64_t>(e.tk.size()) != static_cast<int64_t>(e.layer_idx.size()))
      throw EngineError(e.dir + ": the target cache has " + std::to_string(e.tk.size()) + " layers, the graphs " +
                        std::to_string(e.layer_idx.size()) + "; rebuild the engine");

    // packages: the prompt chunk's two, then each bucket's four (AOTIEngine's choice of buckets)
    e.prefill_layer = e.load("prefill_layer");
    e.prefill_finish = e.load("prefill_finish");
    std::vector<int64_t> all = a.at("batch_buckets").get<std::vector<int64_t>>(), use;
    std::sort(all.begin(), all.end());
    for (int64_t b : all)
      if (b <= e.max_batch) use.push_back(b);
    if (use.empty()) use.push_back(all.front());
    if (use.back() < e.max_batch)
      for (int64_t b : all)
        if (b >= e.max_batch) {
          use.push_back(b);
          break;
        }
    for (int64_t b : use) {
      Impl::Bucket k;
      k.size = b;
      std::string s = "_b" + std::to_string(b);
      k.draft = e.load("step_draft" + s);
      k.layer = e.load("step_layer" + s);
      k.verify = e.load("step_verify" + s);
      k.context = e.load("step_context" + s);
      const json& words = a.at("markov_workspace_words");
      if (!words.contains(std::to_string(b)) || !words[std::to_string(b)].is_number_integer())
        throw EngineError(e.dir + ": the manifest's markov_workspace_words has no valid entry for batch bucket " +
                          std::to_string(b) + "; rebuild the engine");
      k.markov_ws = at::zeros({words[std::to_string(b)].get<int64_t>()}, e.i64());
      e.buckets.push_back(std::move(k));
    }
  } catch (const json::exception& ex) {
    throw EngineError(e.dir + ": the manifest is malformed (" + ex.what() + "); rebuild the engine");
  } catch (const c10::Error& ex) {
    throw EngineError(e.dir + ": " + ex.what_without_backtrace());
  }
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

int64_t Engine::gamma() const { return impl_->gamma; }
int64_t Engine::max_seq() const { return impl_->max_seq; }
int64_t Engine::max_batch() const { return impl_->max_batch; }
int64_t Engine::vocab_size() const { return impl_->vocab; }
std::string Engine::device() const { return impl_->device.str(); }

// Generator.validate, message for message.
static void validate_request(const Engine::Impl& e, const std::vector<int64_t>& prompt, const SamplingParams& p) {
  auto list = [](const std::vector<int64_t>& v) {
    std::ostringstream o;
    o << "[";
    for (size_t i = 0; i < v.size() && i < 5; ++i) o << (i ? ", " : "") << v[i];
    o << "]";
    return o.str();
  };
  if (prompt.empty()) throw RequestError("the prompt is empty");
  std::vector<int64_t> bad;
  for (int64_t t : prompt)
    if (t < 0 || t >= e.vocab) bad.push_back(t);
  if (!bad.empty())
    throw RequestError("prompt token ids " + list(bad) + " are outside the vocabulary [0, " + std::to_string(e.vocab) +
                       ")");
  if (p.max_tokens < 1)
    throw RequestError("max_tokens must be a positive integer, got " + std::to_string(p.max_tokens));
  if (std::isnan(p.temperature) || std::isinf(p.temperature) || p.temperature < 0) {
    std::ostringstream o;
    o << p.temperature;
    throw RequestError("temperature must be a finite number >= 0, got " + o.str());
  }
  std::vector<int64_t> bad_stop;
  for (int64_t t : p.stop_token_ids)
    if (t < 0 || t >= e.vocab) bad_stop.push_back(t);
  if (!bad_stop.empty())
    throw RequestError("stop token ids " + list(bad_stop) + " are outside the vocabulary [0, " +
                       std::to_string(e.vocab) + ")");
  int64_t need = static_cast<int64_t>(prompt.size()) + p.max_tokens + e.gamma;
  if (need > e.max_seq)
    throw RequestError("prompt length " + std::to_string(prompt.size()) + " + max_tokens " +
                       std::to_string(p.max_tokens) + " (+ " + std::to_string(e.gamma) + " draft slots) = " +
                       std::to_string(need) + " exceeds the engine's maximum sequence length " +
                       std::to_string(e.max_seq));
}

void Engine::validate(const std::vector<int64_t>& prompt, const SamplingParams& p) const {
  validate_request(*impl_, prompt, p);
}

// ---- the generator: runtime/generator.py's Generator, its unchained form (each step's rows are read
// before the next step is launched), with the same admission order, slots and emitted tokens ------------
struct Generator::Impl {
  Engine::Impl& e;
  std::map<int64_t, Request> requests;  // by id
  std::vector<Request*> waiting, active;
  std::vector<int64_t> free_slots;
  int64_t next_id = 0;

  explicit Impl(Engine::Impl& engine) : e(engine) {
    for (int64_t s = e.max_batch - 1; s >= 0; --s) free_slots.push_back(s);  // pop_back() gives slot 0 first
  }

  void finish(Request& r, const std::string& reason) {
    if (r.finished) return;
    r.finished = true;
    r.out.finish_reason = reason;
    active.erase(std::remove(active.begin(), active.end(), &r), active.end());
    if (r.slot >= 0) {
      free_slots.push_back(r.slot);
      r.slot = -1;
    }
  }

  // Generator._emit: append tokens, clipped at the first stop token (kept) and at max_tokens.
  Event emit(Request& r, const std::vector<int64_t>& tokens) {
    Event ev;
    ev.request = r.id;
    int64_t room = r.params.max_tokens - static_cast<int64_t>(r.out.tokens.size());
    for (size_t i = 0; i < tokens.size() && static_cast<int64_t>(i) < room; ++i) {
      ev.tokens.push_back(tokens[i]);
      if (r.stop.count(tokens[i])) break;
    }
    r.out.tokens.insert(r.out.tokens.end(), ev.tokens.begin(), ev.tokens.end());
    if (!ev.tokens.empty() && r.stop.count(ev.tokens.back())) finish(r, "stop");
    else if (static_cast<int64_t>(r.out.tokens.size()) >= r.params.max_tokens) finish(r, "length");
    ev.finished = r.finished;
    ev.finish_reason = r.out.finish_reason;
    return ev;
  }

  // Generator._admit: prefill queued requests while slots are free; a failure fails that request alone.
  std::vector<Event> admit() {
    std::vector<Event> events;
    while (!waiting.empty() && !free_slots.empty()) {
      Request& r = *waiting.front();
      waiting.erase(waiting.begin());
      r.slot = free_slots.back();
      free_slots.pop_back();
      int64_t first;
      try {
        first = e.prefill(r.prompt, r.slot, r.seed, r.temperature);
      } catch (const std::exception& ex) {
        r.out.error = ex.what();
        finish(r, "error");
        Event ev;
        ev.request = r.id;
        ev.finished = true;
        ev.finish_reason = "error";
        ev.error = r.out.error;
        events.push_back(ev);
        continue;
      }
      r.anchor = first;
      r.position = static_cast<int64_t>(r.prompt.size());
      active.push_back(&r);
      events.push_back(emit(r, {first}));
    }
    return events;
  }

  // Generator._step: one speculative step over every active request.
  std::vector<Event> step() {
    std::vector<Event> events;
    std::vector<Request*> batch = active;
    if (batch.empty()) return events;
    auto rows = e.step(batch);
    for (size_t i = 0; i < batch.size(); ++i) {
      Request& r = *batch[i];
      const auto& row = rows[i];
      int64_t n = row[static_cast<size_t>(e.gamma)], bonus = row[static_cast<size_t>(e.gamma + 1)];
      std::vector<int64_t> emitted(row.begin(), row.begin() + n);
      emitted.push_back(bonus);
      events.push_back(emit(r, emitted));
      events.back().confidence = e.last_confidence.at(i);
      r.out.confidence.push_back(e.last_confidence.at(i));
      r.out.steps += 1;
      r.out.accepted_draft_tokens += n;
      r.anchor = bonus;
      r.position += n + 1;
    }
    return events;
  }

  Request& get(int64_t id) {
    auto it = requests.find(id);
    if (it == requests.end()) throw std::out_of_range("no request " + std::to_string(id) + " in this generator");
    return it->second;
  }
};

Generator::Generator(Engine& engine) : impl_(std::make_unique<Impl>(*engine.impl_)) {
  if (engine.impl_->has_generator)
    throw std::logic_error("this engine already has a Generator: one at a time owns its slots and caches");
  engine.impl_->has_generator = true;
}

Generator::~Generator() { impl_->e.has_generator = false; }

int64_t Generator::add(const std::vector<int64_t>& prompt, const SamplingParams& params) {
  Impl& g = *impl_;
  validate_request(g.e, prompt, params);
  int64_t id = g.next_id++;
  Request& r = g.requests[id];
  r.id = id;
  r.prompt = prompt;
  r.params = params;
  r.stop.insert(params.stop_token_ids.begin(), params.stop_token_ids.end());
  if (!params.ignore_eos) r.stop.insert(g.e.eos.begin(), g.e.eos.end());
  r.seed = static_cast<int64_t>(params.seed);  // (two's complement: Python's seed − 2⁶⁴ past 2⁶³)
  // temperatures below 1e-5 are greedy (as in vLLM): z/T would overflow fp32
  r.temperature = params.temperature < kGreedyBelow ? 0.0 : params.temperature;
  g.waiting.push_back(&r);
  return id;
}

void Generator::cancel(int64_t id) {
  Impl& g = *impl_;
  Request& r = g.get(id);
  g.waiting.erase(std::remove(g.waiting.begin(), g.waiting.end(), &r), g.waiting.end());
  g.finish(r, "cancelled");
}

bool Generator::has_work() const { return !impl_->waiting.empty() || !impl_->active.empty(); }

std::vector<Event> Generator::step() {
  c10::InferenceMode guard;
  Impl& g = *impl_;
  if (!g.waiting.empty() && !g.free_slots.empty()) return g.admit();
  return g.step();
}

const Output& Generator::output(int64_t id) const { return impl_->get(id).out; }

std::vector<Output> Engine::generate(const std::vector<std::vector<int64_t>>& prompts,
                                     const std::vector<SamplingParams>& params, const TokenCallback& on_tokens) {
  if (params.size() != prompts.size() && params.size() != 1)
    throw std::invalid_argument("generate: give one SamplingParams for all prompts or one per prompt (" +
                                std::to_string(prompts.size()) + " prompts, " + std::to_string(params.size()) +
                                " params)");
  Generator gen(*this);
  std::vector<Output> outs(prompts.size());
  std::map<int64_t, size_t> index;  // request id → prompt index
  for (size_t i = 0; i < prompts.size(); ++i) {
    try {
      index[gen.add(prompts[i], params.size() == 1 ? params[0] : params[i])] = i;
    } catch (const RequestError& ex) {  // this request fails alone
      outs[i].finish_reason = "error";
      outs[i].error = std::string("RequestError: ") + ex.what();
    }
  }
  while (gen.has_work())
    for (const Event& ev : gen.step())
      if (on_tokens && !ev.tokens.empty()) on_tokens(index.at(ev.request), ev.tokens);
  for (const auto& [id, i] : index) outs[i] = gen.output(id);
  return outs;
}

const char* package_layout() { return kLayout; }
int embedding_version() { return kEmbeddingVersion; }
const char* torch_version() { return MUSE_SPARK_TORCH_VERSION; }
bool checks_hashes() {
#ifdef MUSE_SPARK_SHA256
  return true;
#else
  return false;
#endif
}

}  // namespace muse_spark
