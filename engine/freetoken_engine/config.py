"""Frozen configuration objects, validated once at the edge.

``ModelConfig`` is the engine's normalised view of a checkpoint's ``config.json`` (each model
family translates its own fields, see ``models/``). ``EngineConfig`` (``run_config.py``, re-exported
here) holds the run options of ``freetoken generate`` / ``serve``. Both raise ``ConfigError`` with a message that says what to
fix; nothing later re-validates them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .errors import ConfigError
from .run_config import DTYPES, SPECULATIVE_METHODS, EngineConfig, check_device  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"            # default | linear | llama3 | yarn | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0      # llama3
    high_freq_factor: float = 4.0     # llama3
    original_max_position: int = 8192  # llama3 / yarn
    beta_fast: float = 32.0           # yarn
    beta_slow: float = 1.0            # yarn
    partial_rotary_factor: float = 1.0
    # yarn's attention factor (the rotary's cos/sin times it): given, or from ``mscale`` over
    # ``mscale_all_dim`` (DeepSeek), else 0.1 ln(factor) + 1; ``truncate``: the correction range
    # rounded outward (False: gpt-oss)
    attention_factor: float | None = None
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    truncate: bool = True
    # longrope (Phi-3.5-MoE): each frequency divided by its ``short_factor`` at positions below
    # ``original_max_position``, by its ``long_factor`` from there on, cos/sin times
    # ``short_mscale`` / ``long_mscale`` (None: the attention factor, given or sqrt(1 + ln(factor)
    # / ln(original)) with factor max_position_embeddings / original)
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    short_mscale: float | None = None
    long_mscale: float | None = None

    @staticmethod
    def from_hf(raw: dict) -> "RopeConfig":
        """Read ``rope_parameters`` (transformers >= 5) or ``rope_theta`` + ``rope_scaling``."""
        params = dict(raw.get("rope_scaling") or {})
        params.update(raw.get("rope_parameters") or {})
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        kind = "longrope" if kind == "su" else kind                 # Phi-3's first name for it
        if kind not in ("default", "linear", "llama3", "yarn", "longrope"):
            raise ConfigError(f"unsupported rope type {kind!r}; supported: default, linear, llama3, yarn, longrope")
        original = params.get("original_max_position_embeddings")
        if kind == "longrope":               # Phi-3.5-MoE writes it beside rope_scaling
            original = original or raw.get("original_max_position_embeddings")
        fields = dict(
            theta=float(theta), type=kind, factor=float(params.get("factor", 1.0) or 1.0),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position=int(original or raw.get("max_position_embeddings", 8192)),
            beta_fast=float(params.get("beta_fast", 32.0)), beta_slow=float(params.get("beta_slow", 1.0)),
            partial_rotary_factor=float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))),
            attention_factor=None if params.get("attention_factor") is None else float(params["attention_factor"]),
            mscale=float(params.get("mscale") or 0.0), mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
            truncate=bool(params.get("truncate", True)),
        )
        if kind == "longrope":
            fields.update(RopeConfig._longrope(params, raw, original))
        return RopeConfig(**fields)

    @staticmethod
    def _longrope(params: dict, raw: dict, original) -> dict:
        """A longrope's own fields; its factors must be lists of numbers of one length."""
        factors = {}
        for name in ("short_factor", "long_factor"):
            value = params.get(name)
            if not isinstance(value, list) or not value or not all(isinstance(v, (int, float)) and v > 0 for v in value):
                raise ConfigError(f"config.json: a longrope rotary needs {name}, a list of positive numbers")
            factors[name] = tuple(float(v) for v in value)
        if len(factors["short_factor"]) != len(factors["long_factor"]):
            raise ConfigError("config.json: longrope's short_factor and long_factor must have one length")
        if not original or int(original) <= 0:
            raise ConfigError("config.json: a longrope rotary needs original_max_position_embeddings")
        if params.get("factor") is None and raw.get("max_position_embeddings"):   # the stretch, for the attention factor
            factors["factor"] = float(raw["max_position_embeddings"]) / float(original)
        scales = {k: float(params[k]) for k in ("short_mscale", "long_mscale") if params.get(k) is not None}
        return factors | scales

    def softmax_scale(self, head_dim: int) -> float:
        """``head_dim ** -0.5``, times yarn's ``mscale_all_dim`` term squared where a scaled rotary
        names one: latent attention scales every dimension's scores by it, not only the rotated
        ones (DeepSeek's reference, transformers' ``yarn_apply_mscale``)."""
        m = 0.1 * self.mscale_all_dim * math.log(self.factor) + 1.0 \
            if self.type != "default" and self.mscale_all_dim and self.factor > 1 else 1.0
        return head_dim ** -0.5 * m * m


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    # softmax | unit (our MoEfied llama: weight 1 per expert) | sigmoid (GLM-4.5, DeepSeek-V3) |
    # sparsemixer (Phi-3.5-MoE: two experts one after the other, each weighted by a softmax over
    # the logits within ``jitter_eps`` of it; layers/moe.py ``sparsemixer``)
    scoring: str = "softmax"
    jitter_eps: float = 0.0
    norm_topk_prob: bool = False
    # a per-expert e_score_correction_bias added to the scores to choose the top k (not to weight
    # them; GLM-4.5, ERNIE-4.5), within the best ``topk_group`` of ``n_group`` expert groups; the
    # weights times routed_scaling_factor, renormalised over max(sum, norm_floor) (0: sum + 1e-20)
    biased: bool = False
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_floor: float = 0.0
    shared_intermediate_size: int = 0  # qwen2_moe shared expert (0 = none)
    shared_gate: bool = False          # sigmoid gate on the shared expert
    # the routing weight scales each routed expert's input, not its output (Llama 4, one expert a
    # token: scoring "sigmoid" over the top logits, no bias)
    scale_input: bool = False
    # the layer's output is the mean of the routed sum and the shared experts', not their sum
    # (Cohere's ``shared_expert_combination_strategy: average``)
    average_shared: bool = False
    layers: tuple[int, ...] = ()       # decoder layers whose MLP is sparse
    # a group's worth, for group-limited choice: the sum of its two best scores ("top2": DeepSeek-V3,
    # GLM) or its best one ("max": DeepSeek-V2's group_limited_greedy)
    group_score: str = "top2"
    # the router's linear layer has a bias (gpt-oss: ``mlp.router.bias``); it is kept in float32
    # whatever the model's dtype (Flint; a biased router always is)
    router_bias: bool = False
    router_fp32: bool = False
    # how an expert turns its gate and up rows into the down projection's input: "silu"
    # (silu(gate) * up) or "swiglu_oai" (gpt-oss: gate clamped above at ``swiglu_limit``, up
    # clamped to +-limit, gate * sigmoid(swiglu_alpha * gate) * (up + 1)); kernels/reference.GatedAct
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # each routed expert's gate/up and down projections have biases (gpt-oss)
    expert_bias: bool = False
    # a biased choice adds the correction bias to the router's logits, not to its scores (Kolibri)
    bias_on_logits: bool = False


@dataclass(frozen=True)
class LinearAttnConfig:
    """A hybrid model's recurrent token mixers. Gated DeltaNet (Qwen3-Next, Qwen3.5/3.6-MoE):
    ``k_heads`` query/key heads of ``k_dim``, ``v_heads`` value heads of ``v_dim`` (a multiple of
    ``k_heads``), and a causal depthwise convolution of width ``conv`` over the projected q, k and
    v. A gated short convolution (``kind`` "short_conv", LFM2: ``short_conv``) keeps only the
    convolution's state, over the hidden size: one "value head" of the hidden size, no keys.
    Mamba-2 (``kind`` "mamba2", Granite 4.0's hybrids): ``v_heads`` heads of ``v_dim`` channels,
    each with an ``[k_dim, v_dim]`` state (k_dim the SSM state size), B and C shared by the heads
    of each of ``k_heads`` groups; the convolution runs over x, B and C. Kimi Delta Attention
    (``kind`` "kda", Kimi-Linear): Gated DeltaNet with ``v_heads`` = ``k_heads`` heads, k_dim =
    v_dim, and a decay per key channel."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv: int
    kind: str = "gated_deltanet"          # gated_deltanet | short_conv | mamba2 | kda
    bias: bool = False                    # short_conv: its projections and convolution have biases; mamba2: its convolution
    proj_bias: bool = False               # mamba2: in_proj and out_proj have biases
    dt_limit: tuple[float, float] = (0.0, math.inf)   # mamba2: the time step's range (time_step_limit)

    @staticmethod
    def short_conv(hidden: int, width: int, bias: bool = False) -> "LinearAttnConfig":
        return LinearAttnConfig(k_heads=0, v_heads=1, k_dim=0, v_dim=hidden, conv=width, kind="short_conv", bias=bias)

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    def state_bytes(self, itemsize: int) -> int:
        """One sequence's recurrent state in one layer: the float32 delta-rule state and the
        convolution's last ``conv - 1`` inputs (in the model's dtype)."""
        return 4 * self.v_heads * self.k_dim * self.v_dim + itemsize * self.conv_dim * (self.conv - 1)


@dataclass(frozen=True)
class LatentAttnConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2, GLM-4.7-Flash): each token's keys and
    values are one ``kv_rank`` latent (normed) and one ``rope_dim`` rotated key shared by every
    head; a head's query has ``nope_dim`` dimensions scored against the latent's up-projection and
    ``rope_dim`` rotated ones, its value ``v_dim`` of the latent's up-projection. Queries come
    through a ``q_rank`` bottleneck (None: one projection). ``interleaved``: the checkpoint's
    rotary pairs dimensions (x0, x1), (x2, x3)... (DeepSeek's layout) rather than halves."""

    kv_rank: int
    nope_dim: int
    rope_dim: int
    v_dim: int
    q_rank: int | None = None
    interleaved: bool = True

    @property
    def cache_dim(self) -> int:
        """One token's cached key: its rotated part, then the latent."""
        return self.rope_dim + self.kv_rank


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # none | head (qwen3) | full (olmoe) | rotated (per head, after the rotary: Hunyuan) | l2
    # (Llama 4: per head after the rotary, no weight, on the rotary layers only)
    qk_norm: str = "none"
    clip_qkv: float | None = None
    sliding_window: tuple[int | None, ...] = ()   # per layer; None = full attention
    # per layer: a query sees only the keys of its own chunk of this many positions (Llama 4's
    # ``attention_chunk_size`` on its rotary layers); None or empty: no chunks
    attention_chunks: tuple[int | None, ...] = ()
    # Llama 4's temperature on the layers without a rotary (``nope_layers``): each query times
    # ``log1p(floor((position + 1) / floor_scale)) * scale + 1``; (floor_scale, scale), or None
    attn_temperature: tuple[float, float] | None = None
    # Mistral 4's scaling of every layer's queries by position (``llama_4_scaling_beta``): each
    # query times ``1 + beta * log1p(floor(position / original_max))``; (original_max, beta), or None
    position_temperature: tuple[float, float] | None = None
    moe: MoeConfig | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # hybrid models: which layers mix tokens by Gated DeltaNet instead of attention (empty: none)
    linear_layers: tuple[int, ...] = ()
    linear: LinearAttnConfig | None = None
    attn_gate: bool = False            # attention output times sigmoid of a gate q_proj also yields
    # multi-token prediction: the layers the checkpoint ships after its own (``mtp.*``; Qwen3-Next's
    # ``num_nextn_predict_layers``, Qwen3.5's ``mtp_num_hidden_layers``), and whether the engine
    # runs one as its speculative drafter (``--speculative-method mtp``): its attention then takes
    # the KV pool's last layer and its routed experts the expert bank's last layer
    mtp_layers: int = 0
    use_mtp: bool = False
    mtp_zero_first: bool = False       # the MTP layer takes a zero embedding at position 0 (GLM, DeepSeek)
    # the attention output times sigmoid of a projection of its own (afmoe's ``self_attn.gate_proj``)
    gate_proj: bool = False
    # each branch's output normed before the residual add (afmoe): ``post_attention_layernorm``
    # and ``post_mlp_layernorm``, with ``pre_mlp_layernorm`` before the MLP
    sandwich_norms: bool = False
    # no norm before the attention or the MLP; each branch's output normed before the residual
    # add instead (OLMo 2/3, FlexOlmo: ``post_attention_layernorm``, ``post_feedforward_layernorm``)
    post_norms: bool = False
    # A.X-K1: the MoE layers' MLP output normed before the residual add (``post_mlp_layernorm``)
    moe_post_norm: bool = False
    # layers whose attention rotates nothing (EXAONE's global layers: "NoPE"); run with the
    # identity rotation, cos 1 and sin 0, through every attention path
    nope_layers: tuple[int, ...] = ()
    # Granite's multipliers: the embeddings times ``embedding_multiplier``; attention scores
    # times ``attention_multiplier`` (None: head_dim ** -0.5); each layer's attention and MLP
    # output times ``residual_multiplier`` before the residual add (folded into the weights that
    # end each branch as they are read: o_proj, down_proj, every routed and shared expert's down);
    # the logits divided by ``logits_scaling``
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # multi-head latent attention: the KV pool then holds one "head" of ``mla.cache_dim`` per
    # token (num_kv_heads 1, head_dim cache_dim), the rotary over its first ``mla.rope_dim``
    mla: LatentAttnConfig | None = None
    # LayerNorm with a bias (mean removed) wherever the others RMS-norm the hidden state: each
    # layer's two norms and the final one (Phi-3.5-MoE); the LM head with a bias
    layer_norm: bool = False
    layer_norm_bias: bool = True         # False: LayerNorm with a weight only (Cohere)
    lm_head_bias: bool = False
    # the attention and the MLP both read the layer's one normed input, their outputs added to
    # the residual together (Cohere: no post-attention norm)
    parallel_block: bool = False
    # a learned logit per query head in every attention softmax's denominator ("attention sinks":
    # Granite swash, gpt-oss): the weights of a query's keys sum to less than one
    attn_sinks: bool = False
    # each layer's rotary where they differ (Granite swash's base per layer, OLMo 3's per layer
    # type); empty: every layer ``rope`` (``nope_layers`` rotate by none either way)
    layer_ropes: tuple[RopeConfig, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError("config.json: num_attention_heads must be a multiple of num_key_value_heads")
        if self.moe is not None:
            self._check_moe(self.moe)
        if self.linear_layers and self.linear is None:
            raise ConfigError("config.json: linear_attention layers need the linear_* head fields")
        if self.linear is not None and self.linear.kind == "gated_deltanet" and self.linear.v_heads % self.linear.k_heads:
            raise ConfigError("config.json: linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.linear is not None and self.linear.kind == "mamba2" and self.linear.v_heads % self.linear.k_heads:
            raise ConfigError("config.json: mamba_n_heads must be a multiple of mamba_n_groups")
        for name in ("embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"config.json: {name} must be a positive number, got {value}")
        if self.layer_ropes and len(self.layer_ropes) != self.num_layers:
            raise ConfigError(f"config.json names the rotary of {len(self.layer_ropes)} layers; the model has "
                              f"{self.num_layers}")
        if self.mla is not None:
            self._check_mla(self.mla)
        elif not 0 < self.rope.partial_rotary_factor <= 1 or int(self.head_dim * self.rope.partial_rotary_factor) % 2:
            raise ConfigError(f"config.json: partial_rotary_factor {self.rope.partial_rotary_factor} must give an "
                              f"even number of the head's {self.head_dim} dimensions")

    def _check_mla(self, a: LatentAttnConfig) -> None:
        for name, hf in (("kv_rank", "kv_lora_rank"), ("nope_dim", "qk_nope_head_dim"),
                         ("rope_dim", "qk_rope_head_dim"), ("v_dim", "v_head_dim")):
            if getattr(a, name) <= 0:
                raise ConfigError(f"config.json: {hf} must be positive, got {getattr(a, name)}")
        if a.rope_dim % 2:
            raise ConfigError(f"config.json: qk_rope_head_dim must be even, got {a.rope_dim}")
        if a.q_rank is not None and a.q_rank <= 0:
            raise ConfigError(f"config.json: q_lora_rank must be positive or null, got {a.q_rank}")
        if (self.num_kv_heads, self.head_dim) != (1, a.cache_dim):
            raise ConfigError("latent attention keeps one KV head of the latent and rotated key")

    @staticmethod
    def _check_moe(m: MoeConfig) -> None:
        if not 1 <= m.top_k <= m.num_experts:
            raise ConfigError(f"config.json: num_experts_per_tok must be in 1..{m.num_experts}")
        if m.scale_input and m.top_k != 1:
            raise ConfigError(f"config.json: routing that scales the experts' input takes one expert a token; "
                              f"num_experts_per_tok is {m.top_k}")
        if m.scoring == "sparsemixer" and m.top_k != 2:
            raise ConfigError(f"config.json: sparsemixer routing picks 2 experts; num_experts_per_tok is {m.top_k}")
        if m.activation not in ("silu", "swiglu_oai"):
            raise ConfigError(f"config.json: expert activation {m.activation!r} is not supported (silu, swiglu_oai)")
        if m.activation == "swiglu_oai" and not (m.swiglu_limit > 0 and math.isfinite(m.swiglu_alpha)):
            raise ConfigError(f"config.json: swiglu_limit must be > 0 and swiglu_alpha a number, got "
                              f"{m.swiglu_limit} and {m.swiglu_alpha}")
        if m.n_group < 1 or m.num_experts % m.n_group:
            raise ConfigError(f"config.json: n_group must divide the {m.num_experts} routed experts, got {m.n_group}")
        per_group = m.num_experts // m.n_group
        if not 1 <= m.topk_group <= m.n_group:
            raise ConfigError(f"config.json: topk_group must be in 1..n_group ({m.n_group}), got {m.topk_group}")
        if m.n_group > 1 and ((per_group < 2 and m.group_score == "top2") or m.top_k > m.topk_group * per_group):
            raise ConfigError(f"config.json: {m.n_group} groups of {per_group} experts, {m.topk_group} of them "
                              f"kept, cannot hold num_experts_per_tok {m.top_k} (groups need 2 experts or more)")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.moe.layers if self.moe else ()

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that hold KV (every layer but the Gated DeltaNet ones)."""
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    @property
    def kv_layers(self) -> int:
        """Layers of the KV pool: the attention layers, and the MTP layer when it runs."""
        return len(self.attention_layers) + self.use_mtp

    @property
    def bank_layers(self) -> int:
        """Layers of the expert bank: the MoE layers, and the MTP layer's when it runs."""
        return len(self.moe_layers) + self.use_mtp

    @property
    def rotary_dim(self) -> int:
        if self.mla is not None:
            return self.mla.rope_dim
        return int(self.head_dim * self.rope.partial_rotary_factor)
