// The C++ embedding of an aoti engine: see include/muse_spark/engine.h, and docs/cxx.md.
//
// It mirrors the Python runtime over the same packages: runtime/aoti_engine.py (the checks, the
// prompt chunks, the schedule's plan), muse_spark/engine_format.py and muse_spark/options.py (the
// manifest's checks), muse_spark/graphs/parts.py (LayeredPrefill, LayeredStep: the order of the parts
// and their flat inputs, the narrower verification widths), runtime/cuda_graph.py (StaticStep: padding
// rows, the Markov workspace and its retry, the scheduled step's two halves) and runtime/generator.py
// (admission, the emitted tokens, stop and length). What the
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
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <optional>
#include <set>
#include <sstream>

#ifdef MUSE_SPARK_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/core/DeviceGuard.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>  // (the driver API's types; its functions are looked up in libcuda at run time)
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#endif

#ifndef MUSE_SPARK_TORCH_VERSION
#error "MUSE_SPARK_TORCH_VERSION (torch.__version__ of the torch linked) must be defined by the build"
#endif

namespace muse_spark {

// (ordered: the manifest's keys in file order, as Python's dicts hold them, so that a check over a section
// reports the entry Python's would)
using json = nlohmann::ordered_json;
using Tensors = std::vector<at::Tensor>;
using Loader = torch::inductor::AOTIModelPackageLoader;

namespace {

constexpr const char* kFormat = "muse-spark-engine";
constexpr int kSchemaVersion = 1;
constexpr const char* kLayout = "layered-7";  // muse_spark/graphs/parts.py LAYOUT
constexpr int kEmbeddingVersion = 1;          // builder/embedder.py EMBEDDING_VERSION

#ifdef MUSE_SPARK_CUDA
// The CUDA driver's graph-editing functions, looked up in libcuda.so.1 (loaded by the CUDA runtime already)
// rather than linked: the library then needs no driver stub at build time. Null where one is missing.
struct GraphDriver {
  decltype(&::cuGraphGetEdges_v2) get_edges = nullptr;
  decltype(&::cuGraphAddDependencies_v2) add = nullptr;
  decltype(&::cuGraphRemoveDependencies_v2) remove = nullptr;
  decltype(&::cuGraphNodeGetType) node_type = nullptr;
  decltype(&::cuGraphKernelNodeGetParams_v2) kernel_params = nullptr;
  decltype(&::cuFuncGetName) func_name = nullptr;

  static const GraphDriver& get() {
    static const GraphDriver d = [] {
      GraphDriver g;
      void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
      if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
      if (!lib) return g;
      auto sym = [&](auto& f, const char* name) { f = reinterpret_cast<std::decay_t<decltype(f)>>(dlsym(lib, name)); };
      sym(g.get_edges, "cuGraphGetEdges_v2");
      sym(g.add, "cuGraphAddDependencies_v2");
      sym(g.remove, "cuGraphRemoveDependencies_v2");
      sym(g.node_type, "cuGraphNodeGetType");
      sym(g.kernel_params, "cuGraphKernelNodeGetParams_v2");
      sym(g.func_name, "cuFuncGetName");
      return g;
    }();
    return d;
  }
  bool complete() const { return get_edges && add && remove && node_type && kernel_params && func_name; }
};

// runtime/cuda_graph.py make_programmatic: each edge kernel → kernel of the captured (not yet instantiated)
// graph whose downstream kernel's name is in `waiting` (the manifest's aoti.pdl_kernels: kernels that wait
// before they touch memory) becomes a programmatic edge (PDL, docs/pdl.md; the "programmatic" port): that
// kernel may launch before the one before it has finished. Edges from or to other nodes stay. → the edges
// rewritten.
int64_t make_programmatic(cudaGraph_t graph, const std::set<std::string>& waiting) {
  const GraphDriver& cu = GraphDriver::get();
  auto check = [](CUresult r, const char* what) {
    if (r != CUDA_SUCCESS)
      throw EngineError(std::string("making the step graph's edges programmatic: ") + what + " failed: error " +
                        std::to_string(static_cast<int>(r)));
  };
  CUgraph h = reinterpret_cast<CUgraph>(graph);
  size_t n = 0;
  check(cu.get_edges(h, nullptr, nullptr, nullptr, &n), "cuGraphGetEdges");
  std::vector<CUgraphNode> from(n), to(n);
  std::vector<CUgraphEdgeData> data(n);
  check(cu.get_edges(h, from.data(), to.data(), data.data(), &n), "cuGraphGetEdges");
  std::map<CUgraphNode, std::optional<std::string>> names;  // a kernel's name ("" unknown); nullopt: not a kernel
  auto kernel_name = [&](CUgraphNode node) -> const std::optional<std::string>& {
    auto it = names.find(node);
    if (it != names.end()) return it->second;
    CUgraphNodeType kind;
    check(cu.node_type(node, &kind), "cuGraphNodeGetType");
    std::optional<std::string> name;
    if (kind == CU_GRAPH_NODE_TYPE_KERNEL) {
      CUDA_KERNEL_NODE_PARAMS params{};
      check(cu.kernel_params(node, &params), "cuGraphKernelNodeGetParams");
      name = "";
      const char* raw = nullptr;
      if (params.func && cu.func_name(&raw, params.func) == CUDA_SUCCESS && raw) name = raw;
    }
    return names.emplace(node, std::move(name)).first->second;
  };
  int64_t rewritten = 0;
  for (size_t i = 0; i < n; ++i) {
    if (data[i].type != CU_GRAPH_DEPENDENCY_TYPE_DEFAULT || !kernel_name(from[i])) continue;
    const auto& downstream = kernel_name(to[i]);
    if (!downstream || !waiting.count(*downstream)) continue;
    CUgraphEdgeData pe{};
    pe.type = CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC;
    pe.from_port = CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC;
    check(cu.remove(h, &from[i], &to[i], &data[i], 1), "cuGraphRemoveDependencies");
    check(cu.add(h, &from[i], &to[i], &pe, 1), "cuGraphAddDependencies");
    ++rewritten;
  }
  return rewritten;
}
#endif
constexpr int kMarkovErrorWord = 2;           // muse_spark/graphs/parts.py MARKOV_ERROR_WORD (documentation)
constexpr double kGreedyBelow = 1e-5;         // runtime/generator.py GREEDY_BELOW
constexpr double kFlatWithin = 0.25;          // muse_spark/schedule.py FLAT_WITHIN

// plugins/__init__.py PLUGIN_VERSIONS: the library has no plugin code (every kernel it runs is in the
// packages), but an engine built with other plugin versions is one the Python runtime refuses, and the
// library's tokens are promised equal to that runtime's (tests/test_cxx.py checks the table against it).
const std::vector<std::pair<std::string, int>> kPluginVersions = {
    {"gated_residual_add", 2}, {"markov_sample", 1}, {"keyed_random", 1}, {"head_norm_rope", 1}};

// muse_spark/options.py KernelOptions, field by field in its order (the manifest's "options" is read
// back as it reads it): a switch, a count >= 0, or one of a few names.
struct OptionSpec {
  const char* name;
  enum Kind { kSwitch, kCount, kChoice } kind;
  std::vector<std::string> choices;
};
const std::vector<OptionSpec> kKernelOptions = {
    {"attention", OptionSpec::kChoice, {"triton", "sdpa"}},
    {"linear", OptionSpec::kChoice, {"triton", "cublas"}},
    {"attention_cache", OptionSpec::kSwitch, {}},
    {"rope_table", OptionSpec::kSwitch, {}},
    {"attention_splits", OptionSpec::kCount, {}},
    {"accept_kernels", OptionSpec::kSwitch, {}},
    {"pdl", OptionSpec::kSwitch, {}},
    {"pdl_trigger", OptionSpec::kSwitch, {}},
    {"pdl_gemm_trigger", OptionSpec::kSwitch, {}},
    {"context_stream", OptionSpec::kSwitch, {}},
    {"chained_steps", OptionSpec::kSwitch, {}}};

// ---- Python's spelling of values, for messages that must read as the Python runtime's -----------------
std::string py_repr(const json& v);

std::string py_quote(const std::string& s) {  // repr() of a str
  const char q = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, q);
  for (char c : s) {
    if (c == q || c == '\\') out += '\\';
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else out += c;
  }
  return out + q;
}

std::string py_list(const std::vector<std::string>& reprs) {
  std::string out = "[";
  for (size_t i = 0; i < reprs.size(); ++i) out += (i ? ", " : "") + reprs[i];
  return out + "]";
}

std::string py_float(double x) {  // repr() of a float (shortest round trip, as Python's)
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  std::string s = json(x).dump();
  if (s.find_first_of(".eE") == std::string::npos) s += ".0";
  return s;
}

std::string py_repr(const json& v) {
  if (v.is_null()) return "None";
  if (v.is_boolean()) return v.get<bool>() ? "True" : "False";
  if (v.is_string()) return py_quote(v.get<std::string>());
  if (v.is_number_float()) return py_float(v.get<double>());
  if (v.is_number()) return v.dump();
  std::vector<std::string> items;
  if (v.is_array()) {
    for (const auto& x : v) items.push_back(py_repr(x));
    return py_list(items);
  }
  std::string out = "{";
  for (auto it = v.begin(); it != v.end(); ++it)
    out += (it == v.begin() ? "" : ", ") + py_quote(it.key()) + ": " + py_repr(it.value());
  return out + "}";
}

std::string py_str(const json& v) { return v.is_string() ? v.get<std::string>() : py_repr(v); }  // str()

std::string py_type(const json& v) {  // type(v).__name__
  if (v.is_null()) return "NoneType";
  if (v.is_boolean()) return "bool";
  if (v.is_string()) return "str";
  if (v.is_number_float()) return "float";
  if (v.is_number()) return "int";
  return v.is_array() ? "list" : "dict";
}

// Python's truth value of a JSON value (``x or default``, ``bool(x)``).
bool py_truthy(const json& v) {
  if (v.is_null()) return false;
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number_float()) return v.get<double>() != 0.0;
  if (v.is_number()) return v.get<int64_t>() != 0;
  if (v.is_string()) return !v.get<std::string>().empty();
  return !v.empty();
}

// ---- muse_spark/schedule.py Schedule, as an engine reads it from its manifest ------------------------
struct Schedule {
  std::string mode = "off";
  double threshold = 0.25;
  bool budget = true;
  std::map<int64_t, std::vector<double>> cost_ms;  // batch size → step ms by drafts verified per request
  int64_t length = 0;

  bool on() const { return mode != "off"; }

  // Schedule.cost_row: the smallest measured batch size >= batch, else the largest; empty: no table.
  const std::vector<double>* cost_row(int64_t batch) const {
    if (cost_ms.empty()) return nullptr;
    auto it = cost_ms.lower_bound(batch);
    return it != cost_ms.end() ? &it->second : &cost_ms.rbegin()->second;
  }

  // Schedule.flat: the cost row so flat at this batch size that no cut can pay for planning it.
  bool flat(int64_t batch) const {
    const std::vector<double>* row = mode == "confidence" && budget ? cost_row(batch) : nullptr;
    return row && *std::max_element(row->begin(), row->end()) <=
                      *std::min_element(row->begin(), row->end()) * (1 + kFlatWithin);
  }

  // Schedule.from_dict and its checks, message for message (Python raises them as ValueError).
  static Schedule from_manifest(const json& raw) {
    Schedule s;
    if (!py_truthy(raw)) return s;  // (``d or {}``)
    if (!raw.is_object()) throw EngineError("schedule must be an object, got " + py_repr(raw));
    auto number = [&](const char* key, double fallback) {
      if (!raw.contains(key)) return fallback;
      const json& v = raw.at(key);
      if (v.is_boolean()) return v.get<bool>() ? 1.0 : 0.0;
      if (!v.is_number()) throw EngineError("schedule " + std::string(key) + ": expected a number, got " + py_repr(v));
      return v.get<double>();
    };
    s.mode = raw.contains("mode") ? py_str(raw.at("mode")) : "off";
    s.threshold = number("threshold", 0.25);
    s.budget = raw.contains("budget") ? py_truthy(raw.at("budget")) : true;
    s.length = static_cast<int64_t>(std::trunc(number("length", 0)));  // (``int(...)``)
    if (s.mode != "off" && s.mode != "confidence" && s.mode != "fixed")
      throw EngineError("unknown schedule " + py_repr(raw.value("mode", json("off"))) +
                        ": expected one of off, confidence, fixed");
    if (!(s.threshold >= 0.0 && s.threshold <= 1.0))
      throw EngineError("confidence threshold must be in [0, 1], got " + py_float(s.threshold));
    if (s.length < 0)
      throw EngineError("fixed schedule: length must be a count of drafts ≥ 0, got " + std::to_string(s.length));
    const json costs = raw.contains("cost_ms") && py_truthy(raw.at("cost_ms")) ? raw.at("cost_ms") : json::object();
    if (!costs.is_object()) throw EngineError("schedule cost table must be an object, got " + py_repr(costs));
    for (auto it = costs.begin(); it != costs.end(); ++it) {
      const std::string& key = it.key();
      const json& row = it.value();
      bool ok = !key.empty() && std::all_of(key.begin(), key.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
                row.is_array() && !row.empty();
      std::vector<double> values;
      for (size_t i = 0; ok && i < row.size(); ++i) {
        double x = row[i].is_boolean() ? (row[i].get<bool>() ? 1.0 : 0.0) : row[i].is_number() ? row[i].get<double>() : -1;
        ok = (row[i].is_number() || row[i].is_boolean()) && x > 0 && std::isfinite(x);
        values.push_back(x);
      }
      if (!ok)
        throw EngineError("schedule cost table: batch " + py_quote(key) + " must map to a list of positive step times "
                          "(ms by drafts verified per request), got " + py_repr(row));
      s.cost_ms[std::stoll(key)] = values;
    }
    return s;
  }
};

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
      {"uint8", at::kByte},        {"bool", at::kBool},    {"float8_e4m3fn", at::kFloat8_e4m3fn}};
  auto it = names.find(name);
  if (it == names.end()) throw EngineError(where + ": unknown dtype '" + name + "'");
  return it->second;
}

at::ScalarType dtype_from_safetensors(const std::string& name, const std::string& where) {
  static const std::map<std::string, at::ScalarType> names = {
      {"BF16", at::kBFloat16}, {"F16", at::kHalf}, {"F32", at::kFloat}, {"F64", at::kDouble}, {"I64", at::kLong},
      {"I32", at::kInt},       {"I16", at::kShort}, {"I8", at::kChar},  {"U8", at::kByte},    {"BOOL", at::kBool},
      {"F8_E4M3", at::kFloat8_e4m3fn}};  // (FP8 checkpoints: E4M3 weights, float32 scales)
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
  // The manifest's schedule (muse_spark/schedule.py), honoured as AOTIEngine.set_schedule honours it: a
  // bucket whose cost row is not flat plans each step's verification width from its drafts' confidences
  // and runs its narrower packages (the widths the engine was built with, verify_widths).
  Schedule schedule;
  std::vector<int64_t> verify_widths;  // ascending, γ last
  struct Bucket {
    int64_t size = 0;
    std::unique_ptr<Loader> draft, layer, verify, context;
    // width K < γ → its layer, verify and context packages (``_k{K}``); loaded where the schedule plans
    std::map<int64_t, std::array<std::unique_ptr<Loader>, 3>> narrower;
    bool planned = false;  // the schedule plans this bucket's steps (AOTIEngine: runner.planner)
    at::Tensor markov_ws;
  };
  std::vector<Bucket> buckets;  // ascending

  std::unique_ptr<Loader> load(const std::string& name) {
    const json& graphs = manifest.at("aoti").at("graphs");
    if (!graphs.contains(name)) throw EngineError(dir + ": the manifest lists no package '" + name + "'");
    std::string path = dir + "/" + graphs.at(name).at("file").get<std::string>();
    try {
      // (single-threaded where the steps are CUDA graphs: the default run synchronizes an event, which a
      // capture cannot hold)
      return std::make_unique<Loader>(path, "model", /*run_single_threaded=*/cuda_graphs, /*num_runners=*/1,
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

  // AOTIEngine._plan over muse_spark/schedule.py's plan: a scheduled step's verification width from its
  // drafts' confidences ([n, γ] float32 on the host), in Python's ATen ops (the same float32 products and
  // sums, so the same cut), rounded up to a width the engine holds.
  int64_t plan(const at::Tensor& confidence) const {
    int64_t K = 0;
    if (schedule.mode == "fixed") {
      K = std::min(schedule.length, gamma);
    } else {
      at::Tensor cum = at::cumprod(confidence, -1);
      at::Tensor counts = cum.ge(schedule.threshold).to(at::kLong).cumprod(-1).sum(-1);  // verify_counts
      const int64_t top = counts.max().item<int64_t>();
      K = top;
      const std::vector<double>* cost = schedule.budget ? schedule.cost_row(confidence.size(0)) : nullptr;
      if (cost) {  // best_cut: the K of the most expected tokens per ms, ties to the smaller
        at::Tensor offsets = at::arange(cum.size(1), at::kLong).unsqueeze(0);
        double best_rate = -1.0;
        for (int64_t k = 0; k <= top; ++k) {
          at::Tensor keep = offsets.lt(counts.clamp_max(k).unsqueeze(1));
          double expected = (cum * keep).sum().add(counts.numel()).item<double>();
          double rate = expected / (*cost)[std::min<size_t>(static_cast<size_t>(k), cost->size() - 1)];
          if (rate > best_rate * (1 + 1e-9)) {
            K = k;
            best_rate = rate;
          }
        }
      }
    }
    for (int64_t w : verify_widths)
      if (w >= std::max<int64_t>(K, 1)) return w;
    return gamma;
  }

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

  // ---- the speculative step -----------------------------------------------------------------------
  // The step's five per-request inputs on the device, as a bucket's packages take them: anchor,
  // anchor_pos, slots, seeds (int64 [B]) and temperature (float32 [B]).
  struct StepInputs {
    at::Tensor a, ap, sl, sd, tp;
  };

  // LayeredStep's draft half → its outputs (ids, probs, stream, x, confidence) and the positions.
  Tensors draft_half(Bucket& b, const StepInputs& in) {
    at::Tensor positions = in.ap.unsqueeze(1) + at::arange(gamma + 1, i64());
    Tensors x = pick(weights, head_idx);
    append(x, dk);
    append(x, dv);
    append(x, {b.markov_ws, in.a, in.ap, in.sl, in.sd, in.tp, positions});
    Tensors drafted = b.draft->run(x);
    drafted.resize(5);
    drafted.push_back(positions);
    return drafted;
  }

  // LayeredStep.verify at width K over the draft half's outputs: the anchor and the first K drafts
  // through the narrower packages (all γ: the full-width ones) → the packed rows [B, γ+2] int64.
  at::Tensor verify_half(Bucket& b, const Tensors& drafted, const StepInputs& in, int64_t K) {
    Loader *layer = b.layer.get(), *verify = b.verify.get(), *context_part = b.context.get();
    at::Tensor pos = drafted.at(5), stream = drafted.at(2), x = drafted.at(3);
    if (K < gamma) {
      auto& parts = b.narrower.at(K);
      layer = parts[0].get();
      verify = parts[1].get();
      context_part = parts[2].get();
      pos = pos.slice(1, 0, K + 1).contiguous();
      stream = stream.slice(1, 0, K + 1).contiguous();
      x = x.slice(1, 0, K + 1).contiguous();
    }
    Tensors head = pick(weights, head_idx);
    auto context = [&](const Tensors& aux_streams) {
      Tensors c = head;
      append(c, dk);
      append(c, dv);
      append(c, aux_streams);
      append(c, {pos, in.sl});
      context_part->run(c);
    };
    auto [h, aux_streams] = layers(*layer, stream, x, pos, in.sl, context);
    Tensors v = head;
    append(v, {b.markov_ws, h, drafted.at(0), drafted.at(1), pos, in.sd, in.tp});
    return verify->run(v).at(0);
  }

  // What one step hands the host, in one tensor (one device→host copy): the packed rows [B, γ+2] and the
  // drafts' confidences, their float32 bits in int64 columns [B, γ] → [B, 2γ+2].
  at::Tensor with_confidence(const at::Tensor& packed, const at::Tensor& confidence) const {
    return at::cat({packed, confidence.to(at::kFloat).contiguous().view(at::kInt).to(at::kLong)}, 1);
  }

  // The confidences of a step's draft half, rows [0, n), on the host as float32 (the schedule's plan).
  static at::Tensor host_confidence(const Tensors& drafted, int64_t n) {
    return drafted.at(4).narrow(0, 0, n).to(at::kCPU).to(at::kFloat).contiguous();
  }

  // The whole step over `in` (StaticStep._step: the plain step, or where the schedule plans this bucket,
  // the draft half, the plan from the first n rows' confidences, the verification at its width).
  at::Tensor run_step(Bucket& b, const StepInputs& in, int64_t n) {
    Tensors drafted = draft_half(b, in);
    const int64_t K = b.planned ? plan(host_confidence(drafted, n)) : gamma;
    return with_confidence(verify_half(b, drafted, in, K), drafted.at(4));
  }

  // The host's inputs of a step, the batch's rows; padding rows are added where they are written.
  struct HostInputs {
    std::vector<int64_t> anchor, anchor_pos, slots, seeds;
    std::vector<float> temperature;
  };

  // StaticStep's padding: a bucket's rows past the batch point at the scratch slot, at position 0, greedy
  // (they compute harmlessly and write only the scratch slot) → `h` as B rows.
  HostInputs padded(const HostInputs& h, int64_t B) const {
    HostInputs p = h;
    const size_t rows = static_cast<size_t>(B);
    p.anchor.resize(rows, 0);
    p.anchor_pos.resize(rows, 0);
    p.slots.resize(rows, scratch_slot);
    p.seeds.resize(rows, 0);
    p.temperature.resize(rows, 0.0f);
    return p;
  }

  static HostInputs host_inputs(const std::vector<Request*>& batch) {
    HostInputs h;
    for (const Request* r : batch) {
      h.anchor.push_back(r->anchor);
      h.anchor_pos.push_back(r->position);
      h.slots.push_back(r->slot);
      h.seeds.push_back(r->seed);
      h.temperature.push_back(static_cast<float>(r->temperature));
    }
    return h;
  }

  // The rows a step handed the host: per request, the packed row (γ drafts, n accepted, the bonus) and
  // the γ confidences.
  struct StepRows {
    std::vector<std::vector<int64_t>> rows;
    std::vector<std::vector<float>> confidence;
  };

  StepRows unpack(const int64_t* p, int64_t width, size_t n) const {
    StepRows r;
    for (size_t i = 0; i < n; ++i) {
      const int64_t* row = p + static_cast<int64_t>(i) * width;
      r.rows.emplace_back(row, row + gamma + 2);
      std::vector<float> c(static_cast<size_t>(gamma));
      for (int64_t k = 0; k < gamma; ++k) {
        const int32_t bits = static_cast<int32_t>(row[gamma + 2 + k]);
        std::memcpy(&c[static_cast<size_t>(k)], &bits, sizeof(float));
      }
      r.confidence.push_back(std::move(c));
    }
    return r;
  }

  // Whether a step's rows say the fused Markov kernel failed (n = -1; only with a workspace).
  bool flagged(const Bucket& b, const StepRows& r) const {
    if (!b.markov_ws.numel()) return false;
    for (const auto& row : r.rows)
      if (row[static_cast<size_t>(gamma)] < 0) return true;
    return false;
  }

  [[noreturn]] void markov_failed(Bucket& b) {
    b.markov_ws.zero_();
    throw EngineError("the fused Markov kernel failed twice in a row (word " + std::to_string(kMarkovErrorWord) +
                      " of its workspace): its programs were not all resident at once");
  }

  // A step without CUDA graphs (CPU engines, or graphs turned off): the inputs copied in, the packages run
  // call by call, the rows read back (StaticStep.step_host, its Markov retry included: rows flagged by the
  // fused Markov kernel run once more on a zeroed workspace; a second failure is an error).
  StepRows step_uncaptured(Bucket& b, const HostInputs& h) {
    const size_t n = h.anchor.size();
    const HostInputs p = padded(h, b.size);
    auto dev = [&](const std::vector<int64_t>& v) { return at::tensor(v, at::kLong).to(device); };
    StepInputs in{dev(p.anchor), dev(p.anchor_pos), dev(p.slots), dev(p.seeds),
                  at::tensor(p.temperature, at::kFloat).to(device)};
    auto once = [&] {
      at::Tensor out = run_step(b, in, static_cast<int64_t>(n)).to(at::kCPU).contiguous();
      return unpack(out.data_ptr<int64_t>(), out.size(1), n);
    };
    StepRows r = once();
    if (flagged(b, r)) {
      b.markov_ws.zero_();
      r = once();
      if (flagged(b, r)) markov_failed(b);
    }
    return r;
  }

  // ---- CUDA graphs (runtime/cuda_graph.py's CUDAGraphStep and its chained steps) -------------------
  // A launched step: its rows are read with `rows` (the Generator's handle).
  struct Launched {
    Bucket* bucket = nullptr;
    int64_t serial = 0;
    size_t n = 0;
    at::Tensor out;                       // the device tensor the step wrote ([B, 2γ+2])
    std::shared_ptr<HostInputs> inputs;   // given, or (chained) derived from the parent's rows when needed
    std::shared_ptr<Launched> parent;
    std::shared_ptr<StepRows> rows;       // once read
    bool redone = false;                  // its rows came from a Markov retry: a step chained after it is invalid
  };
  using Handle = std::shared_ptr<Launched>;

  bool cuda_graphs = false;  // the steps are CUDA graphs (a CUDA engine unless OpenOptions::cuda_graphs is off)
  bool chained_steps = true; // the manifest's kernel option chained_steps (run scope)

  // Whether the Generator chains this engine's steps (AOTIEngine.chains): graphs, the option, no schedule on.
  bool chains() const { return cuda_graphs && chained_steps && !schedule.on(); }

#ifdef MUSE_SPARK_CUDA
  // A bucket's captured step: its static inputs (the five rows of one int64 buffer, the temperatures'
  // row read as float32, with a pinned host twin: one host→device copy a step), the whole step's graph
  // and, where the schedule plans the bucket, the draft half's and each width's verification graphs; two
  // pinned host buffers for the rows of the (at most two) steps in flight.
  struct Captured {
    at::Tensor packed, host_packed;
    StepInputs in;
    std::unique_ptr<at::cuda::CUDAGraph> full, draft;
    std::map<int64_t, std::unique_ptr<at::cuda::CUDAGraph>> verify;
    at::Tensor out;                       // the whole step's
    Tensors drafted;                      // the draft half's outputs
    std::map<int64_t, at::Tensor> verify_out;
    std::array<at::Tensor, 2> ring;
    std::array<at::cuda::CUDAEvent, 2> done;
    at::cuda::CUDAEvent copied_in;        // the last host→device copy has read the pinned twin
    int64_t serial = 0;
  };
  // The engine's capture stream, its own (runtime/cuda_graph.py's GraphMemory): PyTorch keys the cuBLAS
  // workspace a graph replays by (handle, stream) and a graph's destruction drops every workspace of its
  // capture stream, so graphs captured on a pooled stream that another engine's graphs also used would
  // replay memory freed when either engine goes. Declared before the graphs: destroyed after them.
  struct OwnedStream {
    cudaStream_t raw = nullptr;
    OwnedStream() = default;
    OwnedStream(const OwnedStream&) = delete;
    OwnedStream& operator=(const OwnedStream&) = delete;
    ~OwnedStream() {
      if (raw) cudaStreamDestroy(raw);
    }
  };
  OwnedStream capture_stream;
  std::map<int64_t, std::unique_ptr<Captured>> captured;  // by bucket size
  decltype(at::cuda::graph_pool_handle()) graph_pool = {0, 0};
  // the kernels whose incoming edges the step graphs make programmatic (AOTIEngine.pdl_kernels), and how
  // many edges the captures rewrote
  std::set<std::string> pdl_kernels;
  int64_t programmatic_edges = 0;

  // CUDAGraphStep.__init__: warm-up calls (a package's first run loads its kernels and may allocate),
  // then the capture into one memory pool shared by every graph of the engine (largest bucket first, the
  // smaller reuse its blocks), both on the engine's own stream. All rows are padding while it runs: only
  // the scratch slot is written.
  void capture(Bucket& b) {
    c10::cuda::CUDAGuard guard(device);
    const int64_t B = b.size, width = B + B % 2;
    auto c = std::make_unique<Captured>();
    c->packed = at::zeros({5, width}, i64());
    c->host_packed = at::zeros({5, width}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    c->in = StepInputs{c->packed[0].narrow(0, 0, B), c->packed[1].narrow(0, 0, B), c->packed[2].narrow(0, 0, B),
                       c->packed[3].narrow(0, 0, B), c->packed[4].view(at::kFloat).narrow(0, 0, B)};
    for (auto& r : c->ring)
      r = at::empty({B, 2 * gamma + 2}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
    Captured& k = *c;
    fill(k, B, HostInputs{});  // (every row padding while the graphs are captured)
    auto graph = [&](const std::function<at::Tensor()>& fn) {
      c10::cuda::device_synchronize();
      c10::cuda::CUDAStream side = c10::cuda::getStreamFromExternal(capture_stream.raw, device.index());
      at::Tensor out;
      {
        c10::cuda::CUDAStreamGuard on_side(side);
        for (int i = 0; i < 2; ++i) fn();
      }
      c10::cuda::device_synchronize();
      auto g = std::make_unique<at::cuda::CUDAGraph>(/*keep_graph=*/!pdl_kernels.empty());
      {
        c10::cuda::CUDAStreamGuard on_side(side);
        g->capture_begin(graph_pool);
        out = fn();
        g->capture_end();
      }
      if (!pdl_kernels.empty()) {  // (CUDAGraphStep's capture_step: the edges rewritten before instantiation)
        programmatic_edges += make_programmatic(g->raw_cuda_graph(), pdl_kernels);
        g->instantiate();
      }
      return std::make_pair(std::move(g), out);
    };
    std::tie(k.full, k.out) = graph([&] {
      Tensors drafted = draft_half(b, k.in);
      return with_confidence(verify_half(b, drafted, k.in, gamma), drafted.at(4));
    });
    if (b.planned) {
      at::Tensor first;
      std::tie(k.draft, first) = graph([&] {
        k.drafted = draft_half(b, k.in);
        return k.drafted.at(0);
      });
      for (int64_t w : verify_widths)
        std::tie(k.verify[w], k.verify_out[w]) =
            graph([&] { return with_confidence(verify_half(b, k.drafted, k.in, w), k.drafted.at(4)); });
    }
    c10::cuda::device_synchronize();
    captured[b.size] = std::move(c);
  }

  // The step over the static inputs (the whole graph, or the planned halves: the one wait inside a step)
  // → the tensor it wrote.
  at::Tensor replay(Bucket& b, Captured& k, size_t n) {
    if (!b.planned) {
      k.full->replay();
      return k.out;
    }
    k.draft->replay();
    const int64_t K = plan(host_confidence(k.drafted, static_cast<int64_t>(n)));
    k.verify.at(K)->replay();
    return k.verify_out.at(K);
  }

  // StaticStep._write_twin + _fill_host: host values (padding rows too) into the pinned twin, once the
  // last copy from it has read it, then one asynchronous copy of all five rows.
  void fill(Captured& k, int64_t B, const HostInputs& h) {
    const HostInputs p = padded(h, B);
    k.copied_in.synchronize();
    int64_t* twin = k.host_packed.data_ptr<int64_t>();
    const int64_t width = k.host_packed.size(1);
    const size_t bytes = static_cast<size_t>(B) * sizeof(int64_t);
    std::memcpy(twin, p.anchor.data(), bytes);
    std::memcpy(twin + width, p.anchor_pos.data(), bytes);
    std::memcpy(twin + 2 * width, p.slots.data(), bytes);
    std::memcpy(twin + 3 * width, p.seeds.data(), bytes);
    std::memcpy(twin + 4 * width, p.temperature.data(), static_cast<size_t>(B) * sizeof(float));
    k.packed.copy_(k.host_packed, /*non_blocking=*/true);
    k.copied_in.record(c10::cuda::getCurrentCUDAStream(device.index()));
  }

  // StaticStep._launch: the step, then the one device→host copy of its rows into a pinned buffer of its
  // own (two in flight at most), not waited for.
  Handle launch_captured(Bucket& b, Captured& k, size_t n, std::shared_ptr<HostInputs> inputs, Handle parent) {
    auto h = std::make_shared<Launched>();
    h->bucket = &b;
    h->n = n;
    h->out = replay(b, k, n);
    h->serial = ++k.serial;
    h->inputs = std::move(inputs);
    h->parent = std::move(parent);
    const size_t slot = static_cast<size_t>(h->serial % 2);
    k.ring[slot].copy_(h->out, /*non_blocking=*/true);
    k.done[slot].record(c10::cuda::getCurrentCUDAStream(device.index()));
    return h;
  }
#endif

  // A step over `batch` from its host values, launched (CUDA graphs) or run (without them): → a handle
  // for `rows`.
  Handle launch(const std::vector<Request*>& batch) {
    Bucket& b = bucket_for(batch.size());
    auto inputs = std::make_shared<HostInputs>(host_inputs(batch));
#ifdef MUSE_SPARK_CUDA
    if (cuda_graphs) {
      c10::cuda::CUDAGuard guard(device);
      Captured& k = *captured.at(b.size);
      fill(k, b.size, *inputs);
      return launch_captured(b, k, batch.size(), std::move(inputs), nullptr);
    }
#endif
    auto h = std::make_shared<Launched>();
    h->bucket = &b;
    h->n = batch.size();
    h->rows = std::make_shared<StepRows>(step_uncaptured(b, *inputs));
    h->inputs = std::move(inputs);
    return h;
  }

  // StaticStep.launch_next: the step after `prev` (the last one its bucket launched) for the same
  // requests, its inputs advanced on the device from prev's rows as the host would advance them (anchor ←
  // bonus, anchor_pos ← anchor_pos + n + 1), launched before prev's rows are read.
  Handle launch_next(const Handle& prev) {
#ifdef MUSE_SPARK_CUDA
    Bucket& b = *prev->bucket;
    Captured& k = *captured.at(b.size);
    if (!cuda_graphs || prev->serial != k.serial)
      throw std::logic_error("launch_next: the step before must be the last one its bucket launched");
    c10::cuda::CUDAGuard guard(device);
    const int64_t n = static_cast<int64_t>(prev->n);
    k.in.a.narrow(0, 0, n).copy_(prev->out.narrow(0, 0, n).select(1, gamma + 1));
    k.in.ap.narrow(0, 0, n).add_(prev->out.narrow(0, 0, n).select(1, gamma) + 1);
    return launch_captured(b, k, prev->n, nullptr, prev);
#else
    (void)prev;
    throw std::logic_error("launch_next: this library was built without CUDA");
#endif
  }

  // Wait for step h → its rows (StaticStep.rows). Where the fused Markov kernel raised its error flag, the
  // step runs again from its host inputs on a zeroed workspace and h->redone is set (a step chained after
  // h was computed from invalid rows: the caller drops it); a second failure is an error.
  const StepRows& rows(const Handle& h) {
    if (h->rows) return *h->rows;
#ifdef MUSE_SPARK_CUDA
    c10::cuda::CUDAGuard guard(device);
    Bucket& b = *h->bucket;
    Captured& k = *captured.at(b.size);
    if (h->serial < k.serial - 1)
      throw std::logic_error("rows: this step's buffer was reused by later steps (more than two in flight)");
    const size_t slot = static_cast<size_t>(h->serial % 2);
    k.done[slot].synchronize();
    StepRows r = unpack(k.ring[slot].data_ptr<int64_t>(), k.ring[slot].size(1), h->n);
    if (!h->inputs) {  // chained: the parent's inputs advanced by its rows (read before these), as the device did
      const StepRows& pr = *h->parent->rows;
      auto in = std::make_shared<HostInputs>(*h->parent->inputs);
      for (size_t i = 0; i < h->n; ++i) {
        in->anchor[i] = pr.rows[i][static_cast<size_t>(gamma + 1)];
        in->anchor_pos[i] += pr.rows[i][static_cast<size_t>(gamma)] + 1;
      }
      h->inputs = std::move(in);
    }
    h->parent.reset();  // (a chain of steps holds no more than the step before)
    if (flagged(b, r)) {
      h->redone = true;
      b.markov_ws.zero_();
      fill(k, b.size, *h->inputs);
      at::Tensor out = replay(b, k, h->n).to(at::kCPU).contiguous();
      r = unpack(out.data_ptr<int64_t>(), out.size(1), h->n);
      if (flagged(b, r)) markov_failed(b);
    }
    h->rows = std::make_shared<StepRows>(std::move(r));
    return *h->rows;
#else
    throw std::logic_error("rows: a step without rows (this library was built without CUDA)");
#endif
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

// engine_format.py _inside: a manifest entry that is a relative path staying inside the engine directory,
// links resolved.
void check_inside(const std::string& dir, const json& name, const std::string& what, const std::string& where) {
  namespace fs = std::filesystem;
  if (!name.is_string() || name.get<std::string>().empty())
    throw EngineError(where + ": " + what + " must be a file name inside the engine directory, got " + py_repr(name));
  fs::path p(name.get<std::string>());
  bool up = false;
  for (const auto& part : p) up = up || part == "..";
  if (p.is_absolute() || up)
    throw EngineError(where + ": " + what + " " + py_repr(name) +
                      " points outside the engine directory; refusing to read it");
  std::error_code ec;
  fs::path root = fs::weakly_canonical(fs::absolute(dir, ec), ec);
  fs::path full = fs::weakly_canonical(root / p, ec);
  if (std::mismatch(root.begin(), root.end(), full.begin(), full.end()).first != root.end())
    throw EngineError(where + ": " + what + " " + py_repr(name) + " resolves outside the engine directory (to " +
                      full.string() + "); refusing to read it");
}

// engine_format.py read_manifest's checks (the format, the schema, the keys, the paths, the limits), message
// for message: the manifest is not hashed, so what it says is checked against itself before anything is read.
void check_format(const std::string& dir, const json& m) {
  const std::string path = dir + "/manifest.json";
  if (!m.is_object() || !m.contains("format") || m["format"] != kFormat)
    throw EngineError(path + ": not a Muse Spark engine manifest");
  if (!m.contains("schema_version") || m["schema_version"] != kSchemaVersion)
    throw EngineError(path + ": engine schema version " + py_str(m.value("schema_version", json(nullptr))) +
                      " is not supported (this runtime reads version " + std::to_string(kSchemaVersion) +
                      "); rebuild the engine");
  for (const char* key : {"backend", "files", "target_config", "draft_config", "gamma", "max_seq", "max_batch", "dtype"})
    if (!m.contains(key)) throw EngineError(path + ": manifest lacks " + py_quote(key));
  // check_manifest_paths: every engine file, and the tokenizer (one of the hashed files), inside the directory
  const json& files = m["files"];
  bool digests = files.is_object();
  for (auto it = files.begin(); digests && it != files.end(); ++it) digests = it.value().is_string();
  if (!digests) throw EngineError(path + ": manifest 'files' must map file names to sha256 digests");
  for (auto it = files.begin(); it != files.end(); ++it) check_inside(dir, json(it.key()), "engine file", path);
  const json tok = m.value("tokenizer", json(nullptr));
  if (!tok.is_null()) {
    check_inside(dir, tok, "tokenizer", path);
    if (!files.contains(tok.get<std::string>()))
      throw EngineError(path + ": tokenizer " + py_repr(tok) + " is not among the manifest's hashed files; "
                        "refusing an unverified tokenizer");
  }
  // check_manifest_limits: the limits against the configs (an edited max_seq would run past the positions
  // the target was trained for)
  for (const char* key : {"max_seq", "max_batch", "gamma"})
    if (!m[key].is_number_integer())
      throw EngineError(path + ": manifest " + key + " must be an integer, got " + py_repr(m[key]));
  const int64_t gamma = m.at("draft_config").at("block_size").get<int64_t>();
  const int64_t positions = m.at("target_config").value("max_position_embeddings", int64_t{4096});
  const int64_t max_seq = m["max_seq"].get<int64_t>(), max_batch = m["max_batch"].get<int64_t>();
  if (m["gamma"].get<int64_t>() != gamma)
    throw EngineError(path + ": manifest gamma " + m["gamma"].dump() + " differs from the draft's block_size " +
                      std::to_string(gamma));
  if (max_batch < 1) throw EngineError(path + ": manifest max_batch must be >= 1, got " + std::to_string(max_batch));
  if (max_seq < gamma + 2)
    throw EngineError(path + ": manifest max_seq " + std::to_string(max_seq) + " is below γ+2 = " +
                      std::to_string(gamma + 2));
  if (max_seq > positions)
    throw EngineError(path + ": manifest max_seq " + std::to_string(max_seq) +
                      " exceeds the target's max_position_embeddings " + std::to_string(positions) +
                      "; rebuild the engine with a --max-seq within it");
}

// options.py KernelOptions.from_manifest (engine_options): the kernel options the engine was built with,
// refused where Python refuses them. The library has nothing to choose by them: the build-scope ones are
// compiled into the packages, and the run-scope ones (context_stream, chained_steps) say how the Python
// runtime launches the same packages (a second stream, the next step before the rows), not what they compute.
void check_options(const std::string& dir, const json& m) {
  if (!m.contains("options") || m["options"].is_null()) return;  // (built before they were recorded: the defaults)
  const std::string where = dir + ": manifest options";
  const json& o = m["options"];
  if (!o.is_object()) throw EngineError(where + ": expected a dict of kernel options, got " + py_type(o));
  std::vector<std::string> known, unknown;
  for (const auto& spec : kKernelOptions) known.push_back(spec.name);
  std::sort(known.begin(), known.end());
  for (auto it = o.begin(); it != o.end(); ++it)
    if (!std::binary_search(known.begin(), known.end(), it.key())) unknown.push_back(it.key());
  std::sort(unknown.begin(), unknown.end());
  auto reprs = [](const std::vector<std::string>& names) {
    std::vector<std::string> out;
    for (const auto& n : names) out.push_back(py_quote(n));
    return py_list(out);
  };
  if (!unknown.empty())
    throw EngineError(where + ": unknown kernel option(s) " + reprs(unknown) + " (this muse-spark knows " +
                      reprs(known) + ")");
  for (const auto& spec : kKernelOptions) {
    if (!o.contains(spec.name)) continue;
    const json& v = o[spec.name];
    const std::string bad = where + ": kernel option " + spec.name + "=" + py_repr(v) + ": expected ";
    if (spec.kind == OptionSpec::kChoice) {
      if (!v.is_string() || std::find(spec.choices.begin(), spec.choices.end(), v.get<std::string>()) == spec.choices.end())
        throw EngineError(bad + "one of " + reprs(spec.choices));
    } else if (spec.kind == OptionSpec::kSwitch) {
      if (!v.is_boolean()) throw EngineError(bad + "true or false");
    } else if (!v.is_number_integer() || v.get<int64_t>() < 0) {
      throw EngineError(bad + "0 (the launcher's choice) or a count ≥ 1");
    }
  }
}

// engine_format.py check_plugins: an engine built with other plugin versions (kPluginVersions).
void check_plugins(const json& m) {
  if (!m.contains("plugins") || !m["plugins"].is_object()) return;
  for (auto it = m["plugins"].begin(); it != m["plugins"].end(); ++it) {
    json mine(nullptr);
    for (const auto& [name, version] : kPluginVersions)
      if (name == it.key()) mine = version;
    if (mine != it.value())
      throw EngineError("engine was built with plugin " + it.key() + " v" + py_str(it.value()) +
                        "; this runtime has v" + py_str(mine) + ": rebuild the engine");
  }
}

std::string device_kind_error(const std::string& dir, const std::string& built, const std::string& here) {
  return dir + ": engine was compiled for '" + built + "' and cannot run on '" + here +
         "' (AOTInductor packages are device-specific); rebuild it with --device " + here;
}

// AOTIEngine.from_dir's checks before it reads a file, in its order, then the library's own (the packages'
// layout, which Python checks once the weights are in, the embedding section, the caches' layout).
void check_manifest(const std::string& dir, const json& m, at::Device& device) {
  check_format(dir, m);
  if (m["backend"] != "aoti")
    throw EngineError(dir + ": backend " + py_repr(m["backend"]) + " is not an aoti engine: the C++ embedding runs "
                      "aoti engines (build one with `muse-spark build --backend aoti`)");
  check_options(dir, m);
  // device kind, then torch, then compute capability: runtime/aoti_engine.py check_compatibility
  std::string kind = m.value("device", json::object()).value("kind", "cpu");
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
  if (!m.contains("aoti") || !m["aoti"].is_object())
    throw EngineError(dir + ": manifest lacks its 'aoti' section; rebuild the engine");
  std::string built_torch = m.value("versions", json::object()).value("torch", "");
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
  const json& a = m["aoti"];
  const json layout = a.value("layout", json(nullptr));
  if (layout != kLayout)
    throw EngineError(dir + ": this aoti engine was built by another muse-spark (" +
                      (layout.is_null() ? std::string("one unrolled graph per step")
                                        : "the packages' layout " + py_repr(layout) + ", this runtime's is " +
                                              py_quote(kLayout)) +
                      "); rebuild it");
  if (a.contains("kv_pool") && py_truthy(a["kv_pool"]))
    throw EngineError(dir + ": this engine's KV caches are a paged pool (built with --kv-cache-tokens): the C++ "
                      "embedding runs engines with a cache window per slot; rebuild it without --kv-cache-tokens");
  if (m.contains("tensor_parallel") && py_truthy(m["tensor_parallel"]))
    throw EngineError(dir + ": this engine is split for " + m["tensor_parallel"].value("world", json()).dump() +
                      " tensor-parallel ranks (built with --tp): the C++ embedding runs an engine on one device; "
                      "run this one with `muse-spark generate --engine` or build one without --tp");
  if (!m.contains("embedding") || !m["embedding"].is_object())
    throw EngineError(dir + ": manifest lacks its 'embedding' section (the engine was built by a muse-spark "
                      "without the C++ embedding); rebuild it");
  int ev = m.at("embedding").value("version", -1);
  if (ev != kEmbeddingVersion)
    throw EngineError(dir + ": the manifest's embedding section is version " + std::to_string(ev) +
                      ", this library reads version " + std::to_string(kEmbeddingVersion) + "; rebuild the engine");
}

// Every file the manifest lists is a regular file; with `hashes`, each matches its sha256
// (engine_format.py verify_files).
void verify_files(const std::string& dir, const json& m, bool hashes) {
#ifndef MUSE_SPARK_SHA256
  if (hashes)
    throw EngineError(dir + ": this build of the library cannot check the engine files' hashes (OpenSSL's "
                      "libcrypto was not found when it was built): rebuild it with OpenSSL, or open the engine "
                      "with verify_hashes = false (--no-verify)");
#endif
  for (auto& [name, digest] : m.at("files").items()) {
    std::string path = dir + "/" + name;
    std::error_code ec;
    auto st = std::filesystem::status(path, ec);
    if (!std::filesystem::exists(st)) throw EngineError(dir + ": engine file " + name + " is missing");
    if (!std::filesystem::is_regular_file(st)) throw EngineError(dir + ": engine file " + name + " is not a regular file");
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
    check_plugins(m);
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

    // AOTIEngine's choice of buckets, and each one's Markov workspace (markov_words), checked first
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
    const json words = a.contains("markov_workspace_words") && a["markov_workspace_words"].is_object()
                           ? a["markov_workspace_words"]
                           : json::object();
    std::map<int64_t, int64_t> markov_words;
    for (int64_t b : use) {
      const json n = words.value(std::to_string(b), json(nullptr));
      if (!n.is_number_integer() || n.get<int64_t>() < 0)
        throw EngineError(e.dir + ": the manifest's markov_workspace_words has no valid entry for batch bucket " +
                          std::to_string(b) + " (got " + py_repr(n) + "); rebuild the engine");
      markov_words[b] = n.get<int64_t>();
    }

    // the schedule (AOTIEngine.set_schedule's refusals, message for message), and the verification
    // widths its steps were compiled for
    const json widths = a.value("verify_widths", json(nullptr));
    e.verify_widths = py_truthy(widths) ? widths.get<std::vector<int64_t>>() : std::vector<int64_t>{e.gamma};
    std::sort(e.verify_widths.begin(), e.verify_widths.end());
    e.schedule = Schedule::from_manifest(m.value("schedule", json(nullptr)));
    if (e.schedule.mode == "confidence" && !m.at("draft_config").value("enable_confidence_head", false))
      throw EngineError("schedule 'confidence' needs a draft with a confidence head (enable_confidence_head in its "
                        "config.json); this draft has none");
    if (e.schedule.on() && e.verify_widths.size() <= 1)
      throw EngineError("schedule " + py_quote(e.schedule.mode) + ": this aoti engine's compiled step verifies every "
                        "draft; rebuild it with narrower verification widths (build --verify-widths, or "
                        "--schedule confidence)");
    if (e.schedule.mode == "fixed" &&
        std::find(e.verify_widths.begin(), e.verify_widths.end(), e.schedule.length) == e.verify_widths.end()) {
      std::vector<std::string> ws;
      for (int64_t w : e.verify_widths) ws.push_back(std::to_string(w));
      throw EngineError("schedule 'fixed' with " + std::to_string(e.schedule.length) + " drafts: this engine's steps "
                        "verify " + py_list(ws) + " drafts per request");
    }

    e.cuda_graphs = options.cuda_graphs && e.device.is_cuda();
    if (m.contains("options") && m["options"].is_object() && m["options"].contains("chained_steps"))
      e.chained_steps = m["options"]["chained_steps"].get<bool>();

    // packages: the prompt chunk's two, then each bucket's four (and, where the schedule plans its steps,
    // the narrower widths' three each)
    e.prefill_layer = e.load("prefill_layer");
    e.prefill_finish = e.load("prefill_finish");
    for (int64_t b : use) {
      Impl::Bucket k;
      k.size = b;
      std::string s = "_b" + std::to_string(b);
      k.draft = e.load("step_draft" + s);
      k.layer = e.load("step_layer" + s);
      k.verify = e.load("step_verify" + s);
      k.context = e.load("step_context" + s);
      // (where the cost table is flat, the plain step: its width cannot pay for the wait)
      k.planned = e.schedule.on() && !e.schedule.flat(b);
      for (int64_t w : e.verify_widths)
        if (k.planned && w < e.gamma) {
          std::string sk = s + "_k" + std::to_string(w);
          k.narrower[w] = {e.load("step_layer" + sk), e.load("step_verify" + sk), e.load("step_context" + sk)};
        }
      k.markov_ws = at::zeros({markov_words.at(b)}, e.i64());
      e.buckets.push_back(std::move(k));
    }
#ifdef MUSE_SPARK_CUDA
    if (e.cuda_graphs) {  // (AOTIEngine: largest bucket first, the smaller graphs reuse its pool's blocks)
      c10::InferenceMode guard;
      e.graph_pool = at::cuda::graph_pool_handle();
      {
        c10::cuda::CUDAGuard on_device(e.device);  // (the stream belongs to the engine's device)
        C10_CUDA_CHECK(cudaStreamCreateWithFlags(&e.capture_stream.raw, cudaStreamNonBlocking));
      }
      // programmatic_kernels: the manifest's pdl_kernels, or none (the same step launched without PDL) where
      // the driver lacks the graph-editing functions
      if (a.contains("pdl_kernels") && a["pdl_kernels"].is_array() && GraphDriver::get().complete())
        for (const auto& k : a["pdl_kernels"]) e.pdl_kernels.insert(k.get<std::string>());
      for (auto it = e.buckets.rbegin(); it != e.buckets.rend(); ++it) e.capture(*it);
    }
#endif
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
bool Engine::cuda_graphs() const { return impl_->cuda_graphs; }
int64_t Engine::programmatic_edges() const {
#ifdef MUSE_SPARK_CUDA
  return impl_->programmatic_edges;
#else
  return 0;
#endif
}

void Engine::synchronize() const {
#ifdef MUSE_SPARK_CUDA
  if (impl_->device.is_cuda()) {
    c10::DeviceGuard guard(impl_->device);  // (the engine's device, whichever is current on this thread)
    c10::cuda::device_synchronize();
  }
#endif
}

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

// ---- the generator: runtime/generator.py's Generator (its chained steps where the engine's steps are CUDA
// graphs), with the same admission order, slots and emitted tokens (a whole prompt prefilled at admission) ----
struct Generator::Impl {
  Engine::Impl& e;
  std::map<int64_t, Request> requests;  // by id
  std::vector<Request*> waiting, active;
  std::vector<int64_t> free_slots;
  int64_t next_id = 0;
  // a chained step launched, its rows not read yet, and its batch
  std::optional<std::pair<Engine::Impl::Handle, std::vector<Request*>>> inflight;

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

  // Generator._step: one speculative step over every active request. Chained steps (an engine whose
  // steps are CUDA graphs, Engine::Impl::chains): before it reads a step's rows, the next step for the
  // same requests is launched, its inputs advanced on the device, so the device does not wait while the
  // host reads rows, emits tokens and prepares the next step; the next call reads that step's rows. A
  // request that finished or was cancelled meanwhile has its row ignored (its step wrote only its own
  // slot, past its end); a batch that changes is not chained again until it is stepped afresh. The tokens
  // are those of unchained steps: the chained step computes what the next call would have launched.
  std::vector<Event> step() {
    std::vector<Event> events;
    std::vector<Request*> batch;
    Engine::Impl::Handle handle;
    if (inflight) {
      std::tie(handle, batch) = std::move(*inflight);
      inflight.reset();
    } else {
      batch = active;
      if (batch.empty()) return events;
    }
    Engine::Impl::Handle next;
    try {
      if (!handle) handle = e.launch(batch);
      if (e.chains() && chains(batch)) next = e.launch_next(handle);
      e.rows(handle);
    } catch (...) {
      inflight.reset();  // (an engine failure: nothing chained survives it)
      throw;
    }
    if (next && !handle->redone) inflight.emplace(next, batch);  // (after a retried step the chained one is invalid)
    const auto& rows = *handle->rows;
    for (size_t i = 0; i < batch.size(); ++i) {
      Request& r = *batch[i];
      if (r.finished) continue;  // (finished or cancelled after this chained step was launched)
      const auto& row = rows.rows[i];
      int64_t n = row[static_cast<size_t>(e.gamma)], bonus = row[static_cast<size_t>(e.gamma + 1)];
      std::vector<int64_t> emitted(row.begin(), row.begin() + n);
      emitted.push_back(bonus);
      events.push_back(emit(r, emitted));
      events.back().confidence = rows.confidence.at(i);
      r.out.confidence.push_back(rows.confidence.at(i));
      r.out.steps += 1;
      r.out.accepted_draft_tokens += n;
      r.anchor = bonus;
      r.position += n + 1;
    }
    return events;
  }

  // Generator._chains: launch the step after this one before reading its rows only while the same
  // requests are all still running, none waits for a free slot, the chained step's writes stay inside the
  // caches (its largest position + γ is below max_seq), and some request surely needs it (more than γ+1
  // tokens left: this step emits at most γ+1).
  bool chains(const std::vector<Request*>& batch) const {
    const int64_t g = e.gamma;
    if (batch != active || (!waiting.empty() && !free_slots.empty())) return false;
    int64_t last = 0;
    bool needed = false;
    for (const Request* r : batch) {
      if (r->finished) return false;
      last = std::max(last, r->position);
      needed = needed || r->params.max_tokens - static_cast<int64_t>(r->out.tokens.size()) > g + 1;
    }
    return last + 2 * (g + 1) <= e.max_seq && needed;
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
  // (a chained step in flight is read first: its batch was chained while nobody waited for a slot)
  if (!g.inflight && !g.waiting.empty() && !g.free_slots.empty()) return g.admit();
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
