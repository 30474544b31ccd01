"""MoEfication of dense checkpoints (the embedded default model)."""
