// STAND drafting (Song et al. 2025, "Stochastic Adaptive N-gram Drafting"; seed 001, App. F):
// n-gram keys mapped to accumulated next-token probability mass, and a draft tree grown
// best-first from them. Torch-free, C++17.
//
// NgramStore: for n = 1..max_ngram, the key context[len-n:len] maps to a table token -> mass.
// add() adds the target model's top-k next-token distribution after context to every such key;
// add_token() adds a one-hot distribution (text whose logits are unknown). Each table keeps its
// top_k entries by mass (ties: lower token id); the evicted mass is dropped, so lookups
// normalise over the kept entries only. Probabilities <= 0 (and NaN) are ignored.
// lookup() takes the longest n whose key has a table.
//
// build_stand_tree: best-first by cumulative probability, like the dynamic tree of draft_tree.h.
// A candidate is (parent, token, score = parent's score * p), p from lookup(context + path to the
// parent); the root (the last context token) has score 1. The best candidate becomes the next
// node (ties: earlier parent, the root first; then higher p; then lower token id), and pushes its
// own children while its depth < max_depth; stop after `budget` drafts or when none is left.
//
// Example, max_ngram = 2, top_k = 3:
//   add([5 6], {7: .6, 8: .2})   -> [6], [5 6] : {7: .6, 8: .2}  (lookup: 7 .75, 8 .25)
//   add([6 7], {9: 1})           -> [7], [6 7] : {9: 1}
//   add([6 8], {9: .5, 7: .5})   -> [8], [6 8] : {7: .5, 9: .5}
//   build_stand_tree(context [5 6], budget 4, max_depth 3):
//     6 (root) -+- 7 (.75) --- 9 (.75)        [7 9] and [9] have no table: 9 is a leaf
//               +- 8 (.25) -+- 7 (.125)       7 and 9 tie; the lower token id goes first
//                           +- 9 (.125)       cut by the budget
//   tokens = [7 9 8 7], parents = [-1 0 -1 2]
//
// Relation to prompt lookup (ngram.h): if every table the tree looks up has a single entry (a
// one-hot store of the history where each matched n-gram was always followed by the same token),
// every score is 1 and the tree is a chain of up to min(budget, max_depth) tokens whose first
// tokens are prompt lookup's draft; prompt lookup stops at the end of the history where STAND
// may go on. Otherwise STAND takes the most massive continuation, not the earliest occurrence's,
// and may branch even when budget == max_depth (a sibling can outscore a deeper node).
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace mtprobe::core {

class NgramStore {
 public:
  // Throws std::invalid_argument unless max_ngram >= 1 and top_k >= 1.
  explicit NgramStore(int64_t max_ngram = 3, int64_t top_k = 8);

  // The distribution after context[0:len], as its top-k (tokens[k], probs[k]).
  void add(const int64_t* context, int64_t len, const int64_t* tokens, const float* probs, int64_t k);
  // add() with probability 1 for `next`.
  void add_token(const int64_t* context, int64_t len, int64_t next);

  // Writes the table of the longest matching key (n = max_ngram down to 1), normalised over the
  // whole table to sum 1, by probability descending (ties: lower token id), at most cap entries;
  // returns how many (0: no key matched). out_tokens[cap], out_probs[cap].
  int64_t lookup(const int64_t* context, int64_t len, int64_t* out_tokens, float* out_probs,
                 int64_t cap) const;
  // The same in double precision (build_stand_tree scores with it).
  int64_t lookup(const int64_t* context, int64_t len, int64_t* out_tokens, double* out_probs,
                 int64_t cap) const;

  int64_t max_ngram() const { return max_ngram_; }
  int64_t top_k() const { return top_k_; }
  int64_t num_keys() const { return static_cast<int64_t>(tables_.size()); }

 private:
  struct Entry {
    int64_t token;
    double mass;
  };
  using Table = std::vector<Entry>;  // sorted: mass descending, then token ascending
  struct KeyHash {
    std::size_t operator()(const std::vector<int64_t>& key) const;
  };

  const Table* longest_match(const int64_t* context, int64_t len) const;

  int64_t max_ngram_;
  int64_t top_k_;
  std::unordered_map<std::vector<int64_t>, Table, KeyHash> tables_;
};

// Writes at most `budget` draft nodes (the root is not one) of depth <= max_depth; out_parents[i]
// is -1 for a child of the root, else an earlier node's index (nodes in order of selection).
// Returns the number of nodes (0: nothing matched). out_tokens[budget], out_parents[budget], and,
// when given, out_scores[budget]: each node's cumulative probability.
int64_t build_stand_tree(const NgramStore& store, const int64_t* context, int64_t len, int64_t budget,
                         int64_t max_depth, int64_t* out_tokens, int64_t* out_parents,
                         double* out_scores = nullptr);

}  // namespace mtprobe::core
