"""Sarvam-105B (``sarvam_mla``): DeepSeek-V3's model under Sarvam's name. Parity with transformers
on a random checkpoint is in the every-family suites; here its first published config's legacy
form, which transformers converts as it reads it and the engine must too."""
from __future__ import annotations

from test_parity import check
from tiny_models import edited_config

from freetoken_engine import LLM


def test_the_legacy_config_form_is_read_as_transformers_reads_it(tiny_checkpoint, tmp_path):
    """A ``rope_scaling`` of type "deepseek_yarn" (yarn, with DeepSeek's mscale_all_dim in every
    score), a ``head_dim`` and a ``q_head_dim`` beside the derived sizes."""
    def legacy(cfg):
        cfg.pop("rope_parameters", None)
        cfg.update(rope_theta=10000.0, head_dim=cfg["qk_rope_head_dim"], q_head_dim=12,
                   rope_scaling={"type": "deepseek_yarn", "factor": 4.0, "original_max_position_embeddings": 4,
                                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0})
    folder = edited_config(tiny_checkpoint("sarvam_mla"), tmp_path / "legacy", legacy)
    check(folder, n_new=12)
    rope = LLM(folder).runner.mcfg.rope
    assert rope.type == "yarn" and rope.factor == 4.0
