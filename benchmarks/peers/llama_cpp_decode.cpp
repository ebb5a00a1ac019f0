// Greedy decoding by llama.cpp's CPU backend on token ids handed in, for the llama.cpp row of
// benchmarks/bench_auto.py (--llama-cpp): the same prompts as HF's tokenizer and chat template made them,
// decoded in a process of its own that sits idle while the other rows run. A benchmark-only peer, never a
// runtime dependency of mtprobe (built by benchmarks/peers/build_llama_cpp.sh).
//
//     llama_cpp_decode MODEL.gguf THREADS
//
// Reads one request a line on stdin:  <max_new_tokens> <eos ids, comma-separated> <prompt ids...>
// Writes one line for each:           <prefill seconds> <decode seconds> <new token ids...>
// The context's cache is cleared before each prompt. The prompt runs as one llama_decode (llama.cpp splits it
// into its micro-batches), then one token per llama_decode; each next token is the logits' first maximum, as
// torch.argmax (HF greedy) takes it. Decoding stops after max_new_tokens or at an EOS id, which is written.
// A malformed line gets "error: ..." on stdout and the loop goes on; a failed decode ends the process.
#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "llama.h"

namespace {

using Clock = std::chrono::steady_clock;

double seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// The first index of the largest of n logits.
llama_token argmax(const float* logits, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

bool parse(const std::string& line, int& max_new, std::vector<llama_token>& eos,
           std::vector<llama_token>& prompt, int32_t vocab, std::string& why) {
  std::istringstream in(line);
  std::string eos_field;
  if (!(in >> max_new >> eos_field) || max_new < 1) {
    why = "expected '<max_new_tokens >= 1> <eos ids, comma-separated> <prompt ids...>'";
    return false;
  }
  eos.clear();
  std::istringstream e(eos_field);
  for (std::string id; std::getline(e, id, ',');) eos.push_back(std::stoi(id));
  prompt.clear();
  for (long id; in >> id;) {
    if (id < 0 || id >= vocab) {
      why = "token id " + std::to_string(id) + " is not in [0, " + std::to_string(vocab) + ")";
      return false;
    }
    prompt.push_back(static_cast<llama_token>(id));
  }
  if (prompt.empty()) {
    why = "no prompt ids";
    return false;
  }
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s MODEL.gguf THREADS\n", argv[0]);
    return 2;
  }
  const int threads = std::atoi(argv[2]);
  if (threads < 1) {
    std::fprintf(stderr, "THREADS must be >= 1, got %s\n", argv[2]);
    return 2;
  }
  llama_log_set([](ggml_log_level, const char*, void*) {}, nullptr);  // stdout and stderr stay the protocol's
  llama_backend_init();
  llama_model_params mp = llama_model_default_params();
  mp.n_gpu_layers = 0;
  llama_model* model = llama_model_load_from_file(argv[1], mp);
  if (model == nullptr) {
    std::fprintf(stderr, "cannot load %s\n", argv[1]);
    return 1;
  }
  llama_context_params cp = llama_context_default_params();
  cp.n_ctx = 8192;  // the longest dev prompt (~1,900 tokens) and its answer fit
  cp.n_batch = 8192;
  cp.n_threads = threads;
  cp.n_threads_batch = threads;
  llama_context* ctx = llama_init_from_model(model, cp);
  if (ctx == nullptr) {
    std::fprintf(stderr, "cannot create a context\n");
    return 1;
  }
  const int32_t vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
  std::printf("ready %d\n", vocab);
  std::fflush(stdout);

  std::string line, why;
  std::vector<llama_token> eos, prompt, out;
  int max_new = 0;
  while (std::getline(std::cin, line)) {
    if (!parse(line, max_new, eos, prompt, vocab, why)) {
      std::printf("error: %s\n", why.c_str());
      std::fflush(stdout);
      continue;
    }
    if (prompt.size() + max_new > cp.n_ctx) {
      std::printf("error: prompt of %zu and %d new tokens exceed the context of %u\n", prompt.size(), max_new,
                  cp.n_ctx);
      std::fflush(stdout);
      continue;
    }
    llama_memory_clear(llama_get_memory(ctx), true);
    out.clear();
    const auto t0 = Clock::now();
    if (llama_decode(ctx, llama_batch_get_one(prompt.data(), static_cast<int32_t>(prompt.size()))) != 0) {
      std::fprintf(stderr, "llama_decode failed on a prompt of %zu tokens\n", prompt.size());
      return 1;
    }
    llama_token token = argmax(llama_get_logits_ith(ctx, -1), vocab);
    const auto t1 = Clock::now();
    out.push_back(token);
    auto is_eos = [&](llama_token t) {
      for (llama_token e : eos)
        if (t == e) return true;
      return false;
    };
    while (static_cast<int>(out.size()) < max_new && !is_eos(token)) {
      if (llama_decode(ctx, llama_batch_get_one(&token, 1)) != 0) {
        std::fprintf(stderr, "llama_decode failed at new token %zu\n", out.size());
        return 1;
      }
      token = argmax(llama_get_logits_ith(ctx, -1), vocab);
      out.push_back(token);
    }
    const auto t2 = Clock::now();
    std::printf("%.6f %.6f", seconds(t0, t1), seconds(t1, t2));
    for (llama_token t : out) std::printf(" %d", t);
    std::printf("\n");
    std::fflush(stdout);
  }
  llama_free(ctx);
  llama_model_free(model);
  llama_backend_free();
  return 0;
}
