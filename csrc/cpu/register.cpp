// Registers the CPU kernels as torch operators in the namespace gtopk_cpu
// (torch.ops.gtopk_cpu.*), the way pytorch_scatter does: no pybind11 headers
// (they triple the compile time), and the library is loaded with
// torch.ops.load_library from gtopk_plugin/kernels/cpu.py.
#include <torch/library.h>

#include <string>

#include "ops.h"

#define GTOPK_STR2(x) #x
#define GTOPK_STR(x) GTOPK_STR2(x)
#ifdef GTOPK_SOURCE_HASH
#define GTOPK_SOURCE_HASH_STR GTOPK_STR(GTOPK_SOURCE_HASH)
#else
#define GTOPK_SOURCE_HASH_STR "unknown"
#endif

namespace {
std::string source_hash() { return GTOPK_SOURCE_HASH_STR; }
}  // namespace

TORCH_LIBRARY(gtopk_cpu, m) {
  m.def("source_hash", &source_hash);
  m.def("select_topk", &gtopk::cpu::select_topk);
  m.def("select_threshold", &gtopk::cpu::select_threshold);
  m.def("merge_select", &gtopk::cpu::merge_select);
  m.def("strictly_increasing", &gtopk::cpu::strictly_increasing);
  m.def("member_sorted", &gtopk::cpu::member_sorted);
  m.def("scatter_update", &gtopk::cpu::scatter_update);
  m.def("nonzero_indices", &gtopk::cpu::nonzero_indices);
  // writes into `out` (the reducer's scratch accumulator): declared mutable
  m.def("compensate(Tensor(a!) out, Tensor grad, Tensor? residual) -> bool",
        &gtopk::cpu::compensate);
  m.def("compensate_select_topk(Tensor(a!) acc, Tensor[] grads, Tensor? residual, Tensor offsets, "
        "Tensor k) -> (Tensor, Tensor, Tensor)", &gtopk::cpu::compensate_select_topk);
  m.def("div_count_(Tensor(a!) x, int divisor) -> int", &gtopk::cpu::div_count_);
  m.def("div_count_into(Tensor x, int divisor, Tensor(a!) out) -> int", &gtopk::cpu::div_count_into);
  m.def("prescale_copy(Tensor(a!) out, Tensor grad, int shift) -> (bool, bool, int)", &gtopk::cpu::prescale_copy);
  m.def("subtract_at_(Tensor(a!) acc, Tensor idx, Tensor sent, Tensor? mask=None) -> ()", &gtopk::cpu::subtract_at_);
  m.def("scatter_reset_(Tensor(a!) out, Tensor prev, Tensor idx, Tensor vals, int divisor) -> ()",
        &gtopk::cpu::scatter_reset_);
}
