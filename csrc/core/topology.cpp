#include "core/topology.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <string>

namespace mtprobe::core {

namespace {

std::string path_text(const std::vector<int64_t>& p) {
  std::string s = "(";
  for (size_t i = 0; i < p.size(); ++i) s += (i ? ", " : "") + std::to_string(p[i]);
  return s + (p.size() == 1 ? ",)" : ")");
}

}  // namespace

Topology compile_topology(std::vector<std::vector<int64_t>> paths) {
  for (const auto& p : paths) {
    if (p.empty())
      throw std::invalid_argument("topology: a node's rank path must not be empty (the root is implicit)");
    for (int64_t r : p) {
      if (r < 0)
        throw std::invalid_argument("topology: rank " + std::to_string(r) + " in path " + path_text(p) +
                                    " is negative; ranks start at 0 (the best candidate)");
    }
  }
  std::stable_sort(paths.begin(), paths.end(), [](const auto& a, const auto& b) {
    return a.size() != b.size() ? a.size() < b.size() : a < b;
  });
  Topology t;
  t.parents = {-1};
  t.depths = {0};
  t.ranks = {-1};
  t.children = {{}};
  std::map<std::vector<int64_t>, int64_t> index;  // path -> node
  for (const auto& p : paths) {
    if (index.count(p)) throw std::invalid_argument("topology: path " + path_text(p) + " appears twice");
    int64_t parent = 0;
    if (p.size() > 1) {
      auto it = index.find(std::vector<int64_t>(p.begin(), p.end() - 1));
      if (it == index.end()) {
        throw std::invalid_argument("topology: path " + path_text(p) + " has no parent node " +
                                    path_text(std::vector<int64_t>(p.begin(), p.end() - 1)) +
                                    "; every prefix of a path must be a node too");
      }
      parent = it->second;
    }
    const auto node = static_cast<int64_t>(t.parents.size());
    index[p] = node;
    t.paths.push_back(p);
    t.parents.push_back(parent);
    t.depths.push_back(static_cast<int64_t>(p.size()));
    t.ranks.push_back(p.back());
    t.children.emplace_back();
    t.children[static_cast<size_t>(parent)].push_back(node);  // paths sorted: ascending rank
    t.max_depth = std::max<int64_t>(t.max_depth, static_cast<int64_t>(p.size()));
    t.max_rank = std::max(t.max_rank, p.back());
  }
  return t;
}

bool fill_topology(const Topology& t, int64_t root_token, const int64_t* cand_tokens, const float* cand_probs,
                   int64_t depths, int64_t m, bool prune, int64_t* out_tokens, double* out_probs) {
  if (t.max_depth > depths) return false;
  out_tokens[0] = root_token;
  out_probs[0] = 1.0;
  // Parents come before children: walk the nodes in order, placing each parent's children by rank.
  for (int64_t node = 0; node < t.num_nodes(); ++node) {
    const auto& kids = t.children[static_cast<size_t>(node)];
    if (kids.empty()) continue;
    const int64_t d = t.depths[static_cast<size_t>(node)] + 1;
    const int64_t* tok = cand_tokens + (d - 1) * m;
    const float* prob = cand_probs + (d - 1) * m;
    const int64_t parent_token = out_tokens[node];
    size_t next = 0;  // the next child (ascending rank) still to place
    int64_t rank = 0;
    for (int64_t r = 0; r < m && next < kids.size(); ++r) {
      if (prune && (tok[r] == parent_token || tok[r] == root_token)) continue;
      const int64_t child = kids[next];
      if (t.ranks[static_cast<size_t>(child)] == rank) {
        out_tokens[child] = tok[r];
        out_probs[child] = out_probs[node] * static_cast<double>(prob[r]);
        ++next;
      }
      ++rank;
    }
    if (next < kids.size()) return false;  // candidates ran out
  }
  return true;
}

int64_t accepted_depth(const Topology& t, const int64_t* true_ranks, int64_t depths) {
  int64_t node = 0, d = 0;
  while (d < depths) {
    const int64_t want = true_ranks[d];
    if (want < 0) break;
    int64_t next = -1;
    for (int64_t c : t.children[static_cast<size_t>(node)]) {
      if (t.ranks[static_cast<size_t>(c)] == want) next = c;
    }
    if (next < 0) break;
    node = next;
    ++d;
  }
  return d;
}

void TopologyPolicy::validate(int64_t bank_size) const {
  if (bank_size < 1)
    throw std::invalid_argument("topology bank is empty: a policy needs at least one topology");
  const auto n = static_cast<int64_t>(trees.size());
  for (int64_t id : trees) {
    if (id < 0 || id >= bank_size) {
      throw std::invalid_argument("topology id " + std::to_string(id) + " is outside the bank [0, " +
                                  std::to_string(bank_size) + ")");
    }
  }
  for (double h : thresholds) {
    if (!std::isfinite(h)) throw std::invalid_argument("policy thresholds must be finite numbers");
  }
  switch (kind) {
    case TopologyPolicyKind::kStatic:
      if (n != 1 || !thresholds.empty())
        throw std::invalid_argument("the static policy takes one topology and no thresholds, got " +
                                    std::to_string(n) + " topologies and " +
                                    std::to_string(thresholds.size()) + " thresholds");
      break;
    case TopologyPolicyKind::kLadder:
      if (n < 1 || static_cast<int64_t>(thresholds.size()) != n - 1)
        throw std::invalid_argument("the ladder policy takes n >= 1 topologies and n - 1 thresholds, got " +
                                    std::to_string(n) + " and " + std::to_string(thresholds.size()));
      if (!std::is_sorted(thresholds.begin(), thresholds.end()))
        throw std::invalid_argument("the ladder's thresholds must be ascending (one per step up the ladder)");
      break;
    case TopologyPolicyKind::kHysteretic:
      if (n != 2 || thresholds.size() != 2)
        throw std::invalid_argument(
            "the hysteretic policy takes two topologies (conservative, aggressive) and two thresholds "
            "(down, up), got " +
            std::to_string(n) + " and " + std::to_string(thresholds.size()));
      if (thresholds[0] > thresholds[1])
        throw std::invalid_argument("hysteretic thresholds: switch-down " + std::to_string(thresholds[0]) +
                                    " is above switch-up " + std::to_string(thresholds[1]) +
                                    "; down must be <= up, or the policy flips every step");
      break;
  }
}

int64_t TopologyPolicy::choose(double score, int64_t current) const {
  switch (kind) {
    case TopologyPolicyKind::kStatic:
      return trees[0];
    case TopologyPolicyKind::kLadder: {
      size_t i = 0;
      while (i < thresholds.size() && score >= thresholds[i]) ++i;
      return trees[i];
    }
    case TopologyPolicyKind::kHysteretic:
      if (current == trees[1]) return score < thresholds[0] ? trees[0] : trees[1];
      return score > thresholds[1] ? trees[1] : trees[0];
  }
  return trees[0];
}

void TopologyFeatures::update(double top1_now, double path_value_now, double entropy, double accepted,
                              double ema) {
  const double a = seen ? ema : 1.0;
  seen = true;
  top1 = top1_now;
  path_value = path_value_now;
  entropy_ema = a * entropy + (1.0 - a) * entropy_ema;
  accept_ema = a * accepted + (1.0 - a) * accept_ema;
}

double TopologyFeatures::score(const std::string& feature) const {
  if (feature == "path_value") return path_value;
  if (feature == "top1") return top1;
  if (feature == "entropy") return std::exp(-entropy_ema);
  if (feature == "accept") return accept_ema;
  throw std::invalid_argument("unknown policy feature '" + feature +
                              "' (path_value, top1, entropy or accept)");
}

bool is_topology_feature(const std::string& feature) {
  return feature == "path_value" || feature == "top1" || feature == "entropy" || feature == "accept";
}

void check_bank_policy(int64_t bank_size, const TopologyPolicy& policy, const std::string& feature,
                       double ema) {
  policy.validate(bank_size);
  if (!is_topology_feature(feature))
    throw std::invalid_argument("unknown policy feature '" + feature +
                                "' (path_value, top1, entropy or accept)");
  // Negated so that NaN fails too.
  if (!(ema > 0.0 && ema <= 1.0))
    throw std::invalid_argument("ema must be in (0, 1], got " + std::to_string(ema));
}

}  // namespace mtprobe::core
