"""Decode steps between the layers of a long prefill pass (scheduler/beside.py): the requests
decoding beside a long prompt get their tokens during its pass instead of one per pass, and every
output stays what it is alone."""
from __future__ import annotations

import pytest
from beside_cases import LAYERS, LONG, SHORT, always_due, count_tokens_inside_long_passes, greedy, run_all

from freetoken_engine import LLM
from freetoken_engine.cli import build_parser
from freetoken_engine.config import EngineConfig
from freetoken_engine.errors import ConfigError
from freetoken_engine.scheduler.beside import DecodePause
from freetoken_engine.scheduler.service import EngineService
from freetoken_engine.server.serve import engine_config

@pytest.fixture(scope="module")
def folder(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def alone(folder):
    llm = LLM(folder)
    return [llm.generate(p, greedy(24)).token_ids for p in SHORT], llm.generate(LONG, greedy(4)).token_ids


async def test_decoders_get_their_tokens_inside_a_long_pass_and_every_output_is_as_alone(folder, alone):
    for pause in (50.0, 0.0):
        svc = EngineService.start(EngineConfig(model=folder, max_batch=4, prefill_chunk=100,
                                               expert_cache_experts=20, cpu_expert_fraction=0.5,
                                               decode_pause_ms=pause), wait=True)
        try:
            if pause:
                always_due(svc)
            inside = count_tokens_inside_long_passes(svc)
            assert await run_all(svc) == alone
            steps = svc.stats()["decode_steps_beside"]
            svc.scheduler.check_integrity()
        finally:
            svc.shutdown()
        # passes of 100 tokens (the short prompts and the long one's first 58), 100, 100 and 42:
        # the last three carry the long prompt beside the three decoders
        assert len(inside) == 4 and inside[0] == (0, 4), inside
        if pause:
            assert steps == 3 * (LAYERS - 1)
            assert inside[1:] == [(3 * (LAYERS - 1), 1)] * 3, inside  # 5 tokens each, during each pass
        else:
            assert steps == 0 and inside[1:] == [(0, 4)] * 3, inside  # they rode in the passes instead


async def test_a_hybrid_models_decoders_step_between_a_long_prompts_layers(tiny_checkpoint):
    """Gated DeltaNet layers (Qwen3.5/3.6): the decoders' recurrent states step between the
    layers of a pass that is writing the long prompt's state and its anchor checkpoints; every
    output is as alone, every state slot comes back."""
    hybrid = tiny_checkpoint("qwen3_5_moe_text", num_hidden_layers=LAYERS)
    llm = LLM(hybrid)
    want = [llm.generate(p, greedy(24)).token_ids for p in SHORT], llm.generate(LONG, greedy(4)).token_ids
    svc = EngineService.start(EngineConfig(model=hybrid, max_batch=4, prefill_chunk=100, decode_pause_ms=50),
                              wait=True)
    try:
        always_due(svc)
        inside = count_tokens_inside_long_passes(svc)
        assert await run_all(svc) == want
        assert svc.stats()["decode_steps_beside"] == 3 * (LAYERS - 1)
        assert inside[1:] == [(3 * (LAYERS - 1), 1)] * 3, inside
        assert svc.stats()["anchor_checkpoints"] > 0
        svc.scheduler.check_integrity()
        assert svc.runner.states.free_slots == svc.runner.states.live
    finally:
        svc.shutdown()


async def test_a_block_a_decoder_needs_inside_a_pass_preempts_a_decoder_never_the_pass(folder, alone):
    # 22 blocks of 16 tokens: the long prompt's 19 and one for each short one. At their 16th
    # token, inside the long prompt's second pass, the decoders need a second block: one of them
    # is pushed back to the queue for it, never the long prompt, whose pass is writing its KV.
    svc = EngineService.start(EngineConfig(model=folder, max_batch=4, prefill_chunk=100, max_context=320,
                                           kv_cache_tokens=352), wait=True)
    sch, victims = svc.scheduler, []
    preempt = sch._preempt

    def recorded(req):
        victims.append(len(req.prompt_ids))
        preempt(req)
    try:
        always_due(svc)
        sch._preempt = recorded
        assert svc.runner.kv.num_blocks == 22
        assert await run_all(svc) == alone
        assert svc.stats()["decode_steps_beside"] > 0
        assert victims and set(victims) == {len(SHORT[0])}, victims     # decoders only
        sch.check_integrity()
    finally:
        svc.shutdown()


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_pause_runs_the_decoders_after_their_wait_and_never_past_a_quarter_of_a_pass():
    clock = Clock()
    pause = DecodePause(0.1, "cpu", clock=clock)
    clock.t = 0.05
    assert not pause.due()                     # 50 ms since their last token
    clock.t = 0.1
    assert pause.due()
    pause.ran(0.3)                             # a slow decode step: 300 ms
    clock.t = 0.95
    assert not pause.due()                     # the pass gets 3 times as long before the next one
    clock.t = 1.0
    assert pause.due()
    pause.ran(0.01)
    clock.t = 1.05
    assert not pause.due()
    pause.tokens()                             # a pass of their own (or one they rode in)
    clock.t = 1.14
    assert not pause.due()
    clock.t = 1.16
    assert pause.due()


def test_the_decoders_ride_in_a_pass_expected_to_be_shorter_than_the_pause():
    pause = DecodePause(0.1, "cpu", clock=Clock())
    assert pause.long(60) and pause.long(4000)       # sizes not seen yet
    pause.passed(60, 0.03)                           # a short prompt's pass: 30 ms
    pause.passed(4000, 0.9)
    assert not pause.long(50) and not pause.long(64)  # about as many tokens: ride
    assert pause.long(65) and pause.long(3000)        # another bucket, or a long one
    pause.passed(60, 0.25)                            # the same size grew slow (a GPU streaming)
    assert pause.long(60)


async def test_decoders_ride_in_short_passes_and_keep_their_tokens(folder, alone):
    """With a 100 ms pause the tiny model's passes are short: once measured, the decoders ride in
    them instead of waiting them out, and the outputs stay as alone."""
    svc = EngineService.start(EngineConfig(model=folder, max_batch=4, prefill_chunk=100, decode_pause_ms=100),
                              wait=True)
    try:
        inside = count_tokens_inside_long_passes(svc)
        assert await run_all(svc) == alone
        steps = svc.stats()["decode_steps_beside"]
    finally:
        svc.shutdown()
    assert svc.scheduler.pause is not None and len(inside) == 4
    # the first pass (100 prompt tokens) measured the size: the later ones carry the decoders
    assert steps == 0 and inside[1:3] == [(0, 4)] * 2, inside


def test_the_option_is_checked_and_reaches_the_server(tmp_path):
    with pytest.raises(ConfigError, match="--decode-pause-ms must be 0"):
        EngineConfig(model=tmp_path, decode_pause_ms=-1)
    args = build_parser().parse_args(["serve", "--model", str(tmp_path), "--decode-pause-ms", "0",
                                      "--prefill-chunk", "1024"])
    cfg = engine_config(args)
    assert cfg.decode_pause_ms == 0 and cfg.prefill_chunk == 1024
    assert engine_config(build_parser().parse_args(["serve", "--model", str(tmp_path)])).decode_pause == 500
    assert EngineConfig(model=tmp_path, device="cuda").decode_pause == 100
