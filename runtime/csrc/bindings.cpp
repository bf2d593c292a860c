// The kernels as a Python module (runtime/kernels.py builds one per instruction-set level
// and loads the host's best, or the one SPECSERVE_CPU_CAPABILITY names).

#include <torch/extension.h>

#include "kernels.h"

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
  m.def("add_rms_norm", &add_rms_norm, "(hidden + delta, RMS norm of it times weight)",
        release());
  m.def("rope_store", &rope_store, "rotary embedding; keys and values into the cache",
        release());
  m.def("attend", &attend, "attention of each token over the keys it may see", release());
  m.def("silu_mul", &silu_mul, "silu(gate) * up", release());
  m.def("block_pack", &block_pack, "a 4- or 8-bit block matrix packed for block_product");
  m.def("block_rows", &block_rows, "rows of a block matrix, dequantized");
  m.def("block_product", &block_product, "x times a block matrix, with int8 activations",
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
}
