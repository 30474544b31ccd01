"""The packed inputs of a captured decode step carry what the eager step's inputs carry."""
from __future__ import annotations

import numpy as np
import torch

from freetoken_engine.executor.graphs import DecodeGraphs
from freetoken_engine.executor.inputs import SeqChunk, build_inputs, decode_arrays


def test_packed_decode_inputs_match_the_eager_inputs():
    rng = np.random.default_rng(0)
    block = 4
    chunks = []
    for start in (0, 5, 17, 3):
        blocks = rng.permutation(64)[: start // block + 1].tolist()
        chunks.append(SeqChunk(blocks, start, [int(rng.integers(0, 1000))], state=start % 3))
    eager = build_inputs(chunks, block, torch.device("cpu"))
    width = 32
    packed = torch.from_numpy(decode_arrays(chunks, block, width))
    b = len(chunks)
    ids, positions, slots, ends = packed[:4 * b].view(4, b)
    kv_index = packed[4 * b:4 * b + b * width].view(b, width)
    assert torch.equal(packed[4 * b + b * width:], eager.batch.state_index)      # the recurrent-state slots
    assert torch.equal(ids, eager.ids) and torch.equal(positions, eager.batch.positions)
    assert torch.equal(slots, eager.batch.slot_mapping) and torch.equal(ends, eager.batch.kv_len)
    lmax = eager.batch.kv_index.shape[1]
    valid = eager.batch.kv_valid
    assert torch.equal(kv_index[:, :lmax][valid], eager.batch.kv_index[valid])
    assert not kv_index[:, lmax:].any()                     # padding: masked keys at slot 0
    assert torch.equal(torch.arange(width)[None, :lmax] < ends[:, None], valid)


def test_graph_keys_bucket_the_context():
    g = DecodeGraphs.__new__(DecodeGraphs)
    g.enabled, g.max_batch, g.max_context = True, 4, 3000
    assert [g.width(n) for n in (1, 256, 257, 2000, 2999)] == [256, 256, 512, 2048, 3000]
    one = lambda start, n=1: SeqChunk([0], start, [1] * n)   # noqa: E731
    assert g.key([one(9), one(300)]) == (2, 512)
    assert g.key([one(9, n=2)]) is None                      # a prefill chunk: eager
    assert g.key([one(1)] * 5) is None                       # more sequences than captured
    hybrid = lambda start, **kw: SeqChunk([0], start, [1], state=2, **kw)   # noqa: E731
    assert g.key([hybrid(9)]) == (1, 256)
    assert g.key([hybrid(9), hybrid(0)]) is None             # a recurrent state that starts: eager
    assert g.key([hybrid(9, snapshots=((10, 40),))]) is None  # an anchor checkpoint to copy: eager
    g.enabled = False
    assert g.key([one(9)]) is None


def test_warm_up_covers_every_width_a_request_can_reach():
    """``--graph-warmup`` captures each of ``widths()``: every context length must map to one."""
    g = DecodeGraphs.__new__(DecodeGraphs)
    for ctx, want in ((3000, [256, 512, 1024, 2048, 3000]), (4096, [256, 512, 1024, 2048, 4096]), (200, [200])):
        g.max_context = ctx
        assert g.widths() == want
        assert {g.width(n) for n in range(1, ctx + 1)} == set(want)


def test_lockstep_batches_decode_like_each_prompt_alone(tiny_checkpoint):
    """``Lockstep`` (the batched decode the GPU graph tests and bench drive) gives each prompt the
    tokens it gets alone, and returns its KV blocks."""
    from freetoken_engine import LLM, SamplingParams
    from freetoken_engine.llm import Lockstep

    llm = LLM(tiny_checkpoint("qwen3_moe"))
    prompts = [[5, 17, 99, 200, 3], [7], list(range(30, 70))]
    free = llm.runner.kv.free_blocks
    batch = Lockstep(llm, prompts)
    for _ in range(9):
        assert batch.step().shape == (3, llm.runner.mcfg.vocab_size)
    batch.close()
    greedy = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    assert batch.tokens == [llm.generate(p, greedy).token_ids for p in prompts]
    assert llm.runner.kv.free_blocks == free
