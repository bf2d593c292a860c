// The kernels as a Python module (runtime/native/kernels.py builds one per instruction-set level
// and loads the host's best, or the one SPECSERVE_CPU_CAPABILITY names).

#include <torch/extension.h>

#include "kernels.h"
#include "tiles.h"

#if !defined(SPECSERVE_CAPABILITY)
#define SPECSERVE_CAPABILITY default
#endif
#define SPECSERVE_STRING(X) SPECSERVE_QUOTE(X)
#define SPECSERVE_QUOTE(X) #X

namespace {

std::string capability() { return SPECSERVE_STRING(SPECSERVE_CAPABILITY); }

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace specserve;
  using release = py::call_guard<py::gil_scoped_release>;  // the HTTP loop runs meanwhile
  m.def("capability", &capability, "the instruction-set level this build was compiled for");
  m.def("tiles", &specserve::amx::kind,
        "what the block products of 2 to 16 tokens run on: amx (tiles this process may use), "
        "amx_emulated (tests' build) or none (vector instructions)");
#if defined(SPECSERVE_AMX_EMULATE)
  m.def("emulated_tile_products", [] { return specserve::amx::products.load(); },
        "the tile products (TDPBSUD) the emulated tiles have run in this process");
#endif
  m.def("add_rms_norm", &add_rms_norm, "(hidden + delta, RMS norm of it times weight)",
        release());
  m.def("rope_store", &rope_store, "rotary embedding; keys and values into the cache",
        release());
  m.def("attend", &attend, "attention of each token over the keys it may see", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", release());
  // holds the GIL: tens of microseconds, and a thread that took the GIL meanwhile would
  // hold up the model thread for its whole turn
  m.def("argmax_rows", &argmax_rows, "the first of the largest scores of each row");
  m.def("block_pack", &block_pack, "a 4- or 8-bit block matrix packed for block_product");
  m.def("block_rows", &block_rows, "rows of a block matrix, dequantized");
  m.def("block_product", &block_product, "x times a block matrix, with int8 activations",
        release());
  m.def("kquant_block_bytes", &kquant_block_bytes,
        "the file's bytes of a row's super-block of a K-quant type (GGML's number)");
  m.def("kquant_pack", &kquant_pack,
        "a K-quant tensor's rows (the file's super-blocks) packed for kquant_product");
  m.def("kquant_rows", &kquant_rows, "rows of a K-quant matrix, dequantized as GGUF does");
  m.def("kquant_product", &kquant_product,
        "x times a K-quant matrix (segments of Q4_K, Q5_K, Q6_K rows), with int8 activations",
        release());
  m.def("dense_product", &dense_product,
        "x times a float32 or bfloat16 matrix packed in groups of 64 rows", release());
  // module_local: each level's module registers its own (a process may load two)
  py::class_<LayerStack>(m, "LayerStack", py::module_local())
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<int64_t>,
                    std::vector<c10::optional<at::Tensor>>, std::vector<at::Tensor>,
                    std::vector<double>, int64_t, int64_t, int64_t, double,
                    std::vector<int64_t>>())
      .def("forward", &LayerStack::forward, release());
  py::class_<DraftChain>(m, "DraftChain", py::module_local(), R"(
A draft model's greedy steps for every sequence of a round in one call.

DraftChain(stack, embedding, embedding_kind, head, head_kind, head_out, head_bias, head_ids,
           vocab, head_norm, head_eps, fuse, fuse_kind, fuse_in, fuse_bias)
  stack: the draft's LayerStack of native matrices (its last norm: the final norm, or a
    pass-through one where the head brings its own norm).
  embedding, embedding_kind: the input embedding: kind 0, a [vocab, hidden] table in float32
    or the model's dtype (rows rounded to the model's dtype); 4 or 8, a block_pack-ed
    [vocab, hidden] matrix (rows dequantized in float32, then rounded).
  head, head_kind, head_out, head_bias: the output head [head_out, hidden]: a 4- or 8-bit
    block matrix (bfloat16 activations, as quantized.BlockMatrix) or a dense one packed for
    dense_product in the model's dtype (kind 16 bfloat16, 32 float32); bias float or None.
  head_ids: [head_out] int64, the vocabulary id of each head row (None: row j is token j).
  vocab: tokens from this id on are never drafted.
  head_norm, head_eps: an RMS norm applied to the stack's output before the head (None: none).
  fuse, fuse_kind, fuse_in, fuse_bias: an optional input fusion [hidden, fuse_in] (a matrix of
    the stack's kinds) applied to [token embedding | carried hidden] before the stack, the
    carried hidden being [fuse_in - hidden] wide: the caller's rows at step 0, then each
    sequence's stack output of the step before (None: the embedding enters the stack).

run(ids, positions, tables, rows, slots, limits, extras, last, steps, cos, sin, keys, values,
    carried)
  Step 0 is one stack pass over the round's fed tokens, packed as runtime.runner.layout.Layout packs
  them (ids [T] and its int64 [T] positions, block-table rows, cache slots, limits, extras;
  tables [rows, width] int64, each row a sequence's blocks in the pools); last
  [n]: the index in that pass of each sequence's last fed token; steps [n] (>= 1): how many
  tokens each sequence drafts. Each step takes each sequence's logits after its last token,
  picks the first of the largest (the lowest id among ties) and, while the sequence drafts
  more, feeds that token at the next position and slot of its table row (limit + 1, no
  extra). cos/sin: the rotary tables [positions, dim] by position (runtime.runner.stack.Rotary's),
  covering every position the steps reach. keys/values: the stack's cache per layer, pools
  [blocks, kv_heads, block, dim]; each table row holds blocks for the fed tokens and steps - 1
  more; the cache grows by them. carried: [T, fuse_in - hidden] in the model's dtype with an input fusion,
  else None.
  Returns (tokens [n, max steps] int64, -1 past a sequence's steps; their probabilities
  [n, max steps] float32, each the softmax's largest over the head's tokens below vocab;
  the first step's runner-up [n] int64 and its probability [n] float32; the stack's output
  at each sequence's last step [n, hidden], the hidden state a fusion would carry on).
  Every level computes the same bits; each step's tokens are a Python step's (the stack's
  call, the head's product, the argmax over the whole vocabulary).
)")
      .def(py::init<const LayerStack&, at::Tensor, int64_t, at::Tensor, int64_t, int64_t,
                    c10::optional<at::Tensor>, c10::optional<at::Tensor>, int64_t,
                    c10::optional<at::Tensor>, double, c10::optional<at::Tensor>, int64_t,
                    int64_t, c10::optional<at::Tensor>>())
      .def("run", &DraftChain::run, release());
}
