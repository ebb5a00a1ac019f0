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
#include <list>
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
  // The table of exactly the key context[len-n : len], as lookup() writes it (0: no such key, or
  // n outside 1..min(max_ngram, len)).
  int64_t lookup_ngram(const int64_t* context, int64_t len, int64_t n, int64_t* out_tokens, double* out_probs,
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

// NgramMemory: a bounded n-gram store shared across generations (the cross-request memory of
// STAND and the hybrid; SuffixDecoding's global tree, as n-gram tables). The per-request
// NgramStore starts empty with every generation; the memory keeps what earlier generations wrote,
// so text that recurs across prompts (a repeated question, a chat template's answer opening,
// boilerplate code) is drafted from the first step on.
//
// What it holds: fold(text) takes one finished generation's committed text (prompt + output) and,
// for every position i >= 1 and n = 1..max_ngram, adds mass 1 for text[i] to the key
// text[i-n : i] (NgramStore::add_token's rule; tables keep their top_k tokens by mass, ties: lower
// token id). Only tokens, not the target's distributions: the text is what the target committed,
// and counts of committed continuations are what a suffix tree of earlier outputs holds.
//
// Bound and eviction: at most `capacity` keys (one key = one n-gram with its table of <= top_k
// entries). A key is used when fold() writes it or a lookup returns its table; when a fold needs a
// new key and the memory is full, the least recently used key is evicted first (LRU). Keys are
// touched in text order, n = 1..max_ngram at each position, so the result is deterministic.
//
// Example, capacity 3, max_ngram 1 (keys least recently used first):
//   fold([1 2 3 1 4])   -> [1]{2:1}, [2]{3:1}, [3]{1:1}, then [1] again: {2:1, 4:1}
//                          order [2] [3] [1]
//   fold([5 2])         -> [5] is new and the memory is full: [2] (least recently used) goes
//                          order [3] [1] [5]
//   lookup([3])         -> {1: 1}: 1 / (1 + 1) = 0.5; [3] becomes the most recent: order [1] [5] [3]
//   fold([6 1])         -> [6] is new: [1] goes; order [5] [3] [6]
//
// How drafting reads it (build_stand_tree with a memory): for n = max_ngram down to 1 (the larger
// of the two stores' max_ngram), the per-request store's key of n tokens if it has one, else the
// memory's key of n tokens: the longest match wins, whichever store holds it, and at equal length
// the per-request store (this prompt's own text and the target's distributions) goes first. The
// two tables are not merged: their masses are on different scales (probabilities vs counts), and
// the longer context is the better predictor.
//
// Not thread-safe on its own: calls must not overlap (from Python they hold the GIL).
class NgramMemory {
 public:
  // Throws std::invalid_argument naming the value unless capacity, max_ngram and top_k are >= 1.
  explicit NgramMemory(int64_t capacity, int64_t max_ngram = 3, int64_t top_k = 8);

  // Folds one generation's committed text, text[len] (prompt + output), in as stated above.
  void fold(const int64_t* text, int64_t len);

  // The table of exactly the key context[len-n : len], by count descending (ties: lower token id),
  // at most cap entries, each count c as c / (total + distinct): PPM's method-C escape, which keeps
  // mass for a continuation never seen, so a key seen once drafts at 1/2, not 1 (a bare
  // c / total would outrank the target's own distributions in the per-request store and, in the
  // hybrid, probing's drafts; measured in benchmarks/results/suffix_decoding/README.md). Marks the
  // key used and counts a hit. Returns how many (0: no such key, or n outside 1..min(max_ngram, len)).
  int64_t lookup_ngram(const int64_t* context, int64_t len, int64_t n, int64_t* out_tokens, double* out_probs,
                       int64_t cap);
  // The longest matching key's table (n = max_ngram down to 1), as lookup_ngram.
  int64_t lookup(const int64_t* context, int64_t len, int64_t* out_tokens, double* out_probs, int64_t cap);

  // Every key, least recently used first.
  std::vector<std::vector<int64_t>> keys() const;
  void clear();  // forgets every key (the hit count too)

  int64_t capacity() const { return capacity_; }
  int64_t max_ngram() const { return max_ngram_; }
  int64_t top_k() const { return top_k_; }
  int64_t size() const { return static_cast<int64_t>(index_.size()); }
  int64_t hits() const { return hits_; }  // lookups that returned a table since the last clear()

 private:
  struct Entry {
    int64_t token;
    double mass;
  };
  struct Slot {
    std::vector<int64_t> key;
    std::vector<Entry> table;  // sorted: mass descending, then token ascending
  };
  struct KeyHash {
    std::size_t operator()(const std::vector<int64_t>& key) const;
  };

  std::list<Slot>::iterator touch(std::list<Slot>::iterator it);  // moves it to the most recent end

  int64_t capacity_;
  int64_t max_ngram_;
  int64_t top_k_;
  int64_t hits_ = 0;
  std::list<Slot> order_;  // least recently used first
  std::unordered_map<std::vector<int64_t>, std::list<Slot>::iterator, KeyHash> index_;
};

// Writes at most `budget` draft nodes (the root is not one) of depth <= max_depth; out_parents[i]
// is -1 for a child of the root, else an earlier node's index (nodes in order of selection).
// Returns the number of nodes (0: nothing matched). out_tokens[budget], out_parents[budget], and,
// when given, out_scores[budget]: each node's cumulative probability. With a `memory`, lookups fall
// back to it where the store has no key of that length (NgramMemory above).
//
// With a `seed`, the tree grows from another drafter's tree as well (the hybrid: probing's tree over
// the same root). Seed node i > 0 (node 0 is the root; parents[i] < i) is a candidate with its own
// score (siblings distinct), pushed once its seed parent is placed, and every placed node, wherever it came
// from, pushes the store's children: the store drafts below a probed token too. A (parent, token) placed
// twice is one node, at the higher score (the one taken first). Without a seed, or with only its root, the
// tree is the store's alone.
//   Example: the store above, context [5 6], seed 6 -+- 8 (.5) --- 7 (.3); budget 4, max_depth 3:
//     7 (.75), 9 (.75 * 1), 8 (.5: the seed's, above the store's .25), then 8's children from the
//     seed (7 .3) and the store (7 .25, 9 .25): 7 (.3); the store's 7 under 8 is the same node.
//     tokens = [7 9 8 7], parents = [-1 0 -1 2]
struct SeedTree {
  const int64_t* tokens = nullptr;   // [size]
  const int64_t* parents = nullptr;  // [size], parents[0] = -1
  const double* scores = nullptr;    // [size], cumulative probabilities
  int64_t size = 0;
};
int64_t build_stand_tree(const NgramStore& store, const int64_t* context, int64_t len, int64_t budget,
                         int64_t max_depth, int64_t* out_tokens, int64_t* out_parents,
                         double* out_scores = nullptr, NgramMemory* memory = nullptr,
                         const SeedTree& seed = SeedTree{});

}  // namespace mtprobe::core
