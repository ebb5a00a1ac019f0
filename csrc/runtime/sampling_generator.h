// The random generator a sampled draw of the decode loop and its drafters takes.
//
// Why: the rows of a batch decoded together (decode/batched_forward.h) run their loops on one thread each.
// Drawing from torch's default generator, their draws would interleave in whatever order the threads reach
// it, so a seeded call would not repeat. Each row's loop runs with a generator of its own instead
// (DecodeLoop::run sets it for its thread), seeded by the caller from torch's default generator: a seeded
// call repeats, and each row samples its own stream as a single call samples torch's. Elsewhere (a single
// sequence, no generator set) the draws take torch's default generator, as before.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace mtprobe {

namespace detail {
inline thread_local const at::Generator* sampling_generator = nullptr;
}  // namespace detail

// The generator this thread's loop samples with on `device`, or nullopt (torch's default for the device):
// a generator for another device than the one the draw runs on is not used.
inline std::optional<at::Generator> sampling_generator(const at::Device& device) {
  const at::Generator* g = detail::sampling_generator;
  if (g == nullptr || !g->defined() || g->device().type() != device.type()) return std::nullopt;
  return *g;
}

// The generator itself for a draw on `device`: this thread's loop's, else torch's default for the device
// (whose state a caller may save and restore).
inline at::Generator sampling_generator_or_default(const at::Device& device) {
  std::optional<at::Generator> g = sampling_generator(device);
  return g.has_value() ? *g : at::globalContext().defaultGenerator(device);
}

// Sets this thread's generator for its lifetime (an undefined or absent one: torch's default), restoring the
// previous one after.
class SamplingGeneratorScope {
 public:
  explicit SamplingGeneratorScope(const std::optional<at::Generator>& generator)
      : previous_(detail::sampling_generator) {
    detail::sampling_generator = generator.has_value() && generator->defined() ? &*generator : nullptr;
  }
  ~SamplingGeneratorScope() { detail::sampling_generator = previous_; }
  SamplingGeneratorScope(const SamplingGeneratorScope&) = delete;
  SamplingGeneratorScope& operator=(const SamplingGeneratorScope&) = delete;

 private:
  const at::Generator* previous_;
};

}  // namespace mtprobe
