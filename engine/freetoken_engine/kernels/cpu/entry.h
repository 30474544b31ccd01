// The dispatcher's C entry points (experts.cpp) that the library's other baseline units call:
// the GPU decode's CPU branch (branch.cpp) and the fused decode layers (layer.cpp). Each takes
// the dispatcher's call mutex for its own duration.
#pragma once
#include <stdint.h>

#include "experts.h"

extern "C" {

int ft_experts_range(const void* x, int x_bf16, int64_t T, int64_t H, int64_t I,
                     const void* w13, const void* w2, int w_bf16, int64_t E,
                     int64_t w13_es, int64_t w13_rs, int64_t w2_es, int64_t w2_rs,
                     const int64_t* pair_tok, const int64_t* pair_exp, int64_t P, void* out, int64_t i0);
int ft_experts_gated(const void* x, int x_bf16, int64_t T, int64_t H, int64_t I,
                     const void* w13, const void* w2, int w_bf16, int64_t E,
                     int64_t w13_es, int64_t w13_rs, int64_t w2_es, int64_t w2_rs,
                     const int64_t* pair_tok, const int64_t* pair_exp, int64_t P, void* out,
                     int act, float alpha, float limit, const float* b13, int64_t n_bias, const int64_t* pair_bias);
int ft_experts_act(const void* x, int x_bf16, int64_t T, int64_t H, int64_t I,
                   const void* w13, const void* w2, int w_bf16, int64_t E,
                   int64_t w13_es, int64_t w13_rs, int64_t w2_es, int64_t w2_rs,
                   const int64_t* pair_tok, const int64_t* pair_exp, int64_t P, void* act);
int ft_linear(const void* x, int x_bf16, int64_t T, int64_t K, const void* w, int w_bf16,
              int64_t N, int64_t w_rs, const void* bias, void* out);
int ft_rmsnorm(const void* x, int64_t T, int64_t H, const void* w, float eps, int bf16, void* out);
int ft_attn(FtAttn* p);
int ft_combine(const void* rows, const void* w, const void* shared, const void* res, void* out,
               int64_t T, int64_t k, int64_t H, int bf16);
}
