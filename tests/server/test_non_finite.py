"""A request whose logits turn NaN (here: its prompt holds a token whose embedding row is NaN)
ends with a clear error through the official clients, while a request batched beside it
completes; the server keeps serving."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file
from tiny_models import copy_folder

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.errors import NonFiniteLogits
from freetoken_engine.executor.inputs import SeqChunk
from freetoken_engine.executor.sampler import make_generator, sample
from live import API_KEY, live_server, start_service

POISON = 7          # this token's embedding row is NaN


@pytest.fixture(scope="module")
def poisoned_dir(tiny_dir, tmp_path_factory):
    folder = copy_folder(tiny_dir, tmp_path_factory.mktemp("poisoned") / "model")
    for shard in folder.glob("*.safetensors"):
        tensors = load_file(str(shard))
        for key, t in tensors.items():
            if key.endswith("embed_tokens.weight"):
                t[POISON] = float("nan")
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("logits", [[0.0, float("nan"), 1.0], [0.0, float("inf")], [float("-inf")] * 3],
                         ids=["nan", "inf", "all-minus-inf"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sampling_non_finite_logits_is_a_clear_error(logits, temperature):
    params = SamplingParams(temperature=temperature)
    with pytest.raises(NonFiniteLogits, match="non-finite logits"):
        sample(torch.tensor(logits), params, make_generator(params, 0))
    ok = torch.tensor([float("-inf"), 2.0, 1.0])            # a masked logit is not an error
    assert sample(ok, params, make_generator(params, 0)) in (1, 2)


def test_a_poisoned_sequence_never_reaches_its_batch_neighbours(poisoned_dir):
    """Sequence A (holding the NaN token) fills KV block 0; then B (3 tokens) and C (8 tokens)
    run as one batch: B's keys are padded to C's length, and padding reads slot 0, A's NaN. Its
    weight is 0, but 0 * NaN is NaN: the padding's values must be zeroed, so B's logits stay
    finite and equal B's logits alone."""
    runner = LLM(poisoned_dir).runner
    bs = runner.kv.block_size
    a = runner.kv.allocate(1)
    assert a == [0]                                           # A's block holds slot 0
    assert not torch.isfinite(runner.forward([SeqChunk(a, 0, [5, POISON, 9])])).all()
    b, c = runner.kv.allocate(1), runner.kv.allocate(-(-8 // bs))
    both = runner.forward([SeqChunk(b, 0, [5, 8, 9]), SeqChunk(c, 0, [11, 12, 13, 14, 15, 16, 17, 18])])
    assert torch.isfinite(both).all()
    alone = runner.forward([SeqChunk(runner.kv.allocate(1), 0, [5, 8, 9])])
    assert torch.allclose(both[0], alone[0], atol=1e-5)
    # decode tokens beside a chunk (Attention._by_sequence): B's next token is padded to C's
    # length among the single tokens; the chunk D attends alone
    d = runner.kv.allocate(1)
    mixed = runner.forward([SeqChunk(b, 3, [4]), SeqChunk(c, 8, [6]), SeqChunk(d, 0, [21, 22, 23, 24])])
    assert torch.isfinite(mixed).all()
    b_alone = runner.forward([SeqChunk(runner.kv.allocate(1), 0, [5, 8, 9, 4])])
    assert torch.allclose(mixed[0], b_alone[0], atol=1e-5)


def test_the_offline_api_raises_it_too(poisoned_dir):
    llm = LLM(poisoned_dir)
    with pytest.raises(NonFiniteLogits):
        llm.generate([5, POISON, 9], SamplingParams(max_new_tokens=2, temperature=0))
    assert len(llm.generate([5, 8, 9], SamplingParams(max_new_tokens=2, temperature=0)).token_ids) == 2


def test_a_nan_request_fails_alone_and_the_server_goes_on(poisoned_dir):
    svc = start_service(poisoned_dir, max_context=512)
    try:
        with live_server(svc, api_key=API_KEY) as srv:
            client = srv.openai()

            def complete(prompt):
                try:
                    return client.completions.create(model=srv.model, prompt=prompt, max_tokens=6,
                                                     temperature=0)
                except openai.APIStatusError as exc:
                    return exc
            with ThreadPoolExecutor(4) as pool:
                bad, good, bad2, good2 = pool.map(complete, [[5, POISON, 9], [5, 8, 9], [POISON], [11, 12]])
            for err in (bad, bad2):
                assert isinstance(err, openai.InternalServerError), err
                assert "non-finite logits" in err.message and "Traceback" not in err.message
            for ok in (good, good2):
                assert not isinstance(ok, Exception), ok
                assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 6
            with pytest.raises(openai.APIError, match="non-finite logits"):   # a stream: an error event
                for _ in client.completions.create(model=srv.model, prompt=[POISON, 5], max_tokens=4, stream=True):
                    pass
            again = client.completions.create(model=srv.model, prompt=[5, 8, 9], max_tokens=6, temperature=0)
            assert again.choices[0].text == good.choices[0].text
    finally:
        svc.shutdown()
