#include "core/ngram_store.h"

#include <algorithm>
#include <iterator>
#include <queue>
#include <stdexcept>
#include <string>

namespace mtprobe::core {

namespace {

// Copies the first min(cap, table size) entries, normalised over the whole table plus `escape`
// mass per entry (NgramMemory's counts: see lookup_ngram in ngram_store.h).
template <typename Entry, typename P>
int64_t write_table(const std::vector<Entry>& table, int64_t* out_tokens, P* out_probs, int64_t cap,
                    double escape = 0.0) {
  double total = 0.0;
  for (const Entry& e : table) total += e.mass;  // in table order, as the Python reference does
  total += escape * static_cast<double>(table.size());
  const int64_t count = std::min<int64_t>(cap, static_cast<int64_t>(table.size()));
  for (int64_t i = 0; i < count; ++i) {
    out_tokens[i] = table[i].token;
    out_probs[i] = static_cast<P>(table[i].mass / total);
  }
  return std::max<int64_t>(count, 0);
}

std::size_t hash_tokens(const std::vector<int64_t>& key) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the tokens
  for (int64_t t : key) h = (h ^ static_cast<uint64_t>(t)) * 1099511628211ull;
  return static_cast<std::size_t>(h);
}

}  // namespace

NgramStore::NgramStore(int64_t max_ngram, int64_t top_k) : max_ngram_(max_ngram), top_k_(top_k) {
  if (max_ngram < 1 || top_k < 1) {
    throw std::invalid_argument("NgramStore: max_ngram and top_k must be >= 1");
  }
}

std::size_t NgramStore::KeyHash::operator()(const std::vector<int64_t>& key) const {
  return hash_tokens(key);
}

int64_t NgramStore::lookup_ngram(const int64_t* context, int64_t len, int64_t n, int64_t* out_tokens,
                                 double* out_probs, int64_t cap) const {
  if (n < 1 || n > std::min(max_ngram_, len)) return 0;
  auto it = tables_.find(std::vector<int64_t>(context + len - n, context + len));
  if (it == tables_.end() || it->second.empty()) return 0;
  return write_table(it->second, out_tokens, out_probs, cap);
}

void NgramStore::add(const int64_t* context, int64_t len, const int64_t* tokens, const float* probs,
                     int64_t k) {
  bool any = false;
  for (int64_t i = 0; i < k; ++i) any = any || probs[i] > 0.0f;
  if (!any) return;  // no empty tables: a key with a table always has some mass
  std::vector<int64_t> key;
  for (int64_t n = 1; n <= std::min(max_ngram_, len); ++n) {
    key.assign(context + len - n, context + len);
    Table& table = tables_[key];
    for (int64_t i = 0; i < k; ++i) {
      if (!(probs[i] > 0.0f)) continue;
      auto it =
          std::find_if(table.begin(), table.end(), [&](const Entry& e) { return e.token == tokens[i]; });
      if (it == table.end()) {
        table.push_back({tokens[i], static_cast<double>(probs[i])});
      } else {
        it->mass += static_cast<double>(probs[i]);
      }
    }
    std::sort(table.begin(), table.end(), [](const Entry& a, const Entry& b) {
      return a.mass != b.mass ? a.mass > b.mass : a.token < b.token;
    });
    if (static_cast<int64_t>(table.size()) > top_k_) table.resize(top_k_);  // evicted mass is dropped
  }
}

void NgramStore::add_token(const int64_t* context, int64_t len, int64_t next) {
  const float one = 1.0f;
  add(context, len, &next, &one, 1);
}

const NgramStore::Table* NgramStore::longest_match(const int64_t* context, int64_t len) const {
  std::vector<int64_t> key;
  for (int64_t n = std::min(max_ngram_, len); n >= 1; --n) {
    key.assign(context + len - n, context + len);
    auto it = tables_.find(key);
    if (it != tables_.end() && !it->second.empty()) return &it->second;
  }
  return nullptr;
}

int64_t NgramStore::lookup(const int64_t* context, int64_t len, int64_t* out_tokens, float* out_probs,
                           int64_t cap) const {
  const Table* table = longest_match(context, len);
  return table == nullptr ? 0 : write_table(*table, out_tokens, out_probs, cap);
}

int64_t NgramStore::lookup(const int64_t* context, int64_t len, int64_t* out_tokens, double* out_probs,
                           int64_t cap) const {
  const Table* table = longest_match(context, len);
  return table == nullptr ? 0 : write_table(*table, out_tokens, out_probs, cap);
}

NgramMemory::NgramMemory(int64_t capacity, int64_t max_ngram, int64_t top_k)
    : capacity_(capacity), max_ngram_(max_ngram), top_k_(top_k) {
  if (capacity < 1) {
    throw std::invalid_argument("NgramMemory: capacity must be >= 1 (the most n-gram keys it keeps), got " +
                                std::to_string(capacity));
  }
  if (max_ngram < 1 || top_k < 1) {
    throw std::invalid_argument("NgramMemory: max_ngram and top_k must be >= 1, got " +
                                std::to_string(max_ngram) + " and " + std::to_string(top_k));
  }
}

std::size_t NgramMemory::KeyHash::operator()(const std::vector<int64_t>& key) const {
  return hash_tokens(key);
}

std::list<NgramMemory::Slot>::iterator NgramMemory::touch(std::list<Slot>::iterator it) {
  order_.splice(order_.end(), order_, it);  // iterators stay valid
  return it;
}

void NgramMemory::fold(const int64_t* text, int64_t len) {
  std::vector<int64_t> key;
  for (int64_t i = 1; i < len; ++i) {
    const int64_t next = text[i];
    for (int64_t n = 1; n <= std::min(max_ngram_, i); ++n) {
      key.assign(text + i - n, text + i);
      auto found = index_.find(key);
      std::list<Slot>::iterator slot;
      if (found != index_.end()) {
        slot = touch(found->second);
      } else {
        if (size() >= capacity_) {  // evict the least recently used key
          index_.erase(order_.front().key);
          order_.pop_front();
        }
        order_.push_back(Slot{key, {}});
        slot = std::prev(order_.end());
        index_.emplace(key, slot);
      }
      std::vector<Entry>& table = slot->table;
      auto it = std::find_if(table.begin(), table.end(), [&](const Entry& e) { return e.token == next; });
      if (it == table.end()) {
        table.push_back({next, 1.0});
      } else {
        it->mass += 1.0;
      }
      std::sort(table.begin(), table.end(), [](const Entry& a, const Entry& b) {
        return a.mass != b.mass ? a.mass > b.mass : a.token < b.token;
      });
      if (static_cast<int64_t>(table.size()) > top_k_) table.resize(top_k_);
    }
  }
}

int64_t NgramMemory::lookup_ngram(const int64_t* context, int64_t len, int64_t n, int64_t* out_tokens,
                                  double* out_probs, int64_t cap) {
  if (n < 1 || n > std::min(max_ngram_, len)) return 0;
  auto found = index_.find(std::vector<int64_t>(context + len - n, context + len));
  if (found == index_.end() || found->second->table.empty()) return 0;
  ++hits_;
  return write_table(touch(found->second)->table, out_tokens, out_probs, cap, 1.0);
}

int64_t NgramMemory::lookup(const int64_t* context, int64_t len, int64_t* out_tokens, double* out_probs,
                            int64_t cap) {
  for (int64_t n = std::min(max_ngram_, len); n >= 1; --n) {
    const int64_t m = lookup_ngram(context, len, n, out_tokens, out_probs, cap);
    if (m > 0) return m;
  }
  return 0;
}

std::vector<std::vector<int64_t>> NgramMemory::keys() const {
  std::vector<std::vector<int64_t>> out;
  out.reserve(order_.size());
  for (const Slot& s : order_) out.push_back(s.key);
  return out;
}

void NgramMemory::clear() {
  index_.clear();
  order_.clear();
  hits_ = 0;
}

int64_t build_stand_tree(const NgramStore& store, const int64_t* context, int64_t len, int64_t budget,
                         int64_t max_depth, int64_t* out_tokens, int64_t* out_parents, double* out_scores,
                         NgramMemory* memory, const SeedTree& seed) {
  if (len < 1 || budget < 1 || max_depth < 1) return 0;
  struct Cand {
    double score;
    int64_t parent;  // -1: the root
    double prob;
    int64_t token;
  };
  // priority_queue pops the largest: `ranks_below(a, b)` is true when b is taken before a.
  auto ranks_below = [](const Cand& a, const Cand& b) {
    if (a.score != b.score) return a.score < b.score;
    if (a.parent != b.parent) return a.parent > b.parent;
    if (a.prob != b.prob) return a.prob < b.prob;
    return a.token > b.token;
  };
  std::priority_queue<Cand, std::vector<Cand>, decltype(ranks_below)> queue(ranks_below);

  // Lookups read only the last max_ngram tokens (of either store).
  const int64_t n = std::max(store.max_ngram(), memory != nullptr ? memory->max_ngram() : 0);
  const int64_t cap = std::max(store.top_k(), memory != nullptr ? memory->top_k() : 0);
  std::vector<int64_t> depth;
  std::vector<int64_t> tail;
  std::vector<int64_t> cand_tokens(cap);
  std::vector<double> cand_probs(cap);
  auto push_children = [&](int64_t node, double score) {
    // The last n tokens of context + path to `node`, gathered backwards.
    tail.clear();
    for (int64_t v = node; v >= 0 && static_cast<int64_t>(tail.size()) < n; v = out_parents[v]) {
      tail.push_back(out_tokens[v]);
    }
    for (int64_t i = len - 1; i >= 0 && static_cast<int64_t>(tail.size()) < n; --i)
      tail.push_back(context[i]);
    std::reverse(tail.begin(), tail.end());
    // The longest key of either store; at equal length the per-request store's.
    const int64_t t = static_cast<int64_t>(tail.size());
    int64_t m = 0;
    for (int64_t k = t; k >= 1 && m == 0; --k) {
      m = store.lookup_ngram(tail.data(), t, k, cand_tokens.data(), cand_probs.data(), cap);
      if (m == 0 && memory != nullptr)
        m = memory->lookup_ngram(tail.data(), t, k, cand_tokens.data(), cand_probs.data(), cap);
    }
    for (int64_t i = 0; i < m; ++i) queue.push({score * cand_probs[i], node, cand_probs[i], cand_tokens[i]});
  };

  // The seed's children per seed node, and the seed node each placed node is (-1: none).
  std::vector<std::vector<int64_t>> seed_children(static_cast<size_t>(std::max<int64_t>(seed.size, 0)));
  for (int64_t i = 1; i < seed.size; ++i) seed_children[static_cast<size_t>(seed.parents[i])].push_back(i);
  std::vector<int64_t> seed_of;
  auto push_seed_children = [&](int64_t node, int64_t s) {
    for (int64_t i : seed_children[static_cast<size_t>(s)])
      queue.push({seed.scores[i], node, seed.scores[i], seed.tokens[i]});
  };
  std::vector<std::vector<int64_t>> children(1);  // placed nodes per parent (index parent + 1)

  push_children(-1, 1.0);
  if (seed.size > 0) push_seed_children(-1, 0);
  int64_t count = 0;
  while (count < budget && !queue.empty()) {
    const Cand c = queue.top();
    queue.pop();
    auto& siblings = children[static_cast<size_t>(c.parent + 1)];
    if (seed.size > 0) {  // without a seed no (parent, token) repeats: one table per parent
      bool placed = false;
      for (int64_t v : siblings) placed = placed || out_tokens[v] == c.token;
      if (placed) continue;
    }
    out_tokens[count] = c.token;
    out_parents[count] = c.parent;
    if (out_scores != nullptr) out_scores[count] = c.score;
    depth.push_back(c.parent < 0 ? 1 : depth[c.parent] + 1);
    siblings.push_back(count);
    children.emplace_back();
    ++count;
    const int64_t node = count - 1;
    if (depth.back() < max_depth && count < budget) push_children(node, c.score);
    if (seed.size > 0) {
      const int64_t parent_seed = c.parent < 0 ? 0 : seed_of[static_cast<size_t>(c.parent)];
      int64_t s = -1;
      if (parent_seed >= 0) {
        for (int64_t i : seed_children[static_cast<size_t>(parent_seed)]) {
          if (seed.tokens[i] == c.token) {
            s = i;
            break;
          }
        }
      }
      seed_of.push_back(s);
      if (s >= 0 && depth.back() < max_depth && count < budget) push_seed_children(node, s);
    }
  }
  return count;
}

}  // namespace mtprobe::core
