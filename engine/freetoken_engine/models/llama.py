"""Dense llama (and the attention + MLP that SmolLM2 uses), and its close kin: Mistral (every
layer within ``sliding_window`` when it is set) and Qwen2/Qwen2.5 (q/k/v biases, Qwen's sliding
layers)."""
from ..config import ModelConfig
from .hf import Family, base, sliding


def parse(raw: dict) -> ModelConfig:
    return ModelConfig(**base(raw))


def parse_mistral(raw: dict) -> ModelConfig:
    window = raw.get("sliding_window")
    return ModelConfig(**base(raw, sliding_window=(window,) * int(raw["num_hidden_layers"]) if window else ()))


def parse_qwen2(raw: dict) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    return ModelConfig(**base(raw, qkv_bias=True, o_bias=False,
                             sliding_window=sliding(raw, layers, bool(raw.get("use_sliding_window")))))


FAMILY = Family("llama", parse)
MISTRAL = Family("mistral", parse_mistral)
QWEN2 = Family("qwen2", parse_qwen2)
