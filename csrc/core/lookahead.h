// Lookahead decoding (Fu et al. 2024, "Break the Sequential Dependency of LLM Inference Using
// Lookahead Decoding"; seed 001 App. F, seed 004): Jacobi iteration on a window of future tokens
// produces n-grams; n-grams that start with the current token are verified in the same forward.
// Torch-free, C++17. L = ngram_size, W = window, G = guess_set_size.
//
// The window is (L - 1) levels x W columns of tokens; cell (l, j) sits at depth j + l below the
// root (the last committed token), and cell (0, 0) *is* the root. Cell (l, j) attends to the
// prefix, to cells (0, 0..j) and to cells (1..l, j): the text it continues is level 0 up to its
// column, then its column upwards. That pattern is a tree (a comb), so the window needs no special
// mask: parent(0, j) = (0, j - 1) and parent(l, j) = (l - 1, j) for l >= 1. Example, L = 3, W = 3
// (r = the root; depth in brackets):
//
//     r[0] -- a[1] -- b[2]          level 0: r a b
//     |       |       |
//     c[1]    d[2]    e[3]          level 1: c d e
//
// One step's outputs: next[j] = argmax of the target's logits at cell (L - 2, j), a guess of the
// token at depth j + L - 1. update() then
//   1. adds, once every cell was made by the model (after L - 1 updates; the first window is copied
//      from the prompt), the W n-grams (cell(0, j), cell(1, j), ..., cell(L - 2, j), next[j]) to
//      the pool, cell(0, 0) being the root;
//   2. shifts the window one level up, as if the root advanced one token (LADE's default): cell
//      (l, j) <- cell (l + 1, j), with next as level L - 1; depths drop by one, so each cell keeps
//      its absolute position. Level 0's column 0 is the next root and is not stored.
// In the example, next = [x y z]: n-grams (r c x), (a d y), (b e z); new window: level 0 = r' d e,
// level 1 = x y z (r' = the next step's root).
//
// The pool maps a token to at most G continuations of L - 1 tokens, oldest first: adding a known
// n-gram moves it to the newest place, a new one evicts the oldest of a full set. The step's guesses
// are the continuations of the root; build_guess_tree merges them into one tree (chains sharing a
// prefix share its nodes, so a tree never holds more than G (L - 1) guess nodes).
//
// Inputs per decode step: the root, the guess tree and the (L - 1) W - 1 other window cells, at
// most (L - 1)(W + G): LADE's block complexity, the root counted.
#pragma once

#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

namespace mtprobe::core {

class LookaheadPool {
 public:
  // Throws std::invalid_argument unless ngram_size >= 2 and guess_set_size >= 1.
  LookaheadPool(int64_t ngram_size, int64_t guess_set_size);

  // ngram[ngram_size]: the key ngram[0] and its continuation ngram[1:].
  void add(const int64_t* ngram);
  // Writes the continuations after `key`, oldest first, into out[count * (ngram_size - 1)]
  // (out must hold guess_set_size * (ngram_size - 1) tokens); returns count.
  int64_t lookup(int64_t key, int64_t* out) const;

  int64_t ngram_size() const { return ngram_size_; }
  int64_t guess_set_size() const { return guess_set_size_; }
  int64_t num_keys() const { return static_cast<int64_t>(sets_.size()); }

 private:
  int64_t ngram_size_;
  int64_t guess_set_size_;
  std::unordered_map<int64_t, std::deque<std::vector<int64_t>>> sets_;
};

// Merges `num_guesses` chains of `length` tokens (guesses[num_guesses * length], each hanging from
// the root) into a tree, each chain cut to max_depth tokens: tokens and parents (-1 = a child of the
// root) in the order nodes are first met. out_* hold num_guesses * length entries. Returns the node
// count.
int64_t build_guess_tree(const int64_t* guesses, int64_t num_guesses, int64_t length, int64_t max_depth,
                         int64_t* out_tokens, int64_t* out_parents);

class LookaheadWindow {
 public:
  // Throws std::invalid_argument unless ngram_size >= 2 and window >= 1.
  LookaheadWindow(int64_t ngram_size, int64_t window);

  // A new sequence: cell k of the window, counted level by level (k = l W + j), gets
  // prompt[k mod len] (LADE copies prompt tokens at random; a fixed rule keeps runs reproducible).
  void reset(const int64_t* prompt, int64_t len);

  // The cells other than the root, level 0 first then level by level: (L - 1) W - 1 inputs.
  int64_t num_cells() const { return (ngram_size_ - 1) * window_ - 1; }
  // Depth of the deepest cell below the root: W - 1 + L - 2.
  int64_t max_depth() const { return window_ + ngram_size_ - 3; }
  // tokens[num_cells()], parents[num_cells()]: a parent is another cell's index, or -1 for the root.
  void layout(int64_t* tokens, int64_t* parents) const;
  // Index of cell (level, column) among the num_cells() inputs; -1 for the root (0, 0).
  int64_t cell_index(int64_t level, int64_t column) const;

  // After a forward: next[window] = argmax at cells (L - 2, 0..W - 1); root = the step's root.
  // Adds the window's n-grams to pool (once warm) and shifts the window.
  void update(int64_t root, const int64_t* next, LookaheadPool& pool);

  int64_t updates() const { return updates_; }
  int64_t ngram_size() const { return ngram_size_; }
  int64_t window() const { return window_; }
  // Cell (level, column); cell (0, 0) holds no token (the root) and reads as -1.
  int64_t cell(int64_t level, int64_t column) const { return cells_[level * window_ + column]; }

 private:
  int64_t ngram_size_;
  int64_t window_;
  int64_t updates_ = 0;
  std::vector<int64_t> cells_;  // [(L - 1) * W], level-major
};

}  // namespace mtprobe::core
