// The expert kernels' activation over a block of intermediate rows (experts_isa.cpp,
// experts_amx.cpp): SwiGLU, vectorised with its own exp, and gpt-oss's gate with biases, each
// rounded where the reference rounds. Compiled per instruction set with the kernel including it.
#pragma once
#include <math.h>

#include "simd.h"

namespace {

#if FT_ISA >= 1
// exp(x) in fp32 (Cephes' expf: 2^n * P(r), |r| <= ln2/2, degree-6 polynomial; within 2 ulp
// of libm on the range SiLU uses; +-inf-safe by clamping). Vector lanes only, no library call.
inline vf vexp(vf x) {
  x = vclamp(x, -87.3f, 88.3f);
  const vf n = vround(vmul(x, vsplat(1.44269504088896341f)));
  vf r = vsub(x, vmul(n, vsplat(0.693359375f)));
  r = vsub(r, vmul(n, vsplat(-2.12194440e-4f)));
  vf p = vsplat(1.9875691500E-4f);
  p = vfma(p, r, vsplat(1.3981999507E-3f));
  p = vfma(p, r, vsplat(8.3334519073E-3f));
  p = vfma(p, r, vsplat(4.1665795894E-2f));
  p = vfma(p, r, vsplat(1.6666665459E-1f));
  p = vfma(p, r, vsplat(5.0000001201E-1f));
  p = vfma(p, vmul(r, r), vadd(r, vsplat(1.f)));
  // 2^n in two halves so n = 128 (x near 88.7) does not overflow the exponent field
  const vf h = vround(vmul(n, vsplat(0.5f)));
  return vmul(vmul(p, vpow2i(h)), vpow2i(vsub(n, h)));
}
#endif

// a[j] = silu(g[j]) * u[j] for j < n, rounding where the reference rounds when x is bf16
// (the gate/up outputs, the SiLU, the product). Vectorised; the same function for every block
// size, so an element's result does not depend on its neighbours.
inline void swiglu_block(const float* g, const float* u, float* a, int64_t n, int xb16) {
  int64_t j = 0;
#if FT_ISA >= 1
  for (; j + VW <= n; j += VW) {
    vf gv = vld(g + j), uv = vld(u + j);
    if (xb16) { gv = vrbf(gv); uv = vrbf(uv); }
    vf s = vdiv(gv, vadd(vsplat(1.f), vexp(vsub(vzero(), gv))));
    if (xb16) s = vrbf(s);
    vf o = vmul(s, uv);
    if (xb16) o = vrbf(o);
#if FT_ISA >= 2
    _mm512_storeu_ps(a + j, o);
#else
    _mm256_storeu_ps(a + j, o);
#endif
  }
  if (j < n) {  // the tail through the same vector code (padded), so no element takes another path
    float gb[VW], ub[VW], ab[VW];
    for (int q = 0; q < VW; ++q) { gb[q] = j + q < n ? g[j + q] : 0.f; ub[q] = j + q < n ? u[j + q] : 0.f; }
    swiglu_block(gb, ub, ab, VW, xb16);
    for (int q = 0; j + q < n; ++q) a[j + q] = ab[q];
  }
#else
  for (; j < n; ++j) {
    float gv = g[j], uv = u[j];
    if (xb16) {
      gv = rbf(gv);
      uv = rbf(uv);
      a[j] = rbf(rbf(gv / (1.f + expf(-gv))) * uv);
    } else {
      a[j] = gv / (1.f + expf(-gv)) * uv;
    }
  }
#endif
}

// gpt-oss's gate: (clamp(u, -l, l) + 1) * g' sigmoid(alpha g') with g' = min(g, l), each op
// rounded to bf16 where the reference (torch in bf16) rounds it.
inline float oai_gate(float g, float u, float alpha, float limit, int xb16) {
  g = g < limit ? g : limit;
  u = u < limit ? (u > -limit ? u : -limit) : limit;
  if (!xb16) return (u + 1.f) * (g * (1.f / (1.f + expf(-(g * alpha)))));
  const float s = rbf(1.f / (1.f + expf(-rbf(g * alpha))));
  return rbf(rbf(u + 1.f) * rbf(g * s));
}

// The activations of m intermediate rows from ib of group g, `stride` token lanes a row
// (og/ou/oa[r * stride + t]) of which the first nt hold tokens: swiglu_block for plain experts;
// with biases or gpt-oss's gate, each row's biases added to the rounded products (rounded again),
// then the gate, per element of the nt lanes.
inline void gated_block(const FtProblem* p, int64_t g, int64_t ib, int64_t m, int stride, int nt, float* og,
                        float* ou, float* oa) {
  if (!p->gate_act && !p->b13) return swiglu_block(og, ou, oa, m * stride, p->x_bf16);
  const int xb16 = p->x_bf16;
  const float* bg = p->b13 ? p->b13 + p->g_bias[g] * p->b13_rs + ib : 0;
  for (int64_t r = 0; r < m; ++r) {
    for (int t = 0; t < nt; ++t) {
      const int64_t at = r * stride + t;
      float gv = og[at], uv = ou[at];
      if (xb16) { gv = rbf(gv); uv = rbf(uv); }
      if (bg) {
        gv += bg[r];
        uv += bg[p->up + r];
        if (xb16) { gv = rbf(gv); uv = rbf(uv); }
      }
      if (p->gate_act == 1) {
        oa[at] = oai_gate(gv, uv, p->alpha, p->limit, xb16);
      } else {
        const float s = xb16 ? rbf(gv / (1.f + expf(-gv))) : gv / (1.f + expf(-gv));
        oa[at] = xb16 ? rbf(s * uv) : s * uv;
      }
    }
  }
}

}  // namespace
