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
//   2. Rank = (cumulative probability descending, depth ascending, index ascending).
//   3. Keep the best budget - 1 candidates whose parent is kept; lay them out by depth, then rank.
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/exec.h"

namespace mtprobe::core {

// The most candidates the expansion can create: depth d adds at most min(m, budget - d) children
// to each of at most budget - d + 1 frontier nodes (one, the root, at depth 1).
MTPROBE_HD inline int64_t dynamic_tree_capacity(int64_t depths, int64_t m, int64_t budget) {
  int64_t cap = 1, frontier = 1;
  for (int64_t d = 1; d <= depths && budget - d > 0; ++d) {
    const int64_t kids = m < budget - d ? m : budget - d;
    cap += frontier * kids;
    frontier = budget - d;
  }
  return cap;
}

// Scratch arrays, caller-allocated: C = dynamic_tree_capacity(...), F = max(budget, 1).
struct DynamicTreeWorkspace {
  int64_t* token;      // [C] candidate token
  int32_t* parent;     // [C] candidate index of the parent, -1 for the root
  int32_t* depth;      // [C]
  double* prob;        // [C] cumulative probability of the path
  int32_t* rank;       // [C]
  int32_t* order;      // [C] order[rank] = candidate
  int32_t* new_index;  // [C] output index of a kept candidate
  uint8_t* flag;       // [C] picked for expansion (step 1), then kept (step 3)
  int32_t* frontier;   // [F] the nodes expanded at the current depth, in rank order
  int32_t* offset;     // [F] children per frontier node, then their exclusive prefix sum
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
  w.rank = reinterpret_cast<int32_t*>(p), p += c * sizeof(int32_t);
  w.order = reinterpret_cast<int32_t*>(p), p += c * sizeof(int32_t);
  w.new_index = reinterpret_cast<int32_t*>(p), p += c * sizeof(int32_t);
  w.frontier = reinterpret_cast<int32_t*>(p), p += f * sizeof(int32_t);
  w.offset = reinterpret_cast<int32_t*>(p), p += f * sizeof(int32_t);
  w.counts = reinterpret_cast<int32_t*>(p), p += 3 * sizeof(int32_t);
  w.flag = reinterpret_cast<uint8_t*>(p);
  return w;
}

// Candidate a ranks before candidate b.
MTPROBE_HD inline bool ranks_before(const DynamicTreeWorkspace& w, int64_t a, int64_t b) {
  if (w.prob[a] != w.prob[b]) return w.prob[a] > w.prob[b];
  if (w.depth[a] != w.depth[b]) return w.depth[a] < w.depth[b];
  return a < b;
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
  if (ex.leader()) {
    w.token[0] = root_token, w.parent[0] = -1, w.depth[0] = 0, w.prob[0] = 1.0, w.flag[0] = 1;
    w.frontier[0] = 0;
    w.counts[0] = 1;  // candidates
    w.counts[1] = 1;  // frontier size
  }
  ex.sync();

  // 1. Expand depth by depth.
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
        w.prob[at] = w.prob[node] * static_cast<double>(pr[r]), w.flag[at] = 0;
        ++at, ++kids;
      }
    }
    ex.sync();
    if (d == depths) break;
    // Pick the best `count` candidates not picked before (Alg. 1: C <- C \ N); the depth-d ones
    // among them are expanded next, in rank order.
    const int64_t n = w.counts[0];
    for (int64_t i = ex.first() + 1; i < n; i += ex.stride()) {
      if (w.flag[i]) continue;
      int32_t r = 0;
      for (int64_t j = 1; j < n; ++j) r += !w.flag[j] && ranks_before(w, j, i);
      w.rank[i] = r;
    }
    ex.sync();
    for (int64_t i = ex.first() + 1; i < n; i += ex.stride()) {
      if (!w.flag[i] && w.rank[i] < count) w.order[w.rank[i]] = static_cast<int32_t>(i);
    }
    ex.sync();
    if (ex.leader()) {
      int64_t open = 0;
      for (int64_t i = 1; i < n; ++i) open += !w.flag[i];
      const int64_t picks = open < count ? open : count;
      int32_t nf_next = 0;
      for (int64_t r = 0; r < picks; ++r) {
        const int32_t i = w.order[r];
        w.flag[i] = 1;
        if (w.depth[i] == d) w.frontier[nf_next++] = i;
      }
      w.counts[1] = nf_next;
    }
    ex.sync();
  }

  // 2. Rank every candidate.
  const int64_t n = w.counts[0];
  for (int64_t i = ex.first() + 1; i < n; i += ex.stride()) {
    int32_t r = 0;
    for (int64_t j = 1; j < n; ++j) r += ranks_before(w, j, i);
    w.rank[i] = r;
    w.order[r] = static_cast<int32_t>(i);
  }
  ex.sync();

  // 3. Keep the best budget - 1 whose parent is kept (a parent always ranks first, so the check
  // only guards that), then lay them out by depth, then rank.
  if (ex.leader()) {
    for (int64_t i = 0; i < n; ++i) w.flag[i] = i == 0;
    int64_t kept = 0;
    for (int64_t r = 0; r < n - 1 && kept < budget - 1; ++r) {
      const int32_t i = w.order[r];
      if (!w.flag[w.parent[i]]) continue;
      w.flag[i] = 1;
      ++kept;
    }
    w.counts[2] = static_cast<int32_t>(1 + kept);
    w.new_index[0] = 0;
  }
  ex.sync();
  for (int64_t i = ex.first() + 1; i < n; i += ex.stride()) {
    if (!w.flag[i]) continue;
    int32_t at = 1;
    for (int64_t j = 1; j < n; ++j) {
      at += w.flag[j] && (w.depth[j] < w.depth[i] || (w.depth[j] == w.depth[i] && w.rank[j] < w.rank[i]));
    }
    w.new_index[i] = at;
  }
  ex.sync();
  const int64_t num_nodes = w.counts[2];
  for (int64_t i = ex.first(); i < n; i += ex.stride()) {
    if (!w.flag[i]) continue;
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
