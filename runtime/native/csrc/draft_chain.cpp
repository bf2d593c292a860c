// A draft model's greedy steps for every sequence of a round in one call (DraftChain,
// kernels.h): embed, the LayerStack, the head and its argmax, k times, with no Python
// between the steps. Each step makes the calls a Python step makes (the stack's one call,
// the head's product, the first of the largest logits), so its tokens are the Python
// loop's.

#include "common.h"
#include "kernels.h"

namespace specserve {

namespace {

ChainMatrix chain_matrix(at::Tensor packed, int64_t kind, int64_t out, int64_t in,
                         const c10::optional<at::Tensor>& bias, at::ScalarType dtype,
                         const char* name) {
  TORCH_CHECK(packed.is_contiguous() && out > 0 && in > 0, name, ": a contiguous matrix");
  if (kind == 4 || kind == 8) {
    const int64_t tiles = (out + kTile - 1) / kTile;
    TORCH_CHECK(in % kBlock == 0 && packed.scalar_type() == at::kByte &&
                    packed.numel() == tiles * (in / kBlock) * block_bytes(kind),
                name, " is not a ", kind, "-bit block matrix of [", out, ", ", in, "]");
  } else {
    TORCH_CHECK(kind == (dtype == at::kFloat ? kDenseF32 : kDenseBf16), name, ": kind ", kind,
                " (4, 8, or dense in the model's dtype)");
    const int64_t groups = (out + kDenseRows - 1) / kDenseRows;
    TORCH_CHECK(packed.scalar_type() == dtype && packed.numel() == groups * in * kDenseRows,
                name, " is not a dense matrix of [", out, ", ", in, "] in the model's dtype");
  }
  ChainMatrix m{std::move(packed), kind, out, in, at::Tensor()};
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out, name, "'s bias must be [", out, "]");
    m.bias32 = bias->to(at::kFloat).contiguous();
  }
  return m;
}

// x [tokens, m.in] (contiguous, dtype T) times m: [tokens, m.out] in T
template <typename T>
at::Tensor multiply(const ChainMatrix& m, const at::Tensor& x) {
  const int64_t tokens = x.size(0);
  at::Tensor y = at::empty({tokens, m.out}, x.options());
  const float* bias = m.bias32.defined() ? m.bias32.data_ptr<float>() : nullptr;
  if (m.kind == 4 || m.kind == 8)
    block_product_rows<T>(x.data_ptr<T>(), tokens, m.in, m.packed.data_ptr<uint8_t>(), m.out,
                          m.kind, bias, y.data_ptr<T>());
  else
    dense_product_rows<T, T, T>(x.data_ptr<T>(), tokens, m.in, m.packed.data_ptr<T>(), m.out,
                                bias, y.data_ptr<T>());
  return y;
}

at::Tensor product(const ChainMatrix& m, const at::Tensor& x) {
  if (x.scalar_type() == at::kFloat) return multiply<float>(m, x);
  return multiply<c10::BFloat16>(m, x);
}

}  // namespace

DraftChain::DraftChain(const LayerStack& stack, at::Tensor embedding, int64_t embedding_kind,
                       at::Tensor head, int64_t head_kind, int64_t head_out,
                       c10::optional<at::Tensor> head_bias, c10::optional<at::Tensor> head_ids,
                       int64_t vocab, c10::optional<at::Tensor> head_norm, double head_eps,
                       c10::optional<at::Tensor> fuse, int64_t fuse_kind, int64_t fuse_in,
                       c10::optional<at::Tensor> fuse_bias)
    : stack_(stack), embedding_(std::move(embedding)), embedding_kind_(embedding_kind),
      vocab_(vocab), head_eps_(head_eps) {
  TORCH_CHECK(stack_.native(), "a draft chain runs a stack of native matrices");
  const at::ScalarType dtype = stack_.dtype();
  const int64_t hidden = stack_.hidden();
  TORCH_CHECK(embedding_.is_contiguous() && embedding_.dim() >= 1, "a contiguous embedding");
  if (embedding_kind_ == 0) {
    TORCH_CHECK(embedding_.dim() == 2 &&
                    (embedding_.scalar_type() == at::kFloat || embedding_.scalar_type() == dtype),
                "an embedding table is [vocab, hidden], in float32 or the model's dtype");
  } else {
    TORCH_CHECK((embedding_kind_ == 4 || embedding_kind_ == 8) &&
                    embedding_.scalar_type() == at::kByte,
                "an embedding is a table (kind 0) or a 4- or 8-bit block matrix");
  }
  // a block head multiplies bfloat16 activations (as runtime.matrices.quantized.BlockMatrix does)
  const at::ScalarType head_dtype = head_kind == 4 || head_kind == 8 ? at::kBFloat16 : dtype;
  head_ = chain_matrix(std::move(head), head_kind, head_out, hidden, head_bias, head_dtype,
                       "the head");
  if (head_ids.has_value() && head_ids->defined()) {
    head_ids_ = head_ids->to(at::kLong).contiguous();
    TORCH_CHECK(head_ids_.numel() == head_out, "one vocabulary id per head row");
  }
  const int64_t* id = head_ids_.defined() ? head_ids_.data_ptr<int64_t>() : nullptr;
  for (int64_t j = 0; j < head_out; ++j)
    if ((id != nullptr ? id[j] : j) < vocab_) valid_.push_back(j);
  TORCH_CHECK(valid_.size() >= 2, "the head must offer at least two tokens below the vocabulary");
  if (head_norm.has_value() && head_norm->defined()) {
    head_norm_ = head_norm->contiguous();
    TORCH_CHECK(head_norm_.numel() == hidden && head_norm_.scalar_type() == dtype,
                "the head's norm weight is [hidden] in the model's dtype");
  }
  if (fuse.has_value() && fuse->defined()) {
    TORCH_CHECK(fuse_in > hidden, "the input fusion takes [embedding | carried hidden]");
    fuse_ = chain_matrix(std::move(*fuse), fuse_kind, hidden, fuse_in, fuse_bias, dtype,
                         "the input fusion");
  }
}

// ids [n] -> their rows [n, hidden] in the model's dtype (a block matrix's rows dequantized
// in float32, then rounded, as runtime.matrices.quantized.BlockEmbedding does)
at::Tensor DraftChain::embed(const at::Tensor& ids) const {
  const int64_t n = ids.numel();
  const int64_t* id = ids.data_ptr<int64_t>();
  if (embedding_kind_ == 0) {
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(id[i] >= 0 && id[i] < embedding_.size(0), "token ", id[i], " is out of range");
    return embedding_.index_select(0, ids).to(stack_.dtype());
  }
  const int64_t hidden = stack_.hidden(), blocks = hidden / kBlock;
  const int64_t rows = embedding_.numel() / (blocks * block_bytes(embedding_kind_)) * kTile;
  at::Tensor out = at::empty({n, hidden}, ids.options().dtype(at::kFloat));
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "token ", id[i], " is out of range");
    block_row(embedding_.data_ptr<uint8_t>(), id[i], blocks, embedding_kind_,
              out.data_ptr<float>() + i * hidden);
  }
  return out.to(stack_.dtype());
}

// hidden [n, H] (the stack's output) -> the head's logits [n, K]
at::Tensor DraftChain::head_logits(const at::Tensor& hidden) const {
  at::Tensor x = hidden;
  if (head_norm_.defined()) {
    x = at::empty_like(hidden);
    if (hidden.scalar_type() == at::kFloat)
      rms_norm_rows<float>(hidden.data_ptr<float>(), nullptr, head_norm_.data_ptr<float>(),
                           nullptr, x.data_ptr<float>(), x.size(0), x.size(1), head_eps_);
    else
      rms_norm_rows<c10::BFloat16>(hidden.data_ptr<c10::BFloat16>(), nullptr,
                                   head_norm_.data_ptr<c10::BFloat16>(), nullptr,
                                   x.data_ptr<c10::BFloat16>(), x.size(0), x.size(1), head_eps_);
  }
  if (head_.kind == 4 || head_.kind == 8) x = x.to(at::kBFloat16);
  return product(head_, x.contiguous());
}

// Row `row` of logits [n, K]: the first of the largest (the lowest vocabulary id among
// ties, as an argmax over the whole vocabulary gives), its probability, and with `second`
// the runner-up and its probability (softmax over the head's tokens below the vocabulary)
void DraftChain::pick(const at::Tensor& logits, int64_t row, bool second, int64_t* token,
                      float* sure, int64_t* runner_up, float* runner_up_sure) const {
  const int64_t width = logits.size(1), n = static_cast<int64_t>(valid_.size());
  const int64_t* id = head_ids_.defined() ? head_ids_.data_ptr<int64_t>() : nullptr;
  std::vector<float> s(static_cast<size_t>(n));
  if (logits.scalar_type() == at::kFloat) {
    const float* p = logits.data_ptr<float>() + row * width;
    for (int64_t j = 0; j < n; ++j) s[j] = p[valid_[j]];
  } else {
    const c10::BFloat16* p = logits.data_ptr<c10::BFloat16>() + row * width;
    for (int64_t j = 0; j < n; ++j) s[j] = load(p, valid_[j]);
  }
  auto vocab_id = [&](int64_t j) { return id != nullptr ? id[valid_[j]] : valid_[j]; };
  auto beats = [&](int64_t a, int64_t b) {  // a before b in the vocabulary's argmax order
    return b < 0 || s[a] > s[b] || (s[a] == s[b] && vocab_id(a) < vocab_id(b));
  };
  int64_t best = -1, next = -1;
  for (int64_t j = 0; j < n; ++j) {
    if (beats(j, best)) {
      next = best;
      best = j;
    } else if (beats(j, next)) {
      next = j;
    }
  }
  const float top = s[best];
  F16 total = zero();
  for (int64_t j = 0; j < n; j += 16) {
    const int64_t m = std::min<int64_t>(16, n - j);
    total = add(total, keep_first(exp(sub(load_first(s.data() + j, m), splat(top))), m));
  }
  const float sum = sum_halves(total);
  *token = vocab_id(best);
  *sure = 1.0f / sum;  // e^0 / sum
  if (second) {
    float e[16];
    store(e, exp(splat(s[next] - top)));
    *runner_up = vocab_id(next);
    *runner_up_sure = e[0] / sum;
  }
}

std::vector<at::Tensor> DraftChain::run(const at::Tensor& ids, const at::Tensor& positions,
                                        const at::Tensor& tables, const at::Tensor& rows,
                                        const at::Tensor& slots,
                                        const at::Tensor& limits, const at::Tensor& extras,
                                        const at::Tensor& last, const at::Tensor& steps,
                                        const at::Tensor& cos, const at::Tensor& sin,
                                        std::vector<at::Tensor> keys,
                                        std::vector<at::Tensor> values,
                                        const c10::optional<at::Tensor>& carried) const {
  const int64_t tokens = ids.numel(), n = last.numel();
  for (const at::Tensor* t : {&ids, &positions, &rows, &slots, &limits, &extras, &last, &steps})
    TORCH_CHECK(t->dim() == 1 && t->scalar_type() == at::kLong && t->is_contiguous(),
                "ids/positions/rows/slots/limits/extras/last/steps must be contiguous int64 [n]");
  for (const at::Tensor* t : {&positions, &rows, &slots, &limits, &extras})
    TORCH_CHECK(t->numel() == tokens, "one position, row, slot, limit and extra a token");
  TORCH_CHECK(steps.numel() == n && n > 0, "one step count a sequence");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.is_contiguous() &&
                  sin.is_contiguous(), "cos/sin must be contiguous [positions, dim] tables");
  const bool fused = fuse_.kind != 0;
  TORCH_CHECK(fused == (carried.has_value() && carried->defined()),
              "carried hidden states go with an input fusion, and only with one");
  const int64_t* at = last.data_ptr<int64_t>();
  const int64_t* k = steps.data_ptr<int64_t>();
  const int64_t* position = positions.data_ptr<int64_t>();
  int64_t most = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(at[i] >= 0 && at[i] < tokens && k[i] >= 1,
                "each sequence's last token lies in the pass and it drafts at least one");
    most = std::max(most, k[i]);
  }
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(position[t] >= 0, "positions are never negative");
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(position[at[i]] + k[i] - 1 < cos.size(0), "the rotary tables stop at ",
                cos.size(0), " positions");
  const int64_t hidden = stack_.hidden();
  at::Tensor out_tokens = at::full({n, most}, -1, ids.options());
  at::Tensor out_sure = at::zeros({n, most}, ids.options().dtype(at::kFloat));
  at::Tensor out_second = at::full({n}, -1, ids.options());
  at::Tensor out_second_sure = at::zeros({n}, ids.options().dtype(at::kFloat));
  at::Tensor out_hidden = at::empty({n, hidden}, cos.options());
  int64_t* token = out_tokens.data_ptr<int64_t>();
  float* sure = out_sure.data_ptr<float>();

  // step 0: the sequences' fed tokens; step s > 0: each active sequence's token s - 1
  at::Tensor step_ids = ids, step_positions = positions, step_rows = rows, step_slots = slots;
  at::Tensor step_limits = limits, step_extras = extras, picked = last;
  at::Tensor carry = fused ? carried->contiguous() : at::Tensor();
  std::vector<int64_t> active(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) active[i] = i;
  for (int64_t s = 0; s < most; ++s) {
    at::Tensor x = embed(step_ids);
    if (fused) {
      TORCH_CHECK(carry.dim() == 2 && carry.size(0) == x.size(0) &&
                      carry.size(1) == fuse_.in - hidden && carry.scalar_type() == x.scalar_type(),
                  "carried hidden states are [tokens, ", fuse_.in - hidden, "] in the model's dtype");
      x = product(fuse_, at::cat({x, carry}, 1));
    }
    at::Tensor h = stack_.forward(x, cos.index_select(0, step_positions),
                                  sin.index_select(0, step_positions), keys, values, tables,
                                  step_rows, step_slots, step_limits, step_extras);
    h = h.index_select(0, picked);  // [active, H]: each sequence's last token's
    at::Tensor logits = head_logits(h);
    const int64_t m = static_cast<int64_t>(active.size());
    std::vector<int64_t> next;
    for (int64_t a = 0; a < m; ++a) {
      const int64_t i = active[a];
      pick(logits, a, s == 0, token + i * most + s, sure + i * most + s,
           out_second.data_ptr<int64_t>() + i, out_second_sure.data_ptr<float>() + i);
      if (s + 1 == k[i]) out_hidden[i].copy_(h[a]);
      if (s + 1 < k[i]) next.push_back(a);
    }
    if (next.empty()) break;
    // the next step: one token a continuing sequence, after the one before it
    const int64_t c = static_cast<int64_t>(next.size());
    at::Tensor table = at::empty({7, c}, ids.options());
    int64_t* q = table.data_ptr<int64_t>();
    const int64_t* prev_pos = step_positions.data_ptr<int64_t>();
    const int64_t* prev_row = step_rows.data_ptr<int64_t>();
    const int64_t* prev_slot = step_slots.data_ptr<int64_t>();
    const int64_t* prev_limit = step_limits.data_ptr<int64_t>();
    const int64_t* prev_at = picked.data_ptr<int64_t>();
    std::vector<int64_t> still(static_cast<size_t>(c));
    for (int64_t j = 0; j < c; ++j) {
      const int64_t a = next[j], i = active[a], t = prev_at[a];
      q[j] = token[i * most + s];
      q[c + j] = prev_pos[t] + 1;
      q[2 * c + j] = prev_row[t];
      q[3 * c + j] = prev_slot[t] + 1;
      q[4 * c + j] = prev_limit[t] + 1;
      q[5 * c + j] = -1;
      q[6 * c + j] = j;
      still[j] = i;
    }
    step_ids = table[0];
    step_positions = table[1];
    step_rows = table[2];
    step_slots = table[3];
    step_limits = table[4];
    step_extras = table[5];
    picked = table[6];
    if (fused)
      carry = h.index_select(0, at::tensor(next, ids.options()));
    active = std::move(still);
  }
  return {out_tokens, out_sure, out_second, out_second_sure, out_hidden};
}

}  // namespace specserve
