// RoPE's frequency tables of a decoder's layers: the model's own inv_freq, then any layer's own (Gemma 3's
// sliding layers turn by another base), each table once however many layers share it. Used by
// TargetForward and QuantizedDecoder.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace mtprobe {

struct RopeTables {
  std::vector<at::Tensor> tables;  // [head_dim / 2] float32 each; tables[0] the model's
  std::vector<size_t> of_layer;    // each layer's table, in the order the layers were added

  explicit RopeTables(at::Tensor base) { tables.push_back(std::move(base)); }

  // The next layer: its own frequencies `own` (checked by the caller), or undefined for the model's.
  void add_layer(const at::Tensor& own) {
    size_t index = 0;
    if (own.defined()) {
      auto same = std::find_if(tables.begin(), tables.end(),
                               [&](const at::Tensor& t) { return t.data_ptr() == own.data_ptr(); });
      if (same == tables.end()) same = tables.insert(tables.end(), own);
      index = static_cast<size_t>(same - tables.begin());
    }
    of_layer.push_back(index);
  }

  // cos and sin [tables, rows, half] at rows first..first + n - 1, for the positions pos[0..n), in float32 as
  // HF computes them (position * inv_freq, then cos and sin), times `scaling` (HF's attention_scaling).
  void angles(const int64_t* pos, int64_t n, int64_t first, int64_t rows, int64_t half, float scaling,
              float* cos, float* sin) const {
    for (size_t r = 0; r < tables.size(); ++r) {
      const float* inv_freq = tables[r].const_data_ptr<float>();
      for (int64_t t = 0; t < n; ++t) {
        const int64_t at = (static_cast<int64_t>(r) * rows + first + t) * half;
        for (int64_t i = 0; i < half; ++i) {
          const float angle = static_cast<float>(pos[t]) * inv_freq[i];
          cos[at + i] = std::cos(angle) * scaling;
          sin[at + i] = std::sin(angle) * scaling;
        }
      }
    }
  }
};

}  // namespace mtprobe
