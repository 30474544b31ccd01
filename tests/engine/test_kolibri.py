"""Kolibri (``kolibri1``): a choice by the router's logits plus a correction bias, weighted by the
chosen logits' sigmoids. Parity with transformers on a random checkpoint is in the every-family
suites; here the routing against transformers' own router, and the GPU's one-launch routing
kernel declining it (its choice adds the bias to the scores)."""
from __future__ import annotations

from dataclasses import replace

import torch
from transformers import Kolibri1Config
from transformers.models.kolibri1.modeling_kolibri1 import Kolibri1TopKRouter

from freetoken_engine.layers.moe import biased_route
from freetoken_engine.models import family


def test_the_choice_is_by_biased_logits_as_transformers_routes():
    torch.manual_seed(0)
    cfg = Kolibri1Config(hidden_size=32, num_experts=16, num_experts_per_tok=4)
    router = Kolibri1TopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape))
        router.e_score_correction_bias.copy_(torch.randn(16) * 2)
    x = torch.randn(64, 32)
    logits, want_w, want_ids = router(x)
    spec = family("kolibri1").parse(cfg.to_dict()).moe
    w, ids = biased_route(logits, router.e_score_correction_bias, spec)
    order = ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), want_ids.sort(dim=-1).values)
    torch.testing.assert_close(w.gather(1, order), want_w.gather(1, want_ids.argsort(dim=-1)), rtol=1e-6, atol=1e-6)
    # the scores' choice (GLM's) picks other experts here: the place of the bias matters
    assert not torch.equal(biased_route(logits, router.e_score_correction_bias, replace(spec, bias_on_logits=False))[1]
                           .sort(dim=-1).values, want_ids.sort(dim=-1).values)


def test_the_gpu_routing_kernel_declines_a_choice_by_logits():
    from freetoken_engine.kernels.triton import route     # (no kernel runs: only its test of the routing)
    spec = family("kolibri1").parse(Kolibri1Config(hidden_size=32, num_experts=16).to_dict()).moe
    logits = torch.randn(4, 16)
    assert not route.supported_biased(logits, spec)
    assert route.supported_biased(logits, replace(spec, bias_on_logits=False))
