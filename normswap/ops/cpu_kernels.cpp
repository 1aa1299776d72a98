// Fused CPU RMSNorm for normswap: forward (optionally with the residual add), backward, pRMSNorm.
//
// Built at first use by normswap/ops/cpu.py. Registers into the `normswap` torch.library namespace:
//   cpu_rms_norm(x, weight?, eps, k)               -> (y, rstd)      CPU kernel + C++ autograd
//   cpu_rms_norm_add(x, residual, weight?, eps, k) -> (y, h, rstd)   CPU kernel + C++ autograd
//   cpu_rms_norm_backward(dy, h, rstd, weight?, dh_out?, k, need_dw) -> (dx, dweight)
// and two entry functions, `normswap_cpu::rms_norm` and `rms_norm_add` (input checks, dtype promotion
// and broadcasting, then the ops through the dispatcher), which cpu_bindings.cpp binds for eager calls:
// the hot path runs no Python beyond the call itself. Fake (shape) implementations live in cpu.py.
//
// Math: y = h * rstd * w with rstd = 1 / sqrt(mean(h[:k]^2) + eps), all in fp32 whatever the storage
// dtype. A row whose fp32 sum of squares is not finite (|h| >~ 1.8e19) is summed again divided by s,
// the power of two just below its max |h| (exact scaling): the check costs one compare per row.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ExpandUtils.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace {

using at::Tensor;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t V = Vec::size();
// Rows per parallel task: at least this many elements, so a task outweighs OpenMP's fork/join (~us).
constexpr int64_t kGrainElems = 32768;

// ---- loads/stores of V fp32 lanes from any storage dtype ------------------------------------------
template <typename T>
struct Io {  // bf16 / fp16: ATen's vector conversions (round-to-nearest-even on store)
  static Vec load(const T* p) { Vec v; at::vec::load_to_float(p, v); return v; }
  static Vec load(const T* p, int64_t n) {
    if (n == V) return load(p);
    float buf[V] = {};
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
    return Vec::loadu(buf);
  }
  static void store(T* p, const Vec& v, int64_t n = V) {
    at::vec::convert_from_float<T>(v, v).store(p, static_cast<int>(n));
  }
};
template <>
struct Io<float> {
  static Vec load(const float* p) { return Vec::loadu(p); }
  static Vec load(const float* p, int64_t n) { return Vec::loadu(p, n); }
  static void store(float* p, const Vec& v, int64_t n = V) { v.store(p, static_cast<int>(n)); }
};
template <>
struct Io<double> {  // fp64 storage, fp32 math (as the reference): rare, so plain scalar conversions
  static Vec load(const double* p, int64_t n = V) {
    float buf[V] = {};  // fp64 storage is rare: no fast path
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i]);
    return Vec::loadu(buf);
  }
  static void store(double* p, const Vec& v, int64_t n = V) {
    float buf[V];
    v.store(buf);
    for (int64_t i = 0; i < n; ++i) p[i] = buf[i];
  }
};

inline float hsum(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, v);
}

// Sum of (h * scale)^2 over h[0:k]; four accumulators hide the FMA latency.
template <typename T>
inline float sum_squares(const T* h, int64_t k, float scale) {
  Vec a0(0.f), a1(0.f), a2(0.f), a3(0.f);
  const Vec s(scale);
  const bool scaled = scale != 1.f;
  int64_t j = 0;
  for (; j + 4 * V <= k; j += 4 * V) {
    Vec v0 = Io<T>::load(h + j), v1 = Io<T>::load(h + j + V);
    Vec v2 = Io<T>::load(h + j + 2 * V), v3 = Io<T>::load(h + j + 3 * V);
    if (scaled) { v0 = v0 * s; v1 = v1 * s; v2 = v2 * s; v3 = v3 * s; }
    a0 = at::vec::fmadd(v0, v0, a0); a1 = at::vec::fmadd(v1, v1, a1);
    a2 = at::vec::fmadd(v2, v2, a2); a3 = at::vec::fmadd(v3, v3, a3);
  }
  for (; j + V <= k; j += V) {
    Vec v = Io<T>::load(h + j) * s;
    a0 = at::vec::fmadd(v, v, a0);
  }
  if (j < k) {
    Vec v = Io<T>::load(h + j, k - j) * s;  // zero-filled lanes add nothing
    a1 = at::vec::fmadd(v, v, a1);
  }
  return hsum((a0 + a1) + (a2 + a3));
}

template <typename T>
inline float max_abs(const T* h, int64_t k) {
  Vec m(0.f);
  int64_t j = 0;
  for (; j + V <= k; j += V) m = at::vec::maximum(m, Io<T>::load(h + j).abs());
  if (j < k) m = at::vec::maximum(m, Io<T>::load(h + j, k - j).abs());
  return at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
}

// The largest power of two <= m (exponent bits only), at least 1: an exact divisor.
inline float pow2_floor_at_least_1(float m) {
  uint32_t bits;
  std::memcpy(&bits, &m, 4);
  bits &= 0x7F800000u;
  float s;
  std::memcpy(&s, &bits, 4);
  return s > 1.f ? s : 1.f;
}

// 1 / sqrt(mean(h[:k]^2) + eps), rows that overflow fp32 squares taking the scaled pass.
template <typename T>
inline float row_rstd(const T* h, int64_t k, float eps) {
  float ss = sum_squares(h, k, 1.f);
  if (C10_LIKELY(std::isfinite(ss))) return 1.f / std::sqrt(ss / static_cast<float>(k) + eps);
  const float inv = 1.f / pow2_floor_at_least_1(max_abs(h, k));
  ss = sum_squares(h, k, inv);
  return inv / std::sqrt(ss / static_cast<float>(k) + eps * inv * inv);
}

// y = h * rstd * w over one row.
template <typename T, typename W>
inline void scale_row(const T* h, const W* w, T* y, int64_t d, float rstd) {
  const Vec r(rstd);
  int64_t j = 0;
  for (; j + V <= d; j += V) {
    Vec v = Io<T>::load(h + j) * r;
    if (w != nullptr) v = v * Io<W>::load(w + j);
    Io<T>::store(y + j, v);
  }
  if (j < d) {
    const int64_t n = d - j;
    Vec v = Io<T>::load(h + j, n) * r;
    if (w != nullptr) v = v * Io<W>::load(w + j, n);
    Io<T>::store(y + j, v, n);
  }
}

// h = x + residual rounded to T (what the unfused `x + residual` stores), over one row.
template <typename T>
inline void add_row(const T* x, const T* r, T* h, int64_t d) {
  int64_t j = 0;
  for (; j + V <= d; j += V) Io<T>::store(h + j, Io<T>::load(x + j) + Io<T>::load(r + j));
  if (j < d) Io<T>::store(h + j, Io<T>::load(x + j, d - j) + Io<T>::load(r + j, d - j), d - j);
}

int64_t grain_rows(int64_t d) { return std::max<int64_t>(1, kGrainElems / std::max<int64_t>(d, 1)); }

// Rows of d elements with unit column stride, `stride` apart: the tensor itself when its layout allows
// (no view is created: ~0.3 us of a 3 us decode-size call), else a reshaped view or a contiguous copy.
struct Rows {
  Tensor t;
  int64_t n, stride;
  template <typename T>
  const T* ptr() const { return t.defined() ? t.const_data_ptr<T>() : nullptr; }
};

Rows rows_of(const Tensor& t, int64_t d) {
  if (!t.defined()) return {Tensor(), 0, 0};
  if (t.is_contiguous()) return {t, d > 0 ? t.numel() / d : 0, d};
  if (t.dim() == 2 && t.stride(1) == 1) return {t, t.size(0), t.stride(0)};
  Tensor t2 = t.reshape({-1, d});
  if (t2.stride(1) != 1 && d > 1) t2 = t2.contiguous();
  return {t2, t2.size(0), t2.stride(0)};
}

void check_weight(const std::optional<Tensor>& weight, int64_t d) {
  if (weight.has_value() && weight->defined())
    TORCH_CHECK(weight->dim() == 1 && weight->size(0) == d, "RMSNorm weight must have shape (", d,
                "), got ", weight->sizes());
}

void check_k(int64_t k, int64_t d) {
  TORCH_CHECK(d == 0 || (k >= 1 && k <= d), "RMSNorm partial width k must be in [1, ", d, "], got ", k);
}


// ---- forward ---------------------------------------------------------------------------------------
template <typename T, typename W>
void fwd_impl(const Rows& x2, const Rows& r2, const Tensor& w, Tensor& y, Tensor& h, Tensor& rstd, int64_t d,
              int64_t k, float eps) {
  const int64_t n = x2.n;
  const T* x = x2.ptr<T>();
  const T* r = r2.ptr<T>();
  const int64_t sx = x2.stride, sr = r2.stride;
  const W* wp = w.defined() ? w.const_data_ptr<W>() : nullptr;
  T* yp = y.data_ptr<T>();
  T* hp = h.defined() ? h.data_ptr<T>() : nullptr;
  float* rs = rstd.data_ptr<float>();
  at::parallel_for(0, n, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const T* src = x + i * sx;
      if (r != nullptr) {  // fused residual add; h (rounded) is what gets normalised
        add_row(src, r + i * sr, hp + i * d, d);
        src = hp + i * d;
      }
      const float rstd_i = row_rstd(src, k, eps);
      rs[i] = rstd_i;
      scale_row(src, wp, yp + i * d, d, rstd_i);
    }
  });
}

void check_input(const Tensor& t, const char* name) {
  TORCH_CHECK_TYPE(t.is_floating_point(), "RMSNorm needs floating-point inputs, got ", t.scalar_type(),
                   " for ", name);
  TORCH_CHECK(t.dim() >= 1, "RMSNorm needs at least one dimension, got a 0-d ", name);
}

#define NORMSWAP_DISPATCH(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, TYPE, NAME, __VA_ARGS__)

Tensor weight_for(const std::optional<Tensor>& weight, const Tensor& x) {
  if (!weight.has_value() || !weight->defined()) return Tensor();
  Tensor w = weight->scalar_type() == x.scalar_type() || weight->scalar_type() == at::kFloat
                 ? *weight : weight->to(at::kFloat);
  return w.contiguous();
}

std::tuple<Tensor, Tensor, Tensor> fwd_common(const Tensor& x, const Tensor& residual,
                                              const std::optional<Tensor>& weight, double eps, int64_t k) {
  check_input(x, "x");
  const int64_t d = x.size(-1);
  check_weight(weight, d);
  check_k(k, d);
  const Rows x2 = rows_of(x, d), r2 = rows_of(residual, d);
  const Tensor w = weight_for(weight, x);
  Tensor y = at::empty(x.sizes(), x.options());
  Tensor h = residual.defined() ? at::empty(x.sizes(), x.options()) : Tensor();
  Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  if (x2.n > 0 && d > 0) {
    NORMSWAP_DISPATCH(x.scalar_type(), "normswap_cpu_rms_norm", [&] {
      if (!w.defined() || w.scalar_type() == x.scalar_type())
        fwd_impl<scalar_t, scalar_t>(x2, r2, w, y, h, rstd, d, k, static_cast<float>(eps));
      else
        fwd_impl<scalar_t, float>(x2, r2, w, y, h, rstd, d, k, static_cast<float>(eps));
    });
  }
  return {y, h, rstd};
}

std::tuple<Tensor, Tensor> rms_norm_cpu(const Tensor& x, const std::optional<Tensor>& weight, double eps,
                                        int64_t k) {
  auto [y, h, rstd] = fwd_common(x, Tensor(), weight, eps, k);
  return {y, rstd};
}

std::tuple<Tensor, Tensor, Tensor> rms_norm_add_cpu(const Tensor& x, const Tensor& residual,
                                                    const std::optional<Tensor>& weight, double eps, int64_t k) {
  check_input(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "cpu_rms_norm_add needs x and residual of one shape and dtype, got ", x.sizes(), " ",
              x.scalar_type(), " and ", residual.sizes(), " ", residual.scalar_type());
  TORCH_CHECK(x.scalar_type() != at::kDouble, "cpu_rms_norm_add: fp64 is added unfused (rms_norm_add)");
  return fwd_common(x, residual, weight, eps, k);
}

// ---- backward --------------------------------------------------------------------------------------
// y = h r w with r = (mean(h[:k]^2) + eps)^-1/2. With g = dy w and c = sum_j g_j h_j r over all d
// columns (every y_j depends on r): dh = r (g - (c / k) h r [j < k]);  dw = sum_rows dy h r.
// Rows handled together in the second pass, so each dweight partial element is loaded and stored once per
// block instead of once per row (it would otherwise cost as much traffic as dy itself).
constexpr int64_t kBwdBlock = 4;

template <typename T, typename W>
void bwd_rows(const T* dy, int64_t sdy, const T* h, int64_t sh, const float* rstd, const W* w, const T* dho,
              int64_t sdho, T* dx, float* dw, int64_t begin, int64_t end, int64_t d, int64_t k) {
  const float inv_k = 1.f / static_cast<float>(k);
  auto g_at = [&](const T* dyi, int64_t j, int64_t n) {
    const Vec g = Io<T>::load(dyi + j, n);
    return w != nullptr ? g * Io<W>::load(w + j, n) : g;
  };
  if (dw != nullptr) std::fill(dw, dw + d, 0.f);  // this task's partial (allocated uninitialised)
  for (int64_t i0 = begin; i0 < end; i0 += kBwdBlock) {
    const int64_t rows = std::min<int64_t>(kBwdBlock, end - i0);
    const T* dyb[kBwdBlock];
    const T* hb[kBwdBlock];
    const T* dhob[kBwdBlock];
    T* dxb[kBwdBlock];
    Vec rb[kBwdBlock], coefb[kBwdBlock];
    // Pass 1, row by row: c = sum_j g_j (h_j r). hr = h r is O(1): no product over- or underflows for
    // huge |h| (scaled rows).
    for (int64_t b = 0; b < rows; ++b) {
      const int64_t i = i0 + b;
      dyb[b] = dy + i * sdy;
      hb[b] = h + i * sh;
      dhob[b] = dho != nullptr ? dho + i * sdho : nullptr;
      dxb[b] = dx + i * d;
      rb[b] = Vec(rstd[i]);
      Vec acc0(0.f), acc1(0.f);
      int64_t j = 0;
      for (; j + 2 * V <= d; j += 2 * V) {
        acc0 = at::vec::fmadd(g_at(dyb[b], j, V), Io<T>::load(hb[b] + j) * rb[b], acc0);
        acc1 = at::vec::fmadd(g_at(dyb[b], j + V, V), Io<T>::load(hb[b] + j + V) * rb[b], acc1);
      }
      for (; j < d; j += V) {
        const int64_t n = std::min<int64_t>(V, d - j);
        acc0 = at::vec::fmadd(g_at(dyb[b], j, n), Io<T>::load(hb[b] + j, n) * rb[b], acc0);
      }
      coefb[b] = Vec(hsum(acc0 + acc1) * inv_k);
    }
    // Pass 2, column block by column block across the rows: dh = r (g - coef hr [j < k]) (+ dh_out).
    for (int64_t j = 0; j < d; j += V) {
      const int64_t n = std::min<int64_t>(V, d - j);
      Vec mask(1.f);  // pRMSNorm: columns past k do not enter the rms
      if (j + n > k) {
        float m[V] = {};
        for (int64_t t = 0; t < k - j; ++t) m[t] = 1.f;
        mask = Vec::loadu(m);
      }
      const Vec wv = w != nullptr ? Io<W>::load(w + j, n) : Vec(1.f);
      Vec dwv = dw != nullptr ? Vec::loadu(dw + j, n) : Vec(0.f);
      for (int64_t b = 0; b < rows; ++b) {
        const Vec dyv = Io<T>::load(dyb[b] + j, n);
        const Vec hr = Io<T>::load(hb[b] + j, n) * rb[b];
        Vec dh = rb[b] * (dyv * wv - coefb[b] * hr * mask);
        if (dhob[b] != nullptr) dh = dh + Io<T>::load(dhob[b] + j, n);
        Io<T>::store(dxb[b] + j, dh, n);
        dwv = at::vec::fmadd(dyv, hr, dwv);
      }
      if (dw != nullptr) dwv.store(dw + j, static_cast<int>(n));
    }
  }
}

// fp32 vector -> dtype, rounding as .to() does, without a dispatcher round trip (a third of a decode-size
// bf16 backward's overhead went to .to()).
Tensor cast_vector(const Tensor& src, at::ScalarType dtype) {
  Tensor out = at::empty(src.sizes(), src.options().dtype(dtype));
  const float* s = src.const_data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "normswap_cast", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    for (int64_t j = 0; j < src.numel(); ++j) o[j] = static_cast<scalar_t>(s[j]);
  });
  return out;
}

std::tuple<Tensor, Tensor> rms_norm_backward_cpu(const Tensor& dy, const Tensor& h, const Tensor& rstd,
                                                 const std::optional<Tensor>& weight,
                                                 const std::optional<Tensor>& dh_out, int64_t k, bool need_dw) {
  const int64_t d = h.size(-1);
  check_weight(weight, d);
  check_k(k, d);
  // No conversion, view or copy where the inputs are already what the kernel reads (the forward's own
  // outputs): at decode sizes each costs as much as the kernel.
  auto as_h = [&](const Tensor& t) { return t.scalar_type() == h.scalar_type() ? t : t.to(h.scalar_type()); };
  const Rows h2 = rows_of(h, d), dy2 = rows_of(as_h(dy), d);
  const bool has_dho = dh_out.has_value() && dh_out->defined();
  const Rows dho2 = rows_of(has_dho ? as_h(*dh_out) : Tensor(), d);
  const Tensor rs = rstd.scalar_type() == at::kFloat && rstd.is_contiguous() ? rstd
                                                                              : rstd.to(at::kFloat).contiguous();
  const Tensor w = weight_for(weight, h);
  const bool has_dw = w.defined() && need_dw;
  const int64_t n = h2.n;
  TORCH_CHECK(rs.numel() == n, "cpu_rms_norm_backward: rstd has ", rs.numel(), " values for ", n, " rows");
  Tensor dx = at::empty(h.sizes(), h.options());
  // One fp32 dweight partial per task over a fixed split of the rows: deterministic for a thread count.
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                (n * d) / kGrainElems));
  Tensor part = has_dw ? at::empty({tasks * d}, h.options().dtype(at::kFloat)) : Tensor();
  if (n > 0 && d > 0) {
    NORMSWAP_DISPATCH(h.scalar_type(), "normswap_cpu_rms_norm_backward", [&] {
      auto run = [&](auto wtag) {
        using W = decltype(wtag);
        const W* wp = w.defined() ? w.const_data_ptr<W>() : nullptr;
        at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
          for (int64_t t = t0; t < t1; ++t) {
            const int64_t b = n * t / tasks, e = n * (t + 1) / tasks;
            bwd_rows<scalar_t, W>(dy2.ptr<scalar_t>(), dy2.stride, h2.ptr<scalar_t>(), h2.stride,
                                  rs.const_data_ptr<float>(), wp, dho2.ptr<scalar_t>(), dho2.stride,
                                  dx.data_ptr<scalar_t>(),
                                  has_dw ? part.data_ptr<float>() + t * d : nullptr, b, e, d, k);
          }
        });
      };
      if (!w.defined() || w.scalar_type() == h.scalar_type()) run(scalar_t{});
      else run(float{});
    });
  }
  Tensor dw;
  if (has_dw) {
    if (n == 0 || d == 0) part.zero_();
    Tensor acc = tasks == 1 ? part : part.view({tasks, d}).sum(0);
    dw = acc.scalar_type() == weight->scalar_type() ? acc : cast_vector(acc, weight->scalar_type());
  }
  else dw = at::empty({0}, h.options());  // an op cannot return None: empty stands for "no dweight"
  return {dx, dw};
}

// ---- autograd (C++, so the eager call never enters Python) --------------------------------------------
c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const std::optional<Tensor>&, double, int64_t)>&
fwd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("normswap::cpu_rms_norm", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const std::optional<Tensor>&, double, int64_t)>();
  return op;
}

c10::TypedOperatorHandle<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                            const std::optional<Tensor>&, double, int64_t)>&
add_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("normswap::cpu_rms_norm_add", "")
                       .typed<std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&,
                                                                 const std::optional<Tensor>&, double, int64_t)>();
  return op;
}

c10::TypedOperatorHandle<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                    const std::optional<Tensor>&, const std::optional<Tensor>&,
                                                    int64_t, bool)>&
bwd_op() {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("normswap::cpu_rms_norm_backward", "")
                       .typed<std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const Tensor&,
                                                         const std::optional<Tensor>&,
                                                         const std::optional<Tensor>&, int64_t, bool)>();
  return op;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool needs_grad(const Tensor& a, const std::optional<Tensor>& w, const Tensor& b = Tensor()) {
  if (!at::GradMode::is_enabled()) return false;
  return a.requires_grad() || (b.defined() && b.requires_grad()) ||
         (w.has_value() && w->defined() && w->requires_grad());
}

struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const std::optional<Tensor>& weight,
                               double eps, int64_t k) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, rstd] = fwd_op().call(x, weight, eps, k);
    ctx->save_for_backward({x, rstd, weight.value_or(Tensor())});
    ctx->saved_data["k"] = k;
    ctx->mark_non_differentiable({rstd});
    ctx->set_materialize_grads(false);  // rstd's gradient is never used: no zeros allocated for it
    return {y, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (!grads[0].defined()) return {Tensor(), Tensor(), Tensor(), Tensor()};
    const auto saved = ctx->get_saved_variables();
    const Tensor& w = saved[2];
    const bool need_dw = w.defined() && ctx->needs_input_grad(1);
    auto [dx, dw] = bwd_op().call(grads[0], saved[0], saved[1], w.defined() ? std::optional<Tensor>(w) : std::nullopt,
                                  std::nullopt, ctx->saved_data["k"].toInt(), need_dw);
    return {dx, need_dw ? dw : Tensor(), Tensor(), Tensor()};
  }
};

struct RmsNormAddFn : public torch::autograd::Function<RmsNormAddFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& residual,
                               const std::optional<Tensor>& weight, double eps, int64_t k) {
    at::AutoDispatchBelowADInplaceOrView guard;
    auto [y, h, rstd] = add_op().call(x, residual, weight, eps, k);
    // Only h is saved: x and residual are not needed once their sum exists.
    ctx->save_for_backward({h, rstd, weight.value_or(Tensor())});
    ctx->saved_data["k"] = k;
    ctx->mark_non_differentiable({rstd});
    ctx->set_materialize_grads(false);
    return {y, h, rstd};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    // Only h was differentiated (or nothing): it passes straight to both inputs.
    if (!grads[0].defined()) return {grads[1], grads[1], Tensor(), Tensor(), Tensor()};
    const auto saved = ctx->get_saved_variables();
    const Tensor& w = saved[2];
    const bool need_dw = w.defined() && ctx->needs_input_grad(2);
    const std::optional<Tensor> dho = grads[1].defined() ? std::optional<Tensor>(grads[1]) : std::nullopt;
    auto [dh, dw] = bwd_op().call(grads[0], saved[0], saved[1], w.defined() ? std::optional<Tensor>(w) : std::nullopt,
                                  dho, ctx->saved_data["k"].toInt(), need_dw);
    // h = x + residual, so both inputs receive dh (= dnorm + the gradient of the returned h).
    return {dh, dh, need_dw ? dw : Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> rms_norm_autograd(const Tensor& x, const std::optional<Tensor>& weight, double eps,
                                             int64_t k) {
  if (!needs_grad(x, weight)) {  // no graph to record: skip building an autograd node
    at::AutoDispatchBelowADInplaceOrView guard;
    return fwd_op().call(x, weight, eps, k);
  }
  auto out = RmsNormFn::apply(x, weight, eps, k);
  return {out[0], out[1]};
}

std::tuple<Tensor, Tensor, Tensor> rms_norm_add_autograd(const Tensor& x, const Tensor& residual,
                                                         const std::optional<Tensor>& weight, double eps,
                                                         int64_t k) {
  if (!needs_grad(x, weight, residual)) {
    at::AutoDispatchBelowADInplaceOrView guard;
    return add_op().call(x, residual, weight, eps, k);
  }
  auto out = RmsNormAddFn::apply(x, residual, weight, eps, k);
  return {out[0], out[1], out[2]};
}

}  // namespace

// ---- entry points: checks, promotion and broadcasting, then the ops ---------------------------------
namespace normswap_cpu {

namespace {
int64_t width_k(const Tensor& x, int64_t k) {
  check_input(x, "x");
  return k < 0 ? x.size(-1) : k;  // k < 0: full width
}
}  // namespace

Tensor rms_norm(const Tensor& x, const std::optional<Tensor>& weight, double eps, int64_t k) {
  return std::get<0>(fwd_op().call(x, weight, eps, width_k(x, k)));
}

std::tuple<Tensor, Tensor> rms_norm_add(const Tensor& x, const Tensor& residual,
                                        const std::optional<Tensor>& weight, double eps, int64_t k) {
  k = width_k(x, k);
  check_input(residual, "residual");
  // Match the unfused `x + residual`: type promotion and broadcasting happen before the kernel.
  const auto dtype = at::promote_types(x.scalar_type(), residual.scalar_type());
  Tensor a = x.to(dtype), b = residual.to(dtype);
  if (a.sizes() != b.sizes()) {
    const auto shape = at::infer_size(a.sizes(), b.sizes());
    a = a.expand(shape);
    b = b.expand(shape);
  }
  if (dtype == at::kDouble) {  // fp64 sum in fp64, as `x + residual` does; no fused kernel for it
    Tensor h = a + b;
    return {std::get<0>(fwd_op().call(h, weight, eps, k)).to(x.scalar_type()), h};
  }
  auto [y, h, rstd] = add_op().call(a, b, weight, eps, k);
  return {y.to(x.scalar_type()), h};
}

}  // namespace normswap_cpu

TORCH_LIBRARY_FRAGMENT(normswap, m) {
  m.set_python_module("normswap.ops.cpu");  // where the fake implementations are registered
  m.def("cpu_rms_norm(Tensor x, Tensor? weight, float eps, int k) -> (Tensor, Tensor)");
  m.def("cpu_rms_norm_add(Tensor x, Tensor residual, Tensor? weight, float eps, int k) -> (Tensor, Tensor, Tensor)");
  m.def("cpu_rms_norm_backward(Tensor dy, Tensor h, Tensor rstd, Tensor? weight, Tensor? dh_out, int k, "
        "bool need_dw) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(normswap, CPU, m) {
  m.impl("cpu_rms_norm", &rms_norm_cpu);
  m.impl("cpu_rms_norm_add", &rms_norm_add_cpu);
  m.impl("cpu_rms_norm_backward", &rms_norm_backward_cpu);
}

TORCH_LIBRARY_IMPL(normswap, Autograd, m) {
  m.impl("cpu_rms_norm", &rms_norm_autograd);
  m.impl("cpu_rms_norm_add", &rms_norm_add_autograd);
}
