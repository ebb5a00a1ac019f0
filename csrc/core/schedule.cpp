#include "core/schedule.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <utility>

namespace mtprobe::core {

CostTable::CostTable(std::vector<int64_t> block_sizes, std::vector<int64_t> contexts,
                     std::vector<double> seconds)
    : block_sizes_(std::move(block_sizes)), contexts_(std::move(contexts)), seconds_(std::move(seconds)) {
  const size_t B = block_sizes_.size(), C = contexts_.size();
  if (B == 0 || block_sizes_[0] != 1)
    throw std::invalid_argument("cost table: block sizes must start at 1 (plain decoding)");
  for (size_t j = 1; j < B; ++j)
    if (block_sizes_[j] <= block_sizes_[j - 1])
      throw std::invalid_argument("cost table: block sizes must ascend strictly");
  if (C == 0 || contexts_[0] < 0) throw std::invalid_argument("cost table: contexts must be non-empty, >= 0");
  for (size_t i = 1; i < C; ++i)
    if (contexts_[i] <= contexts_[i - 1])
      throw std::invalid_argument("cost table: contexts must ascend strictly");
  if (seconds_.size() != B * C)
    throw std::invalid_argument(
        "cost table: seconds must hold contexts x block sizes = " + std::to_string(C) + " x " +
        std::to_string(B) + " values, got " + std::to_string(seconds_.size()));
  for (double s : seconds_)
    if (!(std::isfinite(s) && s > 0))
      throw std::invalid_argument("cost table: every time must be a positive finite number of seconds, got " +
                                  std::to_string(s));
}

double CostTable::row(std::size_t i, double block_size) const {
  const size_t B = block_sizes_.size();
  const double* s = seconds_.data() + i * B;
  if (B == 1) return s[0] * block_size;
  size_t j = B - 1;
  for (size_t k = 0; k < B; ++k) {
    if (static_cast<double>(block_sizes_[k]) >= block_size) {
      j = k;
      break;
    }
  }
  j = std::min(std::max<size_t>(1, j), B - 1);
  const double x0 = static_cast<double>(block_sizes_[j - 1]), x1 = static_cast<double>(block_sizes_[j]);
  const double v = s[j - 1] + (s[j] - s[j - 1]) * (block_size - x0) / (x1 - x0);
  // Extrapolating a decreasing segment must not reach zero: a forward is never free.
  return std::max(v, *std::min_element(s, s + B) * 0.5);
}

double CostTable::time(double block_size, double context) const {
  if (empty()) throw std::logic_error("cost table: empty");
  if (!(block_size >= 1)) throw std::invalid_argument("cost table: block size must be >= 1");
  const size_t C = contexts_.size();
  if (C == 1 || context <= static_cast<double>(contexts_[0])) return row(0, block_size);
  if (context >= static_cast<double>(contexts_[C - 1])) return row(C - 1, block_size);
  size_t i = 1;
  while (static_cast<double>(contexts_[i]) < context) ++i;
  const double c0 = static_cast<double>(contexts_[i - 1]), c1 = static_cast<double>(contexts_[i]);
  const double w = (context - c0) / (c1 - c0);
  return (1 - w) * row(i - 1, block_size) + w * row(i, block_size);
}

double CostTable::relative(double block_size, double context, double overhead) const {
  return (time(block_size, context) + overhead) / (time(1, context) + overhead);
}

AcceptanceStats::AcceptanceStats(double decay) : decay_(decay) {
  if (!(decay > 0 && decay <= 1))
    throw std::invalid_argument("acceptance statistics: decay must lie in (0, 1]");
}

AcceptanceStats::AcceptanceStats(double decay, std::vector<std::vector<double>> trials,
                                 std::vector<std::vector<double>> accepts)
    : AcceptanceStats(decay) {
  if (trials.size() != accepts.size())
    throw std::invalid_argument("acceptance statistics: trials has " + std::to_string(trials.size()) +
                                " depths, accepts " + std::to_string(accepts.size()));
  for (size_t d = 0; d < trials.size(); ++d) {
    if (trials[d].size() != static_cast<size_t>(kRanks) || accepts[d].size() != static_cast<size_t>(kRanks))
      throw std::invalid_argument("acceptance statistics: depth " + std::to_string(d + 1) + " needs " +
                                  std::to_string(kRanks) + " ranks of trials and of accepts");
    for (int64_t r = 0; r < kRanks; ++r) {
      const double t = trials[d][static_cast<size_t>(r)], a = accepts[d][static_cast<size_t>(r)];
      if (!(std::isfinite(t) && std::isfinite(a) && a >= 0 && a <= t))
        throw std::invalid_argument("acceptance statistics: depth " + std::to_string(d + 1) + ", rank " +
                                    std::to_string(r) + " has " + std::to_string(a) + " accepts of " +
                                    std::to_string(t) + " trials; counts are finite, 0 <= accepts <= trials");
    }
  }
  trials_ = std::move(trials);
  accepts_ = std::move(accepts);
}

void AcceptanceStats::step() {
  for (auto& row : trials_)
    for (double& t : row) t *= decay_;
  for (auto& row : accepts_)
    for (double& a : row) a *= decay_;
}

void AcceptanceStats::record(int64_t depth, int64_t rank, bool accepted) {
  if (depth < 1 || rank < 0)
    throw std::invalid_argument("acceptance statistics: a verdict needs depth >= 1 and rank >= 0");
  if (depth > static_cast<int64_t>(trials_.size())) {
    trials_.resize(static_cast<size_t>(depth), std::vector<double>(kRanks, 0.0));
    accepts_.resize(static_cast<size_t>(depth), std::vector<double>(kRanks, 0.0));
  }
  const size_t d = static_cast<size_t>(depth - 1), r = static_cast<size_t>(std::min(rank, kRanks - 1));
  trials_[d][r] += 1.0;
  if (accepted) accepts_[d][r] += 1.0;
}

double AcceptanceStats::rate(int64_t depth, int64_t rank) const {
  if (depth < 1 || rank < 0)
    throw std::invalid_argument("acceptance statistics: a rate needs depth >= 1 and rank >= 0");
  const int64_t r = std::min(rank, kRanks - 1);
  double mean = 0.5;  // the prior's mean for a first child
  for (int64_t k = 0; k <= r; ++k) {
    const size_t d = static_cast<size_t>(depth - 1);
    const bool seen = d < trials_.size();
    const double t = seen ? trials_[d][static_cast<size_t>(k)] : 0.0;
    const double a = seen ? accepts_[d][static_cast<size_t>(k)] : 0.0;
    const double rate_k = (a + 2.0 * mean) / (t + 2.0);
    if (k == r) return rate_k;
    mean = rate_k / 2;  // a later sibling: at most half its elder's rate, a priori
  }
  return mean;  // unreachable
}

Cut best_cut(const AcceptanceStats& stats, const CostTable& cost, int64_t committed,
             const std::vector<int64_t>& parents, int64_t extra, bool cuttable, double context,
             double overhead) {
  if (committed < 1)
    throw std::invalid_argument("best_cut: committed = " + std::to_string(committed) +
                                "; a block holds at least the last committed token (committed >= 1)");
  if (extra < 0)
    throw std::invalid_argument("best_cut: extra = " + std::to_string(extra) +
                                "; auxiliary inputs are counted from 0 (extra >= 0)");
  if (!std::isfinite(context) || context < 0)
    throw std::invalid_argument("best_cut: context must be a finite number of cached positions >= 0");
  if (!std::isfinite(overhead) || overhead < 0)
    throw std::invalid_argument("best_cut: overhead must be a finite number of seconds >= 0");
  const size_t n_nodes = parents.size();
  std::vector<int64_t> depth(n_nodes), children(n_nodes + 1, 0);  // children[k + 1]: of node k; [0]: root
  std::vector<double> left(n_nodes + 1, 1.0);  // left[k + 1]: P(no earlier child of k accepted | k was)
  std::vector<double> reach(n_nodes);          // P(node accepted)
  for (size_t k = 0; k < n_nodes; ++k) {
    const int64_t parent = parents[k];
    if (parent < -1 || parent >= static_cast<int64_t>(k))
      throw std::invalid_argument("best_cut: node " + std::to_string(k) + " has parent " +
                                  std::to_string(parent) + "; parents must be -1 or an earlier node");
    depth[k] = parent < 0 ? 1 : depth[static_cast<size_t>(parent)] + 1;
    const int64_t rank = children[static_cast<size_t>(parent + 1)]++;
    // Siblings exclude each other: their conditional rates never sum past 1 (a prior could).
    double& rest = left[static_cast<size_t>(parent + 1)];
    const double a = std::min(stats.rate(depth[k], rank), rest);
    rest -= a;
    reach[k] = (parent < 0 ? 1.0 : reach[static_cast<size_t>(parent)]) * a;
  }
  Cut best;
  best.inputs = committed;
  best.score = 1.0 / cost.relative(static_cast<double>(committed), context, overhead);
  const auto score_of = [&](double expected, int64_t inputs) {
    return expected / cost.relative(static_cast<double>(inputs), context, overhead);
  };
  if (n_nodes == 0) return best;
  if (!cuttable || extra > 0) {  // whole or nothing
    double expected = 1.0;
    for (double r : reach) expected += r;
    const int64_t T = committed + static_cast<int64_t>(n_nodes) + extra;
    const double score = score_of(expected, T);
    if (score > best.score) {
      best = Cut{static_cast<int64_t>(n_nodes), T, expected, score, {}};
      for (size_t k = 0; k < n_nodes; ++k) best.kept.push_back(static_cast<int64_t>(k));
    }
    return best;
  }
  // Most probable first; a stable sort keeps a parent before a child of equal P.
  std::vector<int64_t> order(n_nodes);
  for (size_t k = 0; k < n_nodes; ++k) order[k] = static_cast<int64_t>(k);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    return reach[static_cast<size_t>(x)] > reach[static_cast<size_t>(y)];
  });
  double expected = 1.0;
  size_t best_k = 0;
  for (size_t k = 1; k <= n_nodes; ++k) {
    expected += reach[static_cast<size_t>(order[k - 1])];
    const int64_t T = committed + static_cast<int64_t>(k);
    const double score = score_of(expected, T);
    if (score > best.score) {
      best = Cut{static_cast<int64_t>(k), T, expected, score, {}};
      best_k = k;
    }
  }
  best.kept.assign(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(best_k));
  std::sort(best.kept.begin(), best.kept.end());
  return best;
}

ChainForecast forecast_chain(const AcceptanceStats& stats, const CostTable& cost, double draft_seconds,
                             int64_t max_drafts, double context, double overhead) {
  if (!std::isfinite(draft_seconds) || draft_seconds < 0)
    throw std::invalid_argument("forecast_chain: draft_seconds must be a finite number of seconds >= 0");
  if (!std::isfinite(context) || context < 0)
    throw std::invalid_argument("forecast_chain: context must be a finite number of cached positions >= 0");
  if (!std::isfinite(overhead) || overhead < 0)
    throw std::invalid_argument("forecast_chain: overhead must be a finite number of seconds >= 0");
  double trials = 0.0, accepts = 0.0;
  for (size_t d = 0; d < stats.trials().size(); ++d) {
    trials += stats.trials()[d][0];
    accepts += stats.accepts()[d][0];
  }
  ChainForecast best;
  best.rate = (accepts + 1.0) / (trials + 2.0);
  const double plain = cost.time(1, context) + overhead;
  double expected = 1.0, reach = 1.0;
  for (int64_t k = 1; k <= max_drafts; ++k) {
    reach *= best.rate;
    expected += reach;
    const double seconds =
        cost.time(static_cast<double>(1 + k), context) + overhead + static_cast<double>(k) * draft_seconds;
    const double score = expected / (seconds / plain);
    if (score > best.score) {
      best.drafts = k;
      best.expected = expected;
      best.score = score;
    }
  }
  return best;
}

MarginStats::MarginStats(double stop_below) : stop_below_(stop_below) {
  if (!(stop_below > 0 && stop_below <= 1))
    throw std::invalid_argument("margin statistics: stop_below must lie in (0, 1], got " +
                                std::to_string(stop_below));
}

int64_t MarginStats::class_of(double margin) {
  if (!std::isfinite(margin) || margin < 0)
    throw std::invalid_argument("margin statistics: a top-2 logit margin is finite and >= 0, got " +
                                std::to_string(margin));
  return static_cast<int64_t>(std::upper_bound(kEdges.begin(), kEdges.end(), margin) - kEdges.begin());
}

double MarginStats::rate_locked(int64_t c) const {
  const auto i = static_cast<size_t>(c);
  return (matches_[i] + 1.9) / (trials_[i] + 2.0);
}

double MarginStats::rate(double margin) const {
  const int64_t c = class_of(margin);
  std::lock_guard<std::mutex> lock(mutex_);
  return rate_locked(c);
}

void MarginStats::record(double margin, bool matched) {
  const auto i = static_cast<size_t>(class_of(margin));
  std::lock_guard<std::mutex> lock(mutex_);
  trials_[i] += 1.0;
  if (matched) matches_[i] += 1.0;
}

bool MarginStats::stops(double margin) const { return rate(margin) < stop_below_; }

std::vector<double> MarginStats::trials() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {trials_.begin(), trials_.end()};
}

std::vector<double> MarginStats::matches() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {matches_.begin(), matches_.end()};
}

}  // namespace mtprobe::core
