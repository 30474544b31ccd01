// AMX-BF16 expert kernels: the stage functions of experts.h for groups of at least
// AMX_MIN_TOKENS tokens (experts.cpp decides; bf16 x, bf16 or MXFP4 weights, H and I multiples
// of 32).
// Compiled once, with -DFT_ISA=3 -mamx-tile -mamx-bf16; called only where cpuid, the OS and the
// process's tile permission say AMX is usable (experts.cpp amx_usable).
//
// C^T[rows, tokens] = W[rows, K] x^T[K, tokens]: the weight rows are the tiles' A operand, loaded
// straight from the bank with the row stride (no repacking); the tokens are the B operand in VNNI
// pairs (x packed in the call's work queue, amx_pack.h; the activations written in that layout
// by stage 1), up to 16
// per block. One fp32 accumulator per (row, token) summed over K in order (tdpbf16ps); the
// rounding points are those of the vector kernels (gate.h swiglu_block, simd.h f2bf), the summation
// order is not, so an AMX group's output can differ from the vector path's in the last bits
// (the same tolerance against the reference). A group's path depends only on its token count,
// never on the thread count or on other groups.
#include "simd.h"
#include "gate.h"
#include "mxfp4.h"

namespace {

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// tmm0: C [m rows, nt tokens] fp32; tmm1: A [m rows, 32 bf16 of K]; tmm2: B [16 pairs, nt tokens].
void configure_tiles(int m, int nt) {
  TileConfig c;
  __builtin_memset(&c, 0, sizeof c);
  c.palette_id = 1;
  c.rows[0] = (uint8_t)m;  c.colsb[0] = (uint16_t)(nt * 4);
  c.rows[1] = (uint8_t)m;  c.colsb[1] = 64;
  c.rows[2] = 16;          c.colsb[2] = (uint16_t)(nt * 4);
  _tile_loadconfig(&c);
}

// out[r * 16 + t] = sum_k w[r][k] x[t][k] for m <= 16 rows at w (row stride rs bytes) and the
// nt-token VNNI block xv (K/2 rows of nt words). Each row is also prefetched pf bytes ahead
// (FtProblem::amx_pf: the next lines within a row, the rows being read 16 at a time side by
// side); with nxt, the next block's nm rows are prefetched into L2 in address order, m lines
// per step of 32 K, so the whole block is under way when its tiles start.
void tile_rows(const char* w, int64_t rs, int m, const uint32_t* xv, int nt, int64_t K, int64_t pf,
               const char* nxt, int nm, float* out) {
  const int64_t lpr = K * 2 / 64;   // 64-byte lines per row (K is a multiple of 32)
  int64_t line = 0;
  _tile_zero(0);
  for (int64_t k = 0; k < K; k += 32) {
    if (pf)
      for (int r = 0; r < m; ++r) prefetch(w + r * rs + k * 2 + pf);
    if (nxt)
      for (int q = 0; q < m && line < nm * lpr; ++q, ++line)
        _mm_prefetch(nxt + (line / lpr) * rs + (line % lpr) * 64, _MM_HINT_T1);
    _tile_loadd(1, w + k * 2, rs);
    _tile_loadd(2, xv + (k / 2) * nt, nt * 4);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, out, 16 * 4);
}

// The bf16 values of the m rows' 32-value block at k (MXFP4 rows, mxfp4.h), as dotq_bf decodes
// them (exact), into tile [16][32].
inline void decode_block(const char* w, int64_t rs, int m, int64_t K, int64_t k, const float* scl, uint16_t* tile) {
  const __m512 lut = _mm512_loadu_ps(kE2M1);
  const __m512i sh = _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28);
  for (int r = 0; r < m; ++r) {
    const uint8_t* blk = (const uint8_t*)(w + r * rs) + k / 2;
    const __m512 ls = _mm512_mul_ps(lut, _mm512_set1_ps(scl[r * (K / 32) + k / 32]));
    const __m512 w0 = _mm512_permutexvar_ps(_mm512_srlv_epi32(mx_bcast(blk), sh), ls);
    const __m512 w1 = _mm512_permutexvar_ps(_mm512_srlv_epi32(mx_bcast(blk + 8), sh), ls);
    _mm512_store_si512((void*)(tile + r * 32), (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
  }
}

// tile_rows for MXFP4 rows (rb bytes a row): each step of 32 K multiplies a block the vector
// units decoded into a bf16 tile in L1 one step before (two tiles in turn: a tile load waits for
// the stores it reads, so the block it loads was written a whole decoding earlier): one decoding
// a block for up to 16 tokens. The m rows are one contiguous run of bytes, and so are the nm
// rows at nxt that the caller takes next: those are prefetched into L2, spread over this block's
// steps. Without it a block read 16 rows' next lines from memory at each fourth step, at the
// memory's latency: 4-8 tokens on a gpt-oss expert ran at 0.93-0.97x of bf16 on the 2-core AMX
// VM, 1.44-1.52x with it (stop 59, bench/mxfp4_experts.py).
void tile_rows_q(const char* w, int64_t rs, int m, const uint32_t* xv, int nt, int64_t K, float* out,
                 const char* nxt, int nm) {
  alignas(64) uint16_t tiles[2][16 * 32];
  float scl[16 * MX_CHUNK];       // the rows' block scales as floats (K <= 32 MX_CHUNK: experts.cpp)
  for (int r = 0; r < m; ++r) mx_scales((const uint8_t*)(w + r * rs) + K / 2, 0, K / 32, scl + r * (K / 32));
  const int64_t lines = nxt ? (nm * rs + 63) / 64 : 0, per = (lines + K / 32 - 1) / (K / 32);
  int64_t line = 0;
  _tile_zero(0);
  decode_block(w, rs, m, K, 0, scl, tiles[0]);
  for (int64_t k = 0, i = 0; k < K; k += 32, i ^= 1) {
    for (int64_t q = 0; q < per && line < lines; ++q, ++line) _mm_prefetch(nxt + line * 64, _MM_HINT_T1);
    if (k + 32 < K) decode_block(w, rs, m, K, k + 32, scl, tiles[i ^ 1]);
    _tile_loadd(1, tiles[i], 64);
    _tile_loadd(2, xv + (k / 2) * nt, nt * 4);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, out, 16 * 4);
}

}  // namespace

extern "C" void ft_stage1_amx(const FtProblem* p, int64_t g, int64_t i0, int64_t i1) {
  const int64_t H = p->H, I = p->I, s = p->g_start[g], n = p->g_count[g];
  const bool mx = p->w_bf16 == 2;                 // MXFP4 rows: strides in bytes
  const char* base = (const char*)p->w13 + p->g_expert[g] * p->w13_es * (mx ? 1 : 2);
  const int64_t rs = p->w13_rs * (mx ? 1 : 2);
  float og[16 * 16], ou[16 * 16], oa[16 * 16];
  int cm = -1, cn = -1;
  for (int64_t tb = 0; tb < n; tb += 16) {
    const int nt = (int)(n - tb < 16 ? n - tb : 16);
    const uint32_t* xv = p->xv + p->g_xv[g] + tb * (H / 2);
    uint16_t* act = p->act_b + (s + tb) * I;
    for (int64_t ib = i0; ib < i1; ib += 16) {
      const int m = (int)(i1 - ib < 16 ? i1 - ib : 16);
      if (m != cm || nt != cn) configure_tiles(cm = m, cn = nt);
      // next: this block's up rows after its gate rows, then the next block's gate rows
      const int nm = (int)(i1 - ib - m < 16 ? i1 - ib - m : 16);
      if (mx) {
        tile_rows_q(base + ib * rs, rs, m, xv, nt, H, og, base + (p->up + ib) * rs, m);
        tile_rows_q(base + (p->up + ib) * rs, rs, m, xv, nt, H, ou, base + (ib + m) * rs, nm);
      } else {
        tile_rows(base + ib * rs, rs, m, xv, nt, H, p->amx_pf, p->amx_next ? base + (p->up + ib) * rs : 0, m, og);
        tile_rows(base + (p->up + ib) * rs, rs, m, xv, nt, H, p->amx_pf, p->amx_next ? base + (ib + m) * rs : 0, nm,
                  ou);
      }
      gated_block(p, g, ib, m, 16, nt, og, ou, oa);
      for (int r = 0; r < m; ++r) {
        const int64_t i = ib + r;
        for (int t = 0; t < nt; ++t) act[(i / 2) * 2 * nt + 2 * t + (i & 1)] = f2bf(oa[r * 16 + t]);
      }
    }
  }
  _tile_release();
}

extern "C" void ft_stage2_amx(const FtProblem* p, int64_t g, int64_t h0, int64_t h1) {
  const int64_t H = p->H, I = p->I, s = p->g_start[g], n = p->g_count[g];
  const bool mx = p->w_bf16 == 2;
  const char* base = (const char*)p->w2 + p->g_expert[g] * p->w2_es * (mx ? 1 : 2);
  const int64_t rs = p->w2_rs * (mx ? 1 : 2);
  float o[16 * 16];
  void* const out = p->out;
  int cm = -1, cn = -1;
  for (int64_t tb = 0; tb < n; tb += 16) {
    const int nt = (int)(n - tb < 16 ? n - tb : 16);
    const uint32_t* av = (const uint32_t*)(p->act_b + (s + tb) * I);
    int64_t dst[16];
    for (int t = 0; t < nt; ++t) dst[t] = p->sorted_pair[s + tb + t] * H;
    for (int64_t hb = h0; hb < h1; hb += 16) {
      const int m = (int)(h1 - hb < 16 ? h1 - hb : 16);
      if (m != cm || nt != cn) configure_tiles(cm = m, cn = nt);
      const int nm = (int)(h1 - hb - m < 16 ? h1 - hb - m : 16);
      if (mx) tile_rows_q(base + hb * rs, rs, m, av, nt, I, o, base + (hb + m) * rs, nm);
      else tile_rows(base + hb * rs, rs, m, av, nt, I, p->amx_pf, p->amx_next ? base + (hb + m) * rs : 0, nm, o);
      for (int t = 0; t < nt; ++t) store_strided(o + t, 16, m, true, (uint16_t*)out + dst[t] + hb);
    }
  }
  _tile_release();
}
