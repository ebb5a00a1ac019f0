// The dynamic draft tree (seed 001, Alg. 1), written once for the host and the device.
//
// core::build_dynamic_tree (draft_tree.h) runs it serially on the host; the CUDA kernel
// (csrc/kernels/draft_tree.cuh) runs the same code on the threads of one block, so the decode
// loop can expand the next tree on the GPU without reading anything back. The code is
// torch-free and allocation-free: the caller passes a workspace of fixed capacity.
//
// Every loop below is either "for each index i" (the executor spreads i over its threads and
// synchronises after the loop) or runs on the leader alone; both read only what an earlier
// synchronisation published. The result is the same as the vector-based description in
// draft_tree.h, whichever executor runs it:
//
//   1. cand[0] = root. For depth d = 1..depths while budget - d > 0: every frontier node gets
//      its first budget - d candidates of depth d (pruned ones skipped), cumulative
//      probability prob(parent) * p; then, if d < depths, the best budget - d candidates not
//      picked before are picked, and the depth-d ones among them (in rank order) are the next
//      frontier.
//   2. Rank = (cumulative probability descending, depth ascending, index ascending; RanksBefore).
//   3. Keep the best budget - 1 candidates whose parent is kept; lay them out by depth, then rank.
//
// The rank is a strict total order, so ranking is sorting (exec.h's exec_sort / exec_merge:
// std::sort on one host thread, a parallel merge sort on a block). With C candidates, budget B:
//   1. each depth sorts its new candidates and merges them into the candidates not picked so far,
//      which stay sorted from the depth before: O(C log C) over all depths, plus O(B) per
//      frontier node for its children (O(m) where a depth's tokens repeat);
//   2. the picked candidates (at most B per depth) are sorted and merged with the rest: O(C);
//   3. the leader walks the ranking until budget - 1 are kept (O(B), O(C) at worst) and lays them
//      out with a counting sort by depth: O(B).
// So O(C log C) on the host, where C <= 1 + sum over depths of B * min(m, B)
// (dynamic_tree_capacity); a block does O(C log^2 C) work over its threads.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/exec.h"

namespace mtprobe::core {

// Candidate indices are int32: the most candidates a workspace can hold.
constexpr int64_t kMaxDynamicTreeCandidates = 2147483647;

// The most candidates the expansion can create: depth d adds at most min(m, budget - d) children
// to each of at most budget - d + 1 frontier nodes (one, the root, at depth 1). Saturates: a
// count above kMaxDynamicTreeCandidates returns kMaxDynamicTreeCandidates + 1 (too many).
MTPROBE_HD inline int64_t dynamic_tree_capacity(int64_t depths, int64_t m, int64_t budget) {
  int64_t cap = 1, frontier = 1;
  for (int64_t d = 1; d <= depths && budget - d > 0; ++d) {
    const int64_t kids = m < budget - d ? m : budget - d;
    if (kids > 0 && frontier > (kMaxDynamicTreeCandidates - cap) / kids) return kMaxDynamicTreeCandidates + 1;
    cap += frontier * kids;
    frontier = budget - d;
  }
  return cap;
}

// The candidates per depth that can matter when a depth's tokens are distinct (as the top-m of a
// distribution are): a node takes at most budget - 1 children, and the pruner skips at most two
// tokens (its parent's and the root's), so ranks past budget + 1 are never read. The same tree
// comes out for width and for dynamic_tree_width(width, budget).
MTPROBE_HD inline int64_t dynamic_tree_width(int64_t width, int64_t budget) {
  return width <= budget ? width : budget + 1;
}

// Scratch arrays, caller-allocated: C = dynamic_tree_capacity(...) (at most
// kMaxDynamicTreeCandidates), F = max(budget, 1).
struct DynamicTreeWorkspace {
  int64_t* token;      // [C] candidate token
  int32_t* parent;     // [C] candidate index of the parent, -1 for the root
  int32_t* depth;      // [C]
  double* prob;        // [C] cumulative probability of the path
  int32_t* order;      // [C] step 1: the candidates not picked yet, in rank order
  int32_t* ranked;     // [C] step 1: sorting and merging scratch; step 2: every candidate but the root,
                       //     in rank order
  int32_t* picked;     // [C] the candidates picked for expansion (step 1), then in rank order (step 2)
  int32_t* new_index;  // [C] step 3: output index of a kept candidate (shares order's memory, unused by then)
  uint8_t* flag;       // [C] step 3: kept
  int32_t* frontier;   // [F] the nodes expanded at the current depth, in rank order; step 3: the kept
                       //     candidates, in rank order
  int32_t* offset;     // [F] children per frontier node, then their exclusive prefix sum; step 3: the
                       //     output index of the next kept node of each depth (depths < budget)
  int32_t* counts;     // [3] candidates, frontier size, output nodes
};

// Bytes of a workspace for capacity C and budget; carve_dynamic_tree_workspace lays it out.
MTPROBE_HD inline size_t dynamic_tree_workspace_bytes(int64_t capacity, int64_t budget) {
  const size_t c = static_cast<size_t>(capacity), f = static_cast<size_t>(budget < 1 ? 1 : budget);
  // 8-byte arrays first, so every array stays aligned.
  return c * (sizeof(int64_t) + sizeof(double)) + c * 5 * sizeof(int32_t) + f * 2 * sizeof(int32_t) +
         3 * sizeof(int32_t) + c;
}

MTPROBE_HD inline DynamicTreeWorkspace carve_dynamic_tree_workspace(void* base, int64_t capacity,
                                                                    int64_t budget) {
  const size_t c = static_cast<size_t>(capacity), f = static_cast<size_t>(budget < 1 ? 1 : budget);
  char* p = static_cast<char*>(base);
  DynamicTreeWorkspace w{};
  w.token = reinterpret_cast<int64_t*>(p), p += c * sizeof(int64_t);
  w.prob = reinterpret_cast<double*>(p), p += c * sizeof(double);
  w.parent = reinterpret_cast<int32_t*>(p), p += c * sizeof(int32_t);
  w.depth = reinterpret_cast<int32_t*>(p), p += c * sizeof(int32_t);
  w.order = w.new_index = reinterpret_cast<int32_t*>(p), p += c * sizeof(int32_t);
  w.ranked = reinterpret_cast<int32_t*>(p), p += c * sizeof(int32_t);
  w.picked = reinterpret_cast<int32_t*>(p), p += c * sizeof(int32_t);
  w.frontier = reinterpret_cast<int32_t*>(p), p += f * sizeof(int32_t);
  w.offset = reinterpret_cast<int32_t*>(p), p += f * sizeof(int32_t);
  w.counts = reinterpret_cast<int32_t*>(p), p += 3 * sizeof(int32_t);
  w.flag = reinterpret_cast<uint8_t*>(p);
  return w;
}

// The rank order on candidate indices: a ranks before b. (Candidates are numbered depth by depth,
// so for equal probabilities the depth order is the index order; the depth is compared anyway.)
// A NaN probability, which only broken inputs give (an inf logit, inf * 0), ranks after every
// number, so the order stays a strict total order: the sorts rely on that.
struct RanksBefore {
  const double* prob;
  const int32_t* depth;
  MTPROBE_HD bool operator()(int64_t a, int64_t b) const {
    const double pa = prob[a], pb = prob[b];
    if (pa > pb) return true;
    if (pa < pb) return false;
    const bool nan_a = pa != pa, nan_b = pb != pb;  // equal, or unordered: a NaN
    if (nan_a != nan_b) return nan_b;
    if (depth[a] != depth[b]) return depth[a] < depth[b];
    return a < b;
  }
};

// Candidate a ranks before candidate b.
MTPROBE_HD inline bool ranks_before(const DynamicTreeWorkspace& w, int64_t a, int64_t b) {
  return RanksBefore{w.prob, w.depth}(a, b);
}

// Expands the dynamic tree. cand_tokens / cand_probs: [depths, m], each depth's top-m tokens
// best first. Writes `budget` entries of out_tokens / out_parents / out_probs: the tree
// [root, ...] (every parent before its children), then padding (token -1, parent -1, prob 0).
// Returns the number of tree nodes (1 + drafts), on every thread.
template <typename Exec>
MTPROBE_HD int64_t expand_dynamic_tree(const Exec& ex, int64_t root_token, const int64_t* cand_tokens,
                                       const float* cand_probs, int64_t depths, int64_t m, int64_t budget,
                                       bool prune, DynamicTreeWorkspace w, int64_t* out_tokens,
                                       int64_t* out_parents, double* out_probs) {
  const RanksBefore less{w.prob, w.depth};
  if (ex.leader()) {
    w.token[0] = root_token, w.parent[0] = -1, w.depth[0] = 0, w.prob[0] = 1.0;
    w.frontier[0] = 0;
    w.counts[0] = 1;  // candidates
    w.counts[1] = 1;  // frontier size
  }
  ex.sync();

  // 1. Expand depth by depth. order[0, open): the candidates not picked yet, in rank order;
  // picked[0, num_picked): those picked, each depth's in rank order. (Every thread keeps both
  // counts: they follow from published values alone.)
  int64_t open = 0, num_picked = 0;
  for (int64_t d = 1; d <= depths && budget - d > 0; ++d) {
    const int64_t count = budget - d;  // children per node, and picks for the next depth
    const int64_t* tok = cand_tokens + (d - 1) * m;
    const float* pr = cand_probs + (d - 1) * m;
    const int64_t n0 = w.counts[0], nf = w.counts[1];
    // How many children each frontier node gets (the pruner skips its parent's token and the root's).
    for (int64_t f = ex.first(); f < nf; f += ex.stride()) {
      const int64_t parent_token = w.token[w.frontier[f]];
      int32_t kids = 0;
      for (int64_t r = 0; r < m && kids < count; ++r) {
        if (!(prune && (tok[r] == parent_token || tok[r] == root_token))) ++kids;
      }
      w.offset[f] = kids;
    }
    ex.sync();
    if (ex.leader()) {
      int32_t total = 0;
      for (int64_t f = 0; f < nf; ++f) {
        const int32_t kids = w.offset[f];
        w.offset[f] = total;
        total += kids;
      }
      w.counts[0] = static_cast<int32_t>(n0 + total);
    }
    ex.sync();
    for (int64_t f = ex.first(); f < nf; f += ex.stride()) {
      const int32_t node = w.frontier[f];
      const int64_t parent_token = w.token[node];
      int64_t at = n0 + w.offset[f], kids = 0;
      for (int64_t r = 0; r < m && kids < count; ++r) {
        if (prune && (tok[r] == parent_token || tok[r] == root_token)) continue;
        w.token[at] = tok[r], w.parent[at] = node, w.depth[at] = static_cast<int32_t>(d);
        w.prob[at] = w.prob[node] * static_cast<double>(pr[r]);
        w.order[open + at - n0] = static_cast<int32_t>(at);  // the new candidates follow the open ones
        ++at, ++kids;
      }
    }
    ex.sync();
    // Sort the new candidates order[open, open + added) and merge them into the open ones:
    // ranked[0, open + added) is every candidate not picked yet, in rank order.
    const int64_t added = w.counts[0] - n0;
    exec_sort(ex, w.order + open, w.ranked + open, added, less);
    exec_merge(ex, w.order, open, w.order + open, added, w.ranked, less);
    open += added;
    // Pick the best `count` of them (Alg. 1: C <- C \ N); the depth-d ones among them are
    // expanded next, in rank order. The rest, still in rank order, go back to order.
    const int64_t picks = d == depths ? 0 : (open < count ? open : count);
    if (ex.leader()) {
      int32_t nf_next = 0;
      for (int64_t r = 0; r < picks; ++r) {
        const int32_t i = w.ranked[r];
        w.picked[num_picked + r] = i;
        if (w.depth[i] == d) w.frontier[nf_next++] = i;
      }
      w.counts[1] = nf_next;
    }
    for (int64_t r = ex.first(); r < open - picks; r += ex.stride()) w.order[r] = w.ranked[picks + r];
    open -= picks, num_picked += picks;
    ex.sync();
  }

  // 2. Rank every candidate: the picked ones sorted, merged with the open ones.
  const int64_t n = w.counts[0];  // n - 1 == open + num_picked
  exec_sort(ex, w.picked, w.ranked, num_picked, less);
  exec_merge(ex, w.order, open, w.picked, num_picked, w.ranked, less);

  // 3. Keep the best budget - 1 whose parent is kept (a parent always ranks first, so the check
  // only guards that), then lay them out by depth, then rank: count the kept nodes of each depth,
  // then hand out output indices in rank order, each depth from its first index on.
  for (int64_t i = ex.first(); i < n; i += ex.stride()) w.flag[i] = i == 0;
  ex.sync();
  if (ex.leader()) {
    int64_t kept = 0, max_depth = 0;
    for (int64_t r = 0; r < n - 1 && kept < budget - 1; ++r) {
      const int32_t i = w.ranked[r];
      if (!w.flag[w.parent[i]]) continue;
      w.flag[i] = 1;
      w.frontier[kept++] = i;
      if (w.depth[i] > max_depth) max_depth = w.depth[i];
    }
    for (int64_t d = 0; d <= max_depth; ++d) w.offset[d] = 0;  // depths < budget <= F
    for (int64_t k = 0; k < kept; ++k) ++w.offset[w.depth[w.frontier[k]]];
    int32_t at = 1;  // after the root
    for (int64_t d = 0; d <= max_depth; ++d) {
      const int32_t nodes = w.offset[d];
      w.offset[d] = at;
      at += nodes;
    }
    w.new_index[0] = 0;
    for (int64_t k = 0; k < kept; ++k) w.new_index[w.frontier[k]] = w.offset[w.depth[w.frontier[k]]]++;
    w.counts[2] = static_cast<int32_t>(1 + kept);
  }
  ex.sync();
  const int64_t num_nodes = w.counts[2];
  for (int64_t k = ex.first(); k < num_nodes; k += ex.stride()) {
    const int32_t i = k == 0 ? 0 : w.frontier[k - 1];
    const int32_t at = w.new_index[i];
    out_tokens[at] = w.token[i];
    out_parents[at] = i == 0 ? -1 : w.new_index[w.parent[i]];
    out_probs[at] = w.prob[i];
  }
  for (int64_t i = ex.first() + num_nodes; i < budget; i += ex.stride()) {
    out_tokens[i] = -1, out_parents[i] = -1, out_probs[i] = 0.0;
  }
  ex.sync();
  return num_nodes;
}

}  // namespace mtprobe::core
