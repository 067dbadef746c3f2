// Entry points of the CPU kernels; bound to Python in bindings.cpp.  Same
// names and semantics as gtopk_plugin/kernels/reference.py (the oracle).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

namespace gtopk {
namespace cpu {

// select.cpp
std::tuple<at::Tensor, at::Tensor> select_topk(const at::Tensor& x, const at::Tensor& offsets,
                                               const at::Tensor& k);
std::tuple<at::Tensor, at::Tensor, at::Tensor> compensate_select_topk(
    const at::Tensor& acc, at::TensorList grads, const c10::optional<at::Tensor>& residual,
    const at::Tensor& offsets, const at::Tensor& k);
std::tuple<at::Tensor, at::Tensor> select_threshold(const at::Tensor& x, const at::Tensor& offsets,
                                                    const at::Tensor& k);

// merge.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> merge_select(
    const at::Tensor& idx_a, const at::Tensor& val_a, const at::Tensor& idx_b,
    const at::Tensor& val_b, const at::Tensor& offsets, const at::Tensor& k);
bool strictly_increasing(const at::Tensor& idx);
at::Tensor member_sorted(const at::Tensor& values, const at::Tensor& ascending);

// scatter.cpp
at::Tensor scatter_update(int64_t numel, const at::Tensor& idx, const at::Tensor& vals,
                          int64_t divisor);
std::tuple<at::Tensor, bool> nonzero_indices(const at::Tensor& x, int64_t limit);

// compensate.cpp
bool compensate(const at::Tensor& out, const at::Tensor& grad,
                const c10::optional<at::Tensor>& residual);
int64_t div_count_(const at::Tensor& x, int64_t divisor);
int64_t div_count_into(const at::Tensor& x, int64_t divisor, const at::Tensor& out);
void subtract_at_(const at::Tensor& acc, const at::Tensor& idx, const at::Tensor& sent,
                  const c10::optional<at::Tensor>& mask);
void scatter_reset_(const at::Tensor& out, const at::Tensor& prev, const at::Tensor& idx,
                    const at::Tensor& vals, int64_t divisor);

// prescale.cpp
std::tuple<bool, bool, int64_t> prescale_copy(const at::Tensor& out, const at::Tensor& grad, int64_t shift);

}  // namespace cpu
}  // namespace gtopk
