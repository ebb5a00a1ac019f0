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

double CostTable::relative(double block_size, double context) const {
  return time(block_size, context) / time(1, context);
}

AcceptanceStats::AcceptanceStats(double decay) : decay_(decay) {
  if (!(decay > 0 && decay <= 1))
    throw std::invalid_argument("acceptance statistics: decay must lie in (0, 1]");
}

void AcceptanceStats::record(int64_t tree_depth, int64_t reached, int64_t known) {
  for (double& t : trials_) t *= decay_;
  for (double& a : accepts_) a *= decay_;
  const int64_t tested = std::min(tree_depth, std::min(reached + 1, known));  // deepest depth with a verdict
  if (tested > static_cast<int64_t>(trials_.size())) {
    trials_.resize(static_cast<size_t>(tested), 0.0);
    accepts_.resize(static_cast<size_t>(tested), 0.0);
  }
  for (int64_t d = 1; d <= tested; ++d) {
    trials_[d - 1] += 1.0;
    if (d <= reached) accepts_[d - 1] += 1.0;
  }
}

double AcceptanceStats::rate(int64_t depth) const {
  const size_t i = static_cast<size_t>(depth - 1);
  if (depth < 1 || i >= trials_.size()) return 0.5;
  return (accepts_[i] + 1.0) / (trials_[i] + 2.0);
}

std::vector<double> AcceptanceStats::reach(int64_t max_depth) const {
  std::vector<double> out(static_cast<size_t>(std::max<int64_t>(0, max_depth)));
  double p = 1.0;
  for (int64_t d = 1; d <= max_depth; ++d) out[d - 1] = p *= rate(d);
  return out;
}

Cut best_cut(const AcceptanceStats& stats, const CostTable& cost, int64_t committed,
             const std::vector<int64_t>& nodes_per_depth, int64_t extra, bool cuttable, double context) {
  const int64_t D = static_cast<int64_t>(nodes_per_depth.size());
  Cut best;
  best.inputs = committed;
  best.score = 1.0 / cost.relative(static_cast<double>(committed), context);
  best.expected = 1.0;
  const std::vector<double> reach = stats.reach(D);
  double expected = 1.0;
  int64_t inputs = committed;
  for (int64_t n = 1; n <= D; ++n) {
    expected += reach[n - 1];
    inputs += nodes_per_depth[n - 1];
    if (n < D && (!cuttable || extra > 0)) continue;  // whole or nothing
    const int64_t T = inputs + (n == D ? extra : 0);
    const double score = expected / cost.relative(static_cast<double>(T), context);
    if (score > best.score) best = Cut{n, T, expected, score};
  }
  return best;
}

}  // namespace mtprobe::core
