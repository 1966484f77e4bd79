// The smallest embedding (docs/cxx.md): open an engine, generate greedy tokens for one prompt, print them.
//   minimal ENGINE_DIR [MAX_TOKENS]  →  the generated token ids on one line
#include <muse_spark/engine.h>
#include <cstdlib>
#include <iostream>

int main(int argc, char** argv) {
  if (argc < 2) return 64;                                   // minimal ENGINE_DIR [MAX_TOKENS]
  try {
    auto engine = muse_spark::Engine::open(argv[1]);         // CUDA graphs on a CUDA engine
    muse_spark::SamplingParams p;
    p.max_tokens = argc > 2 ? std::atoi(argv[2]) : 16;
    p.ignore_eos = true;
    auto out = engine->generate({{1, 2, 3, 4}}, {p});
    for (int64_t t : out[0].tokens) std::cout << t << " ";
    std::cout << std::endl;
  } catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << std::endl;
    return 2;
  }
}
