// Python bindings of the CPU RMSNorm entry points (cpu_kernels.cpp), for eager calls: a pybind call
// costs ~1.2 us less than torch.ops.normswap.* (measured; see benchmarks/RESULTS.md). A separate
// translation unit so the two compile in parallel at first use (pybind's headers take ~10 s alone).
#include <torch/csrc/utils/pybind.h>

namespace normswap_cpu {
at::Tensor rms_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps, int64_t k);
std::tuple<at::Tensor, at::Tensor> rms_norm_add(const at::Tensor& x, const at::Tensor& residual,
                                                const std::optional<at::Tensor>& weight, double eps, int64_t k);
}  // namespace normswap_cpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // k < 0 means the full width. The GIL is released for the call, as torch's own bindings do.
  m.def("rms_norm", &normswap_cpu::rms_norm, pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("rms_norm_add", &normswap_cpu::rms_norm_add, pybind11::call_guard<pybind11::gil_scoped_release>());
}
