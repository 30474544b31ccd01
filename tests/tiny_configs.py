"""Each family's tiny random configuration for ``tiny_models.make_tiny_checkpoint``: the shared
shape (``BASE``), each model type's own keys (``MOE``; ``SUPPORTED`` is every one of them), the
random correction bias of a biased router (``BIAS_STD``), a multimodal family's vision tower
(``VISION``), and transformers' config and model classes (``classes``)."""
from __future__ import annotations

BASE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
MOE = {
    "qwen3_moe": dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, head_dim=8,
                      norm_topk_prob=True),
    "qwen2_moe": dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                      shared_expert_intermediate_size=24),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=16),
    # sigmoid routing with a correction bias (randomised below), 2 groups of 4 experts, the best
    # one kept; a dense first layer; q/k/v biases and q/k norms; rotary over half of each head
    "glm4_moe": dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, head_dim=8,
                     num_hidden_layers=3, first_k_dense_replace=1, n_group=2, topk_group=1,
                     routed_scaling_factor=2.5, attention_bias=True, use_qk_norm=True),
    # the multimodal checkpoint (a one-block vision tower beside it), served as text; its
    # text_config is these fields (make_tiny_checkpoint)
    "qwen3_vl_moe": dict(moe_intermediate_size=24, num_experts=8, num_experts_per_tok=2, head_dim=8,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True}),
    # softmax choice with a correction bias, a dense first layer, one shared expert; interleaved rotary
    "ernie4_5_moe": dict(moe_intermediate_size=16, moe_num_experts=8, moe_k=2, moe_num_shared_experts=1,
                         moe_layer_start_index=1, num_hidden_layers=3),
    "dots1": dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                  n_group=2, topk_group=1, routed_scaling_factor=2.0, first_k_dense_replace=1, num_hidden_layers=3,
                  attention_bias=True, head_dim=8),
    # GLM's routing in every layer, one shared expert, full rotary, no q/k norm
    "solar_open": dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                       n_group=2, topk_group=1, routed_scaling_factor=2.0, head_dim=8),
    # a dense first layer, GLM's routing (its correction bias on the MoE block), a shared expert,
    # per-head q/k norms; sliding-window layers with the rotary beside global ones without it
    "exaone_moe": dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1,
                       n_group=2, topk_group=1, head_dim=8, num_hidden_layers=4, sliding_window=4,
                       sliding_window_pattern=2, first_k_dense_replace=1),
    # q/k norms after the rotary, the rotary's NTK alpha, a shared MLP beside the routed experts
    "hunyuan_v1_moe": dict(intermediate_size=16, num_experts=8, moe_topk=2, head_dim=8,
                           rope_parameters={"rope_type": "dynamic", "alpha": 1000.0, "factor": 1.0,
                                            "rope_theta": 10000.0}),
    # a dense first layer; sigmoid choice with its bias on the MoE block, two shared experts, a
    # route scale; per-head q/k norms, the attention gated by a projection of its own, sliding
    # layers with the rotary beside a global one without; each branch normed before the add
    "afmoe": dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=2,
                  num_dense_layers=1, route_scale=2.0, head_dim=8, num_hidden_layers=4, sliding_window=4,
                  global_attn_every_n_layers=2),
    # GLM-4.5V's language model (GLM-4.5-Air's: a dense first layer, sigmoid routing with its bias,
    # a shared expert, q/k/v biases, rotary over half of each head) beside a one-block vision tower
    "glm4v_moe": dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, head_dim=8,
                      num_hidden_layers=3, first_k_dense_replace=1,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 0],
                                       "partial_rotary_factor": 0.5}),
    # sigmoid choice with a correction bias on the MoE block, q/k norms over the whole projection,
    # rotary over half of each head, Mixtral's expert names. The half is also given as
    # partial_rotary_factor: transformers before 5.25 ignores the hub's rotary_dim (and rotates
    # whole heads, unlike the published model and vLLM)
    "minimax_m2": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, head_dim=8, rotary_dim=4,
                       rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5}),
    # Granite's four multipliers (as published: 12, 1/64, 0.22, 6 at head_dim 64), the router
    # as router.layer, fused experts as input_linear/output_linear; tied embeddings
    "granitemoe": dict(GRANITE := dict(
        num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, embedding_multiplier=6.0,
        attention_multiplier=0.25, residual_multiplier=0.5, logits_scaling=2.0, tie_word_embeddings=True)),
    "granitemoeshared": dict(GRANITE, shared_intermediate_size=24),
    # Granite swash: sliding-window layers beside global ones, a sink per query head (random here:
    # transformers starts them at zero), a rotary base per layer, one layer without position encoding
    "granitemoe_swa": dict(SWASH := dict(num_hidden_layers=4, sliding_window=4,
                                         layer_types=["full_attention", "sliding_attention", "sliding_attention",
                                                      "full_attention"],
                                         layer_rope_theta=[10000.0, 0, 500.0, 10000.0]), **GRANITE),
    "granite": dict(GRANITE_DENSE := dict(embedding_multiplier=6.0, attention_multiplier=0.25, residual_multiplier=0.5,
                                          logits_scaling=2.0, tie_word_embeddings=True)),
    "granite_swa": dict(SWASH, **GRANITE_DENSE),
    "llama": dict(),
    "mistral": dict(sliding_window=4),
    "qwen2": dict(),
    "qwen3": dict(head_dim=8),
    # hybrid: three Gated DeltaNet layers, then a gated attention layer
    "qwen3_next": dict(HYBRID := dict(
        moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, head_dim=8, num_hidden_layers=4,
        shared_expert_intermediate_size=24, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)),
    "qwen3_5_moe_text": dict(HYBRID),
    # hybrid: gated short convolutions (width 3) and attention, a dense first layer, then sigmoid
    # routing with a bias that steers the choice
    "lfm2_moe": dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, head_dim=8, num_hidden_layers=4,
                     num_dense_layers=1, layer_types=["conv", "conv", "full_attention", "conv"], conv_L_cache=3),
    # Granite 4.0-H: Mamba-2 layers (4 heads in 2 groups, state 8, width-3 convolution) beside an
    # attention layer without position encoding; Granite's MoE, shared MLP and multipliers
    "granitemoehybrid": dict(GRANITE, layer_types=["mamba", "attention", "mamba", "mamba"], num_hidden_layers=4,
                             mamba_n_heads=4, mamba_n_groups=2, mamba_d_state=8, mamba_d_conv=3, mamba_expand=2,
                             shared_intermediate_size=24, position_embedding_type="nope"),
    # latent attention: a query bottleneck, a latent of 16 and a rotated key of 4 per token, values
    # narrower than the keys' unrotated part; a dense first layer, GLM's routing, a shared expert
    "deepseek_v3": dict(MLA := dict(num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                    v_head_dim=6), moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=1, first_k_dense_replace=1, num_hidden_layers=3, n_group=2, topk_group=1,
                        routed_scaling_factor=2.5),
    # MiniCPM5-MoE: attention gated per head by q_proj's second half, DeepSeek-V3's routing with a
    # shared expert after a dense first layer
    "minicpm5_moe": dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                         n_group=2, topk_group=1, routed_scaling_factor=2.5, head_dim=8, num_hidden_layers=3,
                         mlp_layer_types=["dense", "sparse", "sparse"]),
    # GLM-4.5's model in Ling's tensor names (one fused query_key_value with its bias, per-head q/k
    # norms, the router's expert_bias), the rotary over the whole head
    "sarvam_moe": dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                       n_group=2, topk_group=1, head_dim=8, num_hidden_layers=3, first_k_dense_replace=1,
                       attention_bias=True),
    "param2moe": dict(moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2,
                      n_group=2, topk_group=1, head_dim=8, num_hidden_layers=3, first_k_dense_replace=1,
                      tie_word_embeddings=True),
    # Kimi-Linear: Kimi Delta Attention layers around one latent attention without position
    # encoding (no query bottleneck); a dense first layer, DeepSeek-V3's routing, a shared expert
    "kimi_linear": dict(MLA, q_lora_rank=None, moe_intermediate_size=16, num_experts=8, num_experts_per_token=2,
                        num_shared_experts=1, num_expert_group=2, topk_group=1, routed_scaling_factor=2.5,
                        linear_num_heads=4, linear_head_dim=8, linear_conv_kernel_dim=3, num_hidden_layers=4,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                        mlp_layer_types=["dense", "sparse", "sparse", "sparse"]),
    # V2-Lite's shape: no query bottleneck; softmax routing within the 2 of 4 groups whose best
    # expert scores highest, two shared experts
    "deepseek_v2": dict(MLA, q_lora_rank=None, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
                        n_shared_experts=2, first_k_dense_replace=1, num_hidden_layers=3, topk_method="group_limited_greedy",
                        n_group=4, topk_group=2, routed_scaling_factor=2.0),
    # GLM-4.7-Flash: the latent attention, GLM's routing, dense layers named by mlp_layer_types
    "glm4_moe_lite": dict(MLA, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                          num_hidden_layers=3, mlp_layer_types=["dense", "sparse", "sparse"], n_group=1, topk_group=1),
    # OLMo 2/3 and FlexOlmo: each branch's output normed before the residual add, q/k norms over the
    # whole projections; OLMo 3's sliding layers with a rotary of their own (the full layers' yarn)
    "olmo2": dict(),
    "olmo3": dict(num_hidden_layers=4, sliding_window=4,
                  layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                  rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=500.0),
                                   "full_attention": dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                          original_max_position_embeddings=128)}),
    "flex_olmo": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=16),
    # Llama 4: one routed expert (its sigmoid weight on its input) beside a shared one every other
    # layer, dense layers of their own size; the other half of the layers without rotary, their
    # queries tempered by position (floor_scale 4: it changes within a prompt); chunks of 4
    "llama4_text": dict(LLAMA4 := dict(intermediate_size=8, intermediate_size_mlp=48, num_hidden_layers=4, head_dim=8,
                                       num_local_experts=8, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                       attention_chunk_size=4, no_rope_layer_interval=2, floor_scale=4,
                                       attn_scale=0.5)),
    # ... as published: the multimodal wrapper (``language_model.*``, a vision tower left unread)
    "llama4": LLAMA4,
    # ERNIE-4.5-VL served as text: text experts (16 wide) then vision experts (8 wide) in each MoE
    # layer, a router and a correction-bias row per set; the 3-D rotary's sections
    "ernie4_5_vl_moe": dict(intermediate_size=64, num_hidden_layers=3, moe_intermediate_size=[16, 8], moe_k=2,
                            moe_num_experts=8, moe_num_shared_experts=1,
                            rope_parameters=dict(rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2])),
    # Cohere's MoE: one LayerNorm (weight only) a layer, attention and MLP side by side; sliding layers
    # rotating Cohere's interleaved pairs, the global ones nothing but the dense prefix's; shared
    # experts averaged with the routed ones; the logits scaled
    "cohere2_moe": dict(intermediate_size=16, prefix_dense_intermediate_size=48, num_hidden_layers=5, num_experts=8,
                        num_experts_per_tok=2, num_shared_experts=1, first_k_dense_replace=1, sliding_window=4,
                        sliding_window_pattern=2, head_dim=8, logit_scale=0.5),
    # Phi-3.5-MoE: LayerNorms with biases, q/k/v/o and LM-head biases, sparsemixer routing (its
    # near-tie masking wide enough here to keep several experts in a softmax), the longrope rotary
    # (short factors below 256 positions, long ones after; mscales as published, one per side)
    "phimoe": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=16, attention_bias=True,
                   lm_head_bias=True, router_jitter_noise=0.2,
                   rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=256,
                                        short_factor=[1.0, 1.3, 2.1, 3.4], long_factor=[1.2, 2.5, 6.0, 11.0],
                                        short_mscale=1.1, long_mscale=1.25)),
    # Mistral 4 (Mistral Small 4): DeepSeek-V3's latent attention and experts, softmax routing over
    # groups without a correction bias, every query scaled by its position (llama_4_scaling_beta)
    # past original_max_position_embeddings (4 here: the prompt crosses it)
    "mistral4": dict(MOE_MISTRAL4 := dict(MLA, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                     first_k_dense_replace=1, num_hidden_layers=3, n_group=2, topk_group=1, routed_scaling_factor=1.5,
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 4, "beta_fast": 32.0, "beta_slow": 1.0,
                                      "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.5})),
    # Flint: Qwen3-MoE's layers with sinks everywhere, the rotary on the sliding layers only, sigmoid
    # top-k routing renormalised, a shared expert without an output gate, two dense first layers
    "flint": dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=24,
                  head_dim=8, num_hidden_layers=4, sliding_window=4),
    # Kolibri: EXAONE 4's attention (NoPE global layers beside sliding ones), GLM-4's four norms, a MoE
    # block in every layer choosing by logits plus a correction bias (randomised below), a shared expert
    "kolibri1": dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, shared_expert_intermediate_size=24,
                     head_dim=8, num_hidden_layers=5, sliding_window=4),
    # Tencent's HY-V3: EXAONE's MoE block (its correction bias on the block, randomised below) behind
    # Llama's attention with per-head q/k norms; a dense first layer
    "hy_v3": dict(moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, num_shared_experts=1, head_dim=8,
                  num_hidden_layers=3, router_scaling_factor=2.0),
    # Sarvam-105B: DeepSeek-V3's model under Sarvam's name (its correction bias randomised below)
    "sarvam_mla": dict(MLA, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                       first_k_dense_replace=1, num_hidden_layers=3, routed_scaling_factor=2.5),
    # SK Telecom's A.X-K1: DeepSeek-V3 with its MoE layers' output normed (a dense first layer)
    "axk1": dict(MLA, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                 num_hidden_layers=3, n_group=2, topk_group=1, routed_scaling_factor=2.5),
    # Mistral Small 4 as published: Mistral 3's multimodal wrapper (a one-layer Pixtral tower) around it
    "mistral3": dict(MOE_MISTRAL4, model_type="mistral4"),
    # gpt-oss: sinks, q/k/v/o biases, sliding layers beside full ones, an untruncated yarn rotary,
    # a router with a bias, experts with biases (randomised below) and the clamped activation, its
    # limit low enough here that the clamps bite; I != H / 2 tells the transposed pair apart
    "gpt_oss": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=24, head_dim=8, sliding_window=4,
                    swiglu_limit=1.0, layer_types=["sliding_attention", "full_attention"],
                    rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, beta_fast=32.0,
                                         beta_slow=1.0, truncate=False, original_max_position_embeddings=128)),
}
SUPPORTED = tuple(MOE)
# the random correction bias of a biased router, on the scale of its scores (sigmoid: 0..1;
# softmax over 8 experts: about 1/8)
BIAS_STD = {"glm4_moe": 0.3, "dots1": 0.3, "solar_open": 0.3, "exaone_moe": 0.3, "afmoe": 0.3, "lfm2_moe": 0.3, "glm4v_moe": 0.3, "ernie4_5_moe": 0.05, "ernie4_5_vl_moe": 0.05, "minimax_m2": 0.3,
            "deepseek_v3": 0.3, "glm4_moe_lite": 0.3, "kimi_linear": 0.3,
            "minicpm5_moe": 0.3, "sarvam_moe": 0.3, "param2moe": 0.3, "sarvam_mla": 0.3, "hy_v3": 0.3, "axk1": 0.3, "kolibri1": 1.0}
# text families transformers' AutoModelForCausalLM does not list (Mistral 4 is published inside
# Mistral 3's multimodal wrapper): their causal-LM class by name
UNLISTED = ("mistral4",)
# multimodal families: their vision tower's config
VISION = {"glm4v_moe": dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=2,
                            temporal_patch_size=1, spatial_merge_size=1, image_size=4),
          "qwen3_vl_moe": dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                               patch_size=2, temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16,
                               deepstack_visual_indexes=[0]),
          "ernie4_5_vl_moe": dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2,
                                  spatial_merge_size=1),
          "mistral3": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                           patch_size=14, head_dim=8),
          "llama4": dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, image_size=28,
                         patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)}


def classes(model_type: str):
    """transformers' (config class, model class) of ``model_type``, looked up by name (an older
    transformers lacks some: only the asked one must exist)."""
    import transformers as T
    names = {
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
        "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
        "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
        "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
        "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
        "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM"),
        "dots1": ("Dots1Config", "Dots1ForCausalLM"),
        "solar_open": ("SolarOpenConfig", "SolarOpenForCausalLM"),
        "exaone_moe": ("ExaoneMoeConfig", "ExaoneMoeForCausalLM"),
        "hunyuan_v1_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM"),
        "afmoe": ("AfmoeConfig", "AfmoeForCausalLM"),
        "glm4v_moe": ("Glm4vMoeConfig", "Glm4vMoeForConditionalGeneration"),
        "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM"),
        "minimax_m2": ("MiniMaxM2Config", "MiniMaxM2ForCausalLM"),
        "qwen3_vl_moe": ("Qwen3VLMoeConfig", "Qwen3VLMoeForConditionalGeneration"),
        "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
        "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM"),
        "granitemoe_swa": ("GraniteMoeSWAConfig", "GraniteMoeSWAForCausalLM"),
        "granite_swa": ("GraniteSWAConfig", "GraniteSWAForCausalLM"),
        "granite": ("GraniteConfig", "GraniteForCausalLM"),
        "llama": ("LlamaConfig", "LlamaForCausalLM"),
        "mistral": ("MistralConfig", "MistralForCausalLM"),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
        "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
        "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
        "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
        "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
        "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM"),
        "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
        "minicpm5_moe": ("MiniCPM5MoeConfig", "MiniCPM5MoeForCausalLM"),
        "sarvam_moe": ("SarvamMoEConfig", "Glm4MoeForCausalLM"),
        "param2moe": ("Param2MoeConfig", "Glm4MoeForCausalLM"),
        "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM"),
        "phimoe": ("PhimoeConfig", "PhimoeForCausalLM"),
        "cohere2_moe": ("Cohere2MoeConfig", "Cohere2MoeForCausalLM"),
        "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM"),
        "ernie4_5_vl_moe": ("Ernie4_5_VLMoeConfig", "Ernie4_5_VLMoeForConditionalGeneration"),
        "llama4": ("Llama4Config", "Llama4ForConditionalGeneration"),
        "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
        "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
        "flex_olmo": ("FlexOlmoConfig", "FlexOlmoForCausalLM"),
        "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
        "mistral4": ("Mistral4Config", "Mistral4ForCausalLM"),
        "mistral3": ("Mistral3Config", "Mistral3ForConditionalGeneration"),
        "sarvam_mla": ("SarvamMLAConfig", "DeepseekV3ForCausalLM"),
        "hy_v3": ("HYV3Config", "HYV3ForCausalLM"),
        "flint": ("FlintConfig", "FlintForCausalLM"),
        "axk1": ("AXK1Config", "AXK1ForCausalLM"),
        "kolibri1": ("Kolibri1Config", "Kolibri1ForCausalLM"),
    }[model_type]
    return tuple(getattr(T, name) for name in names)


#: gpt-oss-20b's published config.json, the fields the engine reads (its KV cache's sizes:
#: test_kv_window.py, bench/kv_window.py)
GPT_OSS_20B = dict(model_type="gpt_oss", hidden_size=2880, num_hidden_layers=24, num_attention_heads=64,
                   num_key_value_heads=8, head_dim=64, num_local_experts=32, experts_per_token=4,
                   intermediate_size=2880, sliding_window=128, max_position_embeddings=131072, vocab_size=201088,
                   rope_theta=150000, swiglu_limit=7.0,
                   rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                     original_max_position_embeddings=4096))
