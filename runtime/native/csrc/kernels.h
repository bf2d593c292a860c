// The kernels' entry points, by file: each takes checked tensors (the at::Tensor forms,
// bound to Python in bindings.cpp) or checked pointers (the *_rows forms, which the
// layer stack calls for a whole pass without a tensor per call).

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace specserve {

// --- norms_rotary.cpp: RMS norm, rotary embedding with the cache writes, the activation

// (hidden + delta, rms_norm(hidden + delta) * weight); without delta, (hidden, norm).
std::vector<at::Tensor> add_rms_norm(const at::Tensor& hidden, const c10::optional<at::Tensor>& delta,
                                     const at::Tensor& weight, double eps);
template <typename T>
void rms_norm_rows(const T* hidden, const T* delta, const T* weight, T* hidden_out, T* normed,
                   int64_t tokens, int64_t n, double eps);

// The KV cache in blocks: each layer's keys (and values) are one pool [blocks, kv_heads,
// block, dim], and a sequence reads and writes its positions through its row of a block
// table [rows, width] (int64): position p of table row r lies in block tables[r][p / block],
// at row p % block of it. A block holds a power of two of positions.
struct KvPages {
  const int64_t* tables = nullptr;
  int64_t width = 0;    // blocks a table row
  int64_t shift = 0;    // log2 of the positions a block
  int64_t kv_heads = 0, dim = 0;
  // where position p of table row r's key/value head h starts, in elements of the pool
  int64_t at(int64_t r, int64_t h, int64_t p) const {
    const int64_t block = tables[r * width + (p >> shift)];
    return ((block * kv_heads + h) << shift | (p & ((int64_t{1} << shift) - 1))) * dim;
  }
  int64_t positions() const { return width << shift; }  // a table row's reach
};
// The pages of a pool of keys (and values of its shape) read through `tables`; checks the
// shapes, the block size, and that every entry of the tables names a block of the pool.
KvPages kv_pages(const at::Tensor& keys, const at::Tensor& values, const at::Tensor& tables);

// The rotated queries [tokens, heads, dim]; the rotated keys and the values go to the
// pools keys/values at position slots[t] of table row rows[t] (KvPages).
at::Tensor rope_store(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                      at::Tensor& keys, at::Tensor& values, const at::Tensor& tables,
                      const at::Tensor& rows, const at::Tensor& slots, int64_t heads,
                      int64_t kv_heads);
template <typename T>
void rope_store_rows(const T* qkv, const T* cos, const T* sin, T* keys, T* values, T* q_out,
                     const KvPages& pages, const int64_t* rows, const int64_t* slots,
                     int64_t tokens, int64_t heads);

// silu(gate) * up of a fused [tokens, 2n] gate/up product: [tokens, n].
at::Tensor silu_mul(const at::Tensor& gate_up);
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t tokens, int64_t n);

// --- attention.cpp

// q [tokens, heads, dim] against the pools keys/values: token t sees positions
// [0, limits[t]) of table row rows[t] (KvPages), and the one at extras[t] when that is >=
// its limit (an alternative's own key). Returns [tokens, heads * dim].
at::Tensor attend(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values,
                  const at::Tensor& tables, const at::Tensor& rows, const at::Tensor& limits,
                  const at::Tensor& extras, double scale);
template <typename T>
void attend_rows(const T* qp, const T* kp, const T* vp, T* op, const KvPages& pages,
                 const int64_t* row, const int64_t* limit, const int64_t* extra,
                 int64_t tokens, int64_t heads, float scale);

// --- block_products.cpp: 4- and 8-bit block matrices with int8 activations

constexpr int64_t kTile = 16, kBlock = 32;  // output rows a tile, inputs a block
inline int64_t block_bytes(int64_t bits) { return (bits == 4 ? 256 : 512) + 64; }

at::Tensor block_pack(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& low,
                      int64_t bits);
at::Tensor block_rows(const at::Tensor& packed, const at::Tensor& ids, int64_t out_features,
                      int64_t in_features, int64_t bits, at::ScalarType dtype);
void block_row(const uint8_t* p, int64_t id, int64_t blocks, int64_t bits, float* dst);
at::Tensor block_product(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         int64_t bits, const c10::optional<at::Tensor>& bias);
template <typename T>
void block_product_rows(const T* xp, int64_t tokens, int64_t k, const uint8_t* wp, int64_t n,
                        int64_t bits, const float* bp, T* yp);

// A row's activations quantized per block of 32 (what block and K-quant products multiply):
// int8 codes round(x / d) with d = max|x| / 127, each block's d, and d * sum(codes)
template <typename T>
void quantize_row(const T* x, int64_t k, int8_t* codes, float* scale, float* sum);

// --- kquant_products.cpp: GGUF's K-quant matrices (Q4_K, Q5_K, Q6_K) with int8 activations

// GGML's numbers for the K-quant types; a matrix's segments are rows of one type each
constexpr int64_t kQ4K = 12, kQ5K = 13, kQ6K = 14;
constexpr int64_t kSuper = 256;  // inputs a super-block
// LayerStack's kind for a K-quant matrix (its packed bytes and its [segments, 3] layout)
constexpr int64_t kKQuant = 64;

// the file's bytes of one row's super-block, by type
int64_t kquant_block_bytes(int64_t type);
// raw [out, in / 256 * block bytes] (the file's rows) -> the packing kquant_product reads
at::Tensor kquant_pack(const at::Tensor& raw, int64_t type);
// rows ``ids`` of a K-quant matrix dequantized as GGUF defines it (float32), cast to dtype
at::Tensor kquant_rows(const at::Tensor& packed, const at::Tensor& layout, const at::Tensor& ids,
                       int64_t in_features, at::ScalarType dtype);
// x [tokens, in] times a K-quant matrix of segments ``layout`` [segments, 3] int64 (type,
// rows, byte offset of its packing in ``packed``), + bias: [tokens, sum of rows]
at::Tensor kquant_product(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& layout,
                          const c10::optional<at::Tensor>& bias);
template <typename T>
void kquant_product_rows(const T* xp, int64_t tokens, int64_t k, const uint8_t* wp,
                         const int64_t* layout, int64_t segments, const float* bp, T* yp);
// the output rows of a checked layout [segments, 3] for a packing of ``bytes`` bytes and
// ``in`` inputs
int64_t kquant_check(const at::Tensor& layout, int64_t bytes, int64_t in);

// --- argmax.cpp: the first of the largest scores of each row [rows, n] -> [rows] int64,
// as torch's argmax (a NaN counts as the largest)
at::Tensor argmax_rows(const at::Tensor& scores);

// --- dense_products.cpp: float32 and bfloat16 matrices

constexpr int64_t kDenseRows = 64;  // output rows a group

at::Tensor dense_product(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                         const c10::optional<at::Tensor>& bias);
template <typename T, typename W, typename X>
void dense_product_rows(const X* xs, int64_t tokens, int64_t k, const W* wp, int64_t n,
                        const float* bp, T* yp);

// A product's bias [out] in float32 (undefined: none)
at::Tensor float_bias(const c10::optional<at::Tensor>& bias, int64_t n);

// --- layer_stack.cpp: a whole decoder stack in one call

// What a stack's matrix is: PyTorch's packed int4 (every matrix of the stack, then), a
// 4- or 8-bit block matrix (block_product), or a bfloat16 or float32 one packed for
// dense_product
constexpr int64_t kTorchInt4 = 0, kDenseBf16 = 16, kDenseF32 = 32;

// The layers of a Llama-family model whose matrices are all PyTorch's packed int4 (in
// bfloat16), or all native ones (4- and 8-bit block matrices, dense ones in the model's
// dtype, mixed as a GGUF file mixes its tensor types): the same calls runtime/runner/fused.py
// makes per layer, in the same order, without a Python round trip per op. Its output is
// bitwise the Python loop's.
class LayerStack {
 public:
  LayerStack(std::vector<at::Tensor> packed, std::vector<at::Tensor> scales_zeros,
             std::vector<int64_t> out_features, std::vector<c10::optional<at::Tensor>> biases,
             std::vector<at::Tensor> norms, std::vector<double> eps, int64_t group,
             int64_t heads, int64_t kv_heads, double scale, std::vector<int64_t> kinds);

  // hidden [T, H] (the model's dtype) -> the final norm of the last layer's output, [T, H]
  at::Tensor forward(const at::Tensor& embedded, const at::Tensor& cos, const at::Tensor& sin,
                     std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                     const at::Tensor& tables, const at::Tensor& rows, const at::Tensor& slots,
                     const at::Tensor& limits, const at::Tensor& extras) const;

  int64_t layers() const { return static_cast<int64_t>(packed_.size() / 4); }
  int64_t hidden() const { return norms_[0].numel(); }
  bool native() const { return native_; }
  at::ScalarType dtype() const { return dtype_; }

 private:
  template <typename T>
  at::Tensor forward_native(const at::Tensor& embedded, const at::Tensor& cos,
                            const at::Tensor& sin, const std::vector<at::Tensor>& keys,
                            const std::vector<at::Tensor>& values, const at::Tensor& tables,
                            const at::Tensor& rows, const at::Tensor& slots,
                            const at::Tensor& limits, const at::Tensor& extras) const;
  at::Tensor product(const at::Tensor& x, size_t i) const;

  std::vector<at::Tensor> packed_, scales_zeros_;
  std::vector<int64_t> out_;
  std::vector<c10::optional<at::Tensor>> biases_;
  std::vector<at::Tensor> bias32_;  // native matrices' biases in float32 (undefined: none)
  std::vector<at::Tensor> norms_;
  std::vector<double> eps_;
  int64_t group_, heads_, kv_heads_;
  double scale_;
  std::vector<int64_t> kinds_;  // each matrix's kind (kTorchInt4, 4, 8, kDenseBf16, kDenseF32)
  bool native_ = false;          // native matrices (forward_native), else PyTorch's int4
  at::ScalarType dtype_;         // the activations', norms' and cache's dtype
};

// --- draft_chain.cpp: a draft model's greedy steps for a round's sequences in one call

// A product of one of LayerStack's matrix kinds (4, 8: block; kDenseBf16, kDenseF32: dense
// in the model's dtype) with its float32 bias (undefined: none): x [tokens, k] -> y [tokens, out]
struct ChainMatrix {
  at::Tensor packed;
  int64_t kind = 0, out = 0, in = 0;
  at::Tensor bias32;
};

// The contract is DraftChain.run's docstring in bindings.cpp (what Python sees).
class DraftChain {
 public:
  DraftChain(const LayerStack& stack, at::Tensor embedding, int64_t embedding_kind,
             at::Tensor head, int64_t head_kind, int64_t head_out,
             c10::optional<at::Tensor> head_bias, c10::optional<at::Tensor> head_ids,
             int64_t vocab, c10::optional<at::Tensor> head_norm, double head_eps,
             c10::optional<at::Tensor> fuse, int64_t fuse_kind, int64_t fuse_in,
             c10::optional<at::Tensor> fuse_bias);

  std::vector<at::Tensor> run(const at::Tensor& ids, const at::Tensor& positions,
                              const at::Tensor& tables, const at::Tensor& rows,
                              const at::Tensor& slots,
                              const at::Tensor& limits, const at::Tensor& extras,
                              const at::Tensor& last, const at::Tensor& steps,
                              const at::Tensor& cos, const at::Tensor& sin,
                              std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                              const c10::optional<at::Tensor>& carried) const;

 private:
  at::Tensor embed(const at::Tensor& ids) const;
  at::Tensor head_logits(const at::Tensor& hidden) const;
  void pick(const at::Tensor& logits, int64_t row, bool second, int64_t* token, float* sure,
            int64_t* runner_up, float* runner_up_sure) const;

  LayerStack stack_;
  at::Tensor embedding_;
  int64_t embedding_kind_;  // 0: a [vocab, hidden] table (float32 or the model's dtype), 4, 8
  ChainMatrix head_, fuse_;  // fuse_.kind 0: none
  at::Tensor head_ids_;      // [K] the vocabulary id of each head row (undefined: row j is j)
  int64_t vocab_;            // ids from here on are never drafted
  at::Tensor head_norm_;     // undefined: none
  double head_eps_;
  std::vector<int64_t> valid_;  // the head rows whose id is below vocab_, in order
};

}  // namespace specserve
