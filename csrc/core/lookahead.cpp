#include "core/lookahead.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace mtprobe::core {

LookaheadPool::LookaheadPool(int64_t ngram_size, int64_t guess_set_size)
    : ngram_size_(ngram_size), guess_set_size_(guess_set_size) {
  if (ngram_size < 2 || guess_set_size < 1) {
    throw std::invalid_argument("LookaheadPool: ngram_size must be >= 2 and guess_set_size >= 1, got " +
                                std::to_string(ngram_size) + " and " + std::to_string(guess_set_size));
  }
}

void LookaheadPool::add(const int64_t* ngram) {
  std::vector<int64_t> continuation(ngram + 1, ngram + ngram_size_);
  auto& set = sets_[ngram[0]];
  auto it = std::find(set.begin(), set.end(), continuation);
  if (it != set.end()) {
    set.erase(it);  // a repeat: moves to the newest place
  } else if (static_cast<int64_t>(set.size()) == guess_set_size_) {
    set.pop_front();  // full: the oldest goes
  }
  set.push_back(std::move(continuation));
}

int64_t LookaheadPool::lookup(int64_t key, int64_t* out) const {
  auto it = sets_.find(key);
  if (it == sets_.end()) return 0;
  int64_t count = 0;
  for (const auto& continuation : it->second) {
    std::copy(continuation.begin(), continuation.end(), out + count * (ngram_size_ - 1));
    ++count;
  }
  return count;
}

int64_t build_guess_tree(const int64_t* guesses, int64_t num_guesses, int64_t length, int64_t max_depth,
                         int64_t* out_tokens, int64_t* out_parents) {
  const int64_t depth = std::min(length, max_depth);
  int64_t n = 0;
  for (int64_t g = 0; g < num_guesses; ++g) {
    int64_t parent = -1;
    for (int64_t d = 0; d < depth; ++d) {
      const int64_t token = guesses[g * length + d];
      int64_t node = -1;
      for (int64_t i = 0; i < n && node < 0; ++i) {  // n <= G (L - 1): a scan is cheap
        if (out_parents[i] == parent && out_tokens[i] == token) node = i;
      }
      if (node < 0) {
        node = n++;
        out_tokens[node] = token;
        out_parents[node] = parent;
      }
      parent = node;
    }
  }
  return n;
}

LookaheadWindow::LookaheadWindow(int64_t ngram_size, int64_t window)
    : ngram_size_(ngram_size), window_(window) {
  if (ngram_size < 2 || window < 1) {
    throw std::invalid_argument("LookaheadWindow: ngram_size must be >= 2 and window >= 1, got " +
                                std::to_string(ngram_size) + " and " + std::to_string(window));
  }
  cells_.assign(static_cast<size_t>((ngram_size - 1) * window), -1);
}

void LookaheadWindow::reset(const int64_t* prompt, int64_t len) {
  if (len < 1) throw std::invalid_argument("LookaheadWindow::reset: the prompt is empty");
  for (int64_t k = 1; k < static_cast<int64_t>(cells_.size()); ++k) cells_[k] = prompt[k % len];
  cells_[0] = -1;
  updates_ = 0;
}

int64_t LookaheadWindow::cell_index(int64_t level, int64_t column) const {
  // Level 0 lacks its column 0 (the root), so every cell sits one place earlier than l W + j.
  return level * window_ + column - 1;
}

void LookaheadWindow::layout(int64_t* tokens, int64_t* parents) const {
  for (int64_t l = 0; l < ngram_size_ - 1; ++l) {
    for (int64_t j = l == 0 ? 1 : 0; j < window_; ++j) {
      const int64_t i = cell_index(l, j);
      tokens[i] = cell(l, j);
      parents[i] = l == 0 ? cell_index(0, j - 1) : cell_index(l - 1, j);  // cell_index(0, 0) = -1
    }
  }
}

void LookaheadWindow::update(int64_t root, const int64_t* next, LookaheadPool& pool) {
  const int64_t levels = ngram_size_ - 1;
  if (updates_ >= levels) {  // every cell was made by the model: its columns are n-grams
    std::vector<int64_t> ngram(static_cast<size_t>(ngram_size_));
    for (int64_t j = 0; j < window_; ++j) {
      ngram[0] = j == 0 ? root : cell(0, j);
      for (int64_t l = 1; l < levels; ++l) ngram[l] = cell(l, j);
      ngram[levels] = next[j];
      pool.add(ngram.data());
    }
  }
  for (int64_t l = 0; l < levels; ++l) {
    for (int64_t j = l == 0 ? 1 : 0; j < window_; ++j) {
      cells_[l * window_ + j] = l + 1 < levels ? cell(l + 1, j) : next[j];
    }
  }
  ++updates_;
}

}  // namespace mtprobe::core
