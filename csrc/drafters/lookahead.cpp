#include "drafters/lookahead.h"

#include <algorithm>

namespace mtprobe {

LookaheadDrafter::LookaheadDrafter(LookaheadOptions options)
    : options_(options),
      pool_(std::max<int64_t>(options.ngram_size, 2), std::max<int64_t>(options.guess_set_size, 1)),
      window_(std::max<int64_t>(options.ngram_size, 2), std::max<int64_t>(options.window, 1)) {
  TORCH_CHECK_VALUE(options_.ngram_size >= 2, "lookahead: ngram_size (L) must be >= 2, got ",
                    options_.ngram_size);
  TORCH_CHECK_VALUE(options_.window >= 1, "lookahead: window (W) must be >= 1, got ", options_.window);
  TORCH_CHECK_VALUE(options_.guess_set_size >= 1, "lookahead: guess_set_size (G) must be >= 1, got ",
                    options_.guess_set_size);
}

void LookaheadDrafter::pool_text_ngram() {
  const int64_t L = options_.ngram_size, n = static_cast<int64_t>(history_.size());
  if (n >= L) pool_.add(history_.data() + n - L);
}

void LookaheadDrafter::begin(const at::Tensor& prompt) {
  at::Tensor p = prompt.to(at::kCPU, at::kLong).contiguous();
  const int64_t* tok = p.data_ptr<int64_t>();
  const int64_t len = p.numel();
  pool_ = core::LookaheadPool(options_.ngram_size, options_.guess_set_size);
  window_.reset(tok, len);
  history_.clear();
  if (options_.pool_from_prompt) {
    for (int64_t i = 0; i < len; ++i) {
      history_.push_back(tok[i]);
      pool_text_ngram();
    }
  }
  root_ = -1;
  window_offset_ = -1;
  prefill_ = true;
}

DraftBlock LookaheadDrafter::propose(const at::Tensor& committed, int64_t prefix_len,
                                     const StepLimits& limits) {
  (void)prefix_len;
  const int64_t c = committed.size(0);
  window_offset_ = -1;
  if (prefill_) return token_block(committed, {}, {});  // the prompt alone: the window starts after it
  TORCH_CHECK_VALUE(limits.budget >= block_complexity(), "lookahead with L=", options_.ngram_size,
                    ", W=", options_.window, ", G=", options_.guess_set_size,
                    " feeds up to (L - 1)(W + G) = ", block_complexity(),
                    " inputs per step, over the block complexity ", limits.budget,
                    "; use block_complexity >= ", block_complexity(), " or a smaller L, W or G");
  // The root is the bonus token of the last step; observe() recorded it (no device read here).
  const int64_t L = options_.ngram_size, G = options_.guess_set_size;
  TORCH_CHECK(c == 1 && root_ >= 0, "lookahead: a decode step must commit one token (the last bonus), got ",
              c);

  // 1. Guesses: the pool's continuations of the root, merged into a tree, cut to the tokens still
  //    wanted and to the context.
  std::vector<int64_t> guesses(static_cast<size_t>(G * (L - 1)));
  const int64_t count = pool_.lookup(root_, guesses.data());
  const int64_t depth = std::min({L - 1, limits.tokens_left - 1, limits.max_depth});
  std::vector<int64_t> tokens(guesses.size()), parents(guesses.size());
  const int64_t n =
      depth >= 1 ? core::build_guess_tree(guesses.data(), count, L - 1, depth, tokens.data(), parents.data())
                 : 0;
  tokens.resize(static_cast<size_t>(n));
  parents.resize(static_cast<size_t>(n));

  // 2. The window after the guesses (auxiliary inputs), unless its deepest cell would pass the
  //    model's last position.
  if (window_.max_depth() <= limits.max_depth) {
    const int64_t m = window_.num_cells();
    std::vector<int64_t> cells(static_cast<size_t>(m)), cell_parents(static_cast<size_t>(m));
    window_.layout(cells.data(), cell_parents.data());
    for (int64_t i = 0; i < m; ++i) {
      tokens.push_back(cells[i]);
      parents.push_back(cell_parents[i] < 0 ? -1 : n + cell_parents[i]);
    }
    window_offset_ = 1 + n;  // block index of the first cell (the root is input 0)
  }
  return token_block(committed, tokens, parents, n);
}

void LookaheadDrafter::observe(const StepOutcome& outcome) {
  prefill_ = false;
  if (window_offset_ >= 0 && !outcome.block_replaced) {
    // One Jacobi iteration (skipped when the block was replaced: the window did not run): the target's argmax
    // at every cell of the last level.
    const int64_t W = options_.window, last = options_.ngram_size - 2;
    std::vector<int64_t> rows(static_cast<size_t>(W));
    for (int64_t j = 0; j < W; ++j) {
      const int64_t i = window_.cell_index(last, j);
      rows[j] = i < 0 ? 0 : window_offset_ + i;  // cell (0, 0) is the root, input 0
    }
    at::Tensor idx = at::tensor(rows, at::kLong).to(outcome.logits.device());
    at::Tensor next = outcome.logits.index_select(0, idx).argmax(-1).to(at::kCPU).contiguous();  // [W]
    window_.update(root_, next.data_ptr<int64_t>(), pool_);
  }
  if (options_.pool_from_prompt) {
    for (int64_t t : outcome.new_tokens) {
      history_.push_back(t);
      pool_text_ngram();
    }
  }
  if (!outcome.new_tokens.empty()) root_ = outcome.new_tokens.back();
}

}  // namespace mtprobe
