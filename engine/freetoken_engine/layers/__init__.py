"""Building blocks that model files compose: norms, rotary embedding, paged attention, MLPs, MoE."""
