"""The GPU path on a real GPU (``pytest -m gpu tests/gpu``): kernels against the reference in
realistic shapes, the device control step exact against the cache's torch step (fills read from
the pinned bank), a CUDA-graph decode step equal to eager, and the double-buffered streamer."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from freetoken_engine.cache.bank import ExpertBank
from freetoken_engine.cache.device_control import DeviceControl
from freetoken_engine.cache.experts import ExpertCache
from freetoken_engine.cache.prefetch import LayerStreamer
from freetoken_engine.kernels.reference import expert_pairs_forward
from freetoken_engine.kernels.triton.moe import moe_slots_forward

CUDA = torch.device("cuda")
H, I, K = 2048, 768, 8          # Qwen3-30B-A3B expert shape


LAYERS, EXPERTS, HID, INTER = 6, 32, 512, 256


@pytest.fixture(scope="module")
def bank():
    """One pinned bank for the module (registered in place; unregistered at the end, so a later
    allocation reusing its addresses can be registered again)."""
    b = ExpertBank(LAYERS, EXPERTS, HID, INTER, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    b.w13.copy_(torch.randn(b.w13.shape, generator=g) * 0.05)
    b.w2.copy_(torch.randn(b.w2.shape, generator=g) * 0.05)
    b.pin()
    yield b
    torch.cuda.synchronize()
    b.unpin()       # unregisters what was registered in place; a small bank got pinned copies


@pytest.mark.parametrize("tokens", [1, 4, 512])
def test_moe_slots_forward_bf16_matches_reference(tokens):
    slots = 24
    g = torch.Generator(device=CUDA).manual_seed(tokens)
    w13 = (torch.randn(slots, 2 * I, H, device=CUDA, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(slots, H, I, device=CUDA, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(tokens, H, device=CUDA, generator=g).to(torch.bfloat16)
    tok = torch.arange(tokens, device=CUDA).repeat_interleave(K)
    slot = torch.stack([torch.randperm(slots, device=CUDA, generator=g)[:K] for _ in range(tokens)]).flatten()
    out = moe_slots_forward(x, w13, w2, tok, slot)
    ref = expert_pairs_forward(x.float(), w13.float(), w2.float(), tok, slot)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, err


@pytest.mark.parametrize("tokens", [1, 4, 512])
def test_moe_slots_forward_gated_bf16_matches_reference(tokens):
    """gpt-oss's experts (biases by each pair's expert, the clamped gate) in gpt-oss-20b's shape,
    compiled: the reference within the stated 2e-2."""
    from freetoken_engine.kernels.reference import GatedAct
    slots, h, i, k = 12, 2880, 2880, 4
    g = torch.Generator(device=CUDA).manual_seed(tokens)
    w13 = (torch.randn(slots, 2 * i, h, device=CUDA, generator=g) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(slots, h, i, device=CUDA, generator=g) * 0.02).to(torch.bfloat16)
    b13 = torch.randn(32, 2 * i, device=CUDA, generator=g).to(torch.bfloat16)
    x = torch.randn(tokens, h, device=CUDA, generator=g).to(torch.bfloat16)
    tok = torch.arange(tokens, device=CUDA).repeat_interleave(k)
    slot = torch.stack([torch.randperm(slots, device=CUDA, generator=g)[:k] for _ in range(tokens)]).flatten()
    expert = (slot * 5 + 1) % 32
    act = GatedAct("swiglu_oai", 1.702, 7.0)
    out = moe_slots_forward(x, w13, w2, tok, slot, act=act, b13=b13, pair_bias=expert)
    ref = expert_pairs_forward(x.float(), w13.float(), w2.float(), tok, slot, act, b13.float(), expert)
    err = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-2, err


@pytest.mark.parametrize("fill_fraction,bypass", [(1.0, 0), (0.6, 0), (0.6, 4)])
def test_device_control_exact_against_cache_on_gpu(bank, fill_fraction, bypass):
    """Pair slots, residency and counters equal the cache's torch step; with bypass slots the
    refused fills' rows (gathered from the pinned bank into rows past the LRU) equal the bank's."""
    layers = LAYERS
    assert bank.w13.is_pinned()
    ref = ExpertCache(bank, 40, CUDA, fill_fraction=fill_fraction, bypass=bypass)
    dev = ExpertCache(bank, 40, CUDA, fill_fraction=fill_fraction, bypass=bypass)
    ctl = DeviceControl.from_cache(dev)
    g = torch.Generator().manual_seed(1)
    bypassed = 0
    for capacity in (40, 17, 64):
        ctl.write_back(dev)
        ref.resize(capacity)
        dev.resize(capacity)
        ctl.refresh(dev)
        for _ in range(10):
            for layer in range(layers):
                ids = torch.stack([torch.randperm(20, generator=g)[:K] for _ in range(4)]).to(CUDA)
                want = ref.step(layer, ids.reshape(-1))
                assert torch.equal(ctl.step(layer, ids).pair_slot, want)
                byp = want >= dev.lru_slots
                bypassed += int(byp.sum())
                for s, e in zip(want[byp].tolist(), ids.reshape(-1)[byp].tolist()):
                    assert torch.equal(dev.w13[s].cpu(), bank.w13[layer, e])
                    assert torch.equal(dev.w2[s].cpu(), bank.w2[layer, e])
        assert torch.equal(ctl.slot_of, ref.slot_of) and torch.equal(ctl.last_used, ref.last_used)
    assert (bypassed > 0) == (bypass > 0)
    torch.cuda.synchronize()
    ctl.write_back(dev)
    dev.check_integrity(deep=True)          # every resident slot equals its bank rows (gather kernel)
    assert dev.stats == ref.stats


def test_control_mirror_in_pinned_memory(bank):
    """The control step's host mirror (pinned memory written by the kernel) equals its device
    outputs once an event after the step has completed, also inside a CUDA graph."""
    ctl = DeviceControl.from_cache(ExpertCache(bank, 20, CUDA, fill_fraction=0.5))
    ids = torch.zeros(4, K, dtype=torch.int64, device=CUDA)
    mirror = (torch.full((4 * K,), -7, dtype=torch.int64).pin_memory(),
              torch.full((4,), -7, dtype=torch.int64).pin_memory())
    ctl.step(0, ids, mirror=mirror)                    # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ctl.step(1, ids, mirror=mirror)
    g = torch.Generator().manual_seed(5)
    ev = torch.cuda.Event()
    for _ in range(6):
        ids.copy_(torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(4)]))
        graph.replay()
        ev.record()
        ev.synchronize()
        out = ctl.outputs(4 * K)
        assert torch.equal(mirror[0], out.pair_slot.cpu()) and torch.equal(mirror[1], out.step_counts.cpu())
    assert (mirror[0] < 0).any() and (mirror[0] >= 0).any()


def test_cuda_graph_decode_step_equals_eager(bank):
    layers, experts = LAYERS, EXPERTS
    caches = [ExpertCache(bank, 48, CUDA) for _ in range(2)]
    ctls = [DeviceControl.from_cache(c) for c in caches]
    ids = torch.zeros(layers, 4, K, dtype=torch.int64, device=CUDA)
    x0 = torch.randn(4, 512, device=CUDA).to(torch.bfloat16)
    tok = torch.arange(4, device=CUDA).repeat_interleave(K)

    def decode(ctl: DeviceControl) -> torch.Tensor:
        x = x0
        for layer in range(layers):
            out = ctl.step(layer, ids[layer])
            rows = moe_slots_forward(x, ctl.w13_slots, ctl.w2_slots, tok, out.pair_slot)
            x = rows.view(4, K, -1).sum(1)
        return x

    g = torch.Generator().manual_seed(3)
    ids.copy_(torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(layers * 4)]).view(ids.shape))
    decode(ctls[1])                                   # warm-up (compiles) on the graph's twin
    torch.cuda.synchronize()
    ctls[1] = DeviceControl.from_cache(ExpertCache(bank, 48, CUDA))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_graph = decode(ctls[1])
    for _ in range(5):
        ids.copy_(torch.stack([torch.randperm(experts, generator=g)[:K] for _ in range(layers * 4)]).view(ids.shape))
        graph.replay()
        y_eager = decode(ctls[0])
        torch.cuda.synchronize()
        assert torch.equal(y_graph, y_eager)
        assert torch.equal(ctls[0].slot_of, ctls[1].slot_of)
    assert ctls[1].counters() == ctls[0].counters()


def test_layer_streamer_double_buffered_contents(bank):
    layers = LAYERS
    cache = ExpertCache(bank, 30, CUDA)
    for layer in range(layers):                       # make part of each layer resident
        cache.step(layer, torch.arange(layer, layer + 6, device=CUDA))
    streamer = LayerStreamer(bank, CUDA, cache=cache)
    for order in (range(layers), [2, 3, 0]):
        for layer in order:
            w13, w2 = streamer.layer(layer)
            assert torch.equal(w13.cpu(), bank.w13[layer]) and torch.equal(w2.cpu(), bank.w2[layer])
    assert streamer.device_bytes > 0 and streamer.pcie_bytes > 0


def _exact_prefill_pass(experts, bank, g: torch.Generator, tokens: int, rnd: int, between=None) -> torch.Tensor:
    """One prefill-sized call per layer through ``experts`` on random routing (``between(layer)``
    after each): every layer's rows equal the MoE kernel's on the bank's own layer, bit for bit.
    Returns the pass's input."""
    x = (torch.randn(tokens, HID, generator=g) * 0.5).to(torch.bfloat16).to(CUDA)
    tok = torch.arange(tokens, device=CUDA).repeat_interleave(K)
    for layer in range(LAYERS):
        ids = torch.stack([torch.randperm(EXPERTS, generator=g)[:K] for _ in range(tokens)]).to(CUDA)
        got = experts.forward(layer, x, ids)
        if between is not None:
            between(layer)
        want = moe_slots_forward(x, bank.w13[layer].to(CUDA), bank.w2[layer].to(CUDA), tok, ids.reshape(-1))
        assert torch.equal(got, want), (rnd, layer)
    return x


def test_a_pool_with_every_expert_computes_prefill_in_place(bank):
    """A pool with a slot for every expert: a whole-layer call computes the resident experts from
    the pool and streams only the others (nothing copied on the device), bit for bit the rows of
    the whole layer's buffer, and fills the empty slots with what it streamed
    (``DeviceControl.fill_free``): the next pass streams nothing."""
    from freetoken_engine.cache.offload import OffloadedExperts
    cache = ExpertCache(bank, LAYERS * EXPERTS, CUDA, fill_fraction=1.0)
    for layer in range(LAYERS):                       # a third of every layer resident
        cache.step(layer, torch.arange(layer, layer + EXPERTS // 3, device=CUDA) % EXPERTS)
    experts = OffloadedExperts(bank, cache, prefill_threshold=4, cpu_backend="reference", backend="triton", top_k=K)
    g = torch.Generator().manual_seed(5)
    tokens, row_bytes = 16, bank.w13[0, 0].nbytes + bank.w2[0, 0].nbytes
    for rnd in range(2):
        resident = int((cache.slot_of >= 0).sum())
        before = experts.streamer.pcie_bytes
        _exact_prefill_pass(experts, bank, g, tokens, rnd)
        torch.cuda.synchronize()
        assert experts.streamer.device_bytes == 0
        assert experts.streamer.pcie_bytes - before == (LAYERS * EXPERTS - resident) * row_bytes
        assert int((cache.slot_of >= 0).sum()) == LAYERS * EXPERTS     # the pass filled the pool
    assert resident == LAYERS * EXPERTS and experts.filled_free == LAYERS * EXPERTS - LAYERS * (EXPERTS // 3)
    experts.sync_stats()
    cache.check_integrity(deep=True)                  # the filled slots hold the bank's rows


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("seed", ["on", "off"])
def test_prefill_seed_keeps_the_streamed_layers_exact(bank, seed, in_place, monkeypatch):
    """A prefill pass through the engine's MoE path with the double-buffered streamer while the
    seed (cache/offload.py) changes the slot pool after every layer: a small pool whose slots
    hold experts of the later layers (computed from the pool in place, or copied into the
    streamer's buffer on the device), so a seed that evicted one under a queued load, or a stale
    residency snapshot, would hand a layer wrong weights. Every layer's rows equal the reference
    on the bank's own layer."""
    from freetoken_engine.cache.offload import OffloadedExperts
    monkeypatch.setattr(OffloadedExperts, "prefill_in_place", in_place)
    monkeypatch.setenv("FREETOKEN_PREFILL_SEED", seed)
    cache = ExpertCache(bank, 20, CUDA, fill_fraction=0.5)
    for layer in range(LAYERS):                       # part of every layer resident
        cache.step(layer, torch.arange(3 * layer, 3 * layer + 3, device=CUDA) % EXPERTS)
    experts = OffloadedExperts(bank, cache, prefill_threshold=4, cpu_backend="reference", backend="triton", top_k=K)
    g = torch.Generator().manual_seed(3)
    tokens = 16
    for rnd in range(2):                              # the second pass starts from seeded residency
        _exact_prefill_pass(experts, bank, g, tokens, rnd)
    assert (experts.seeded > 0) == (seed == "on")
    experts.control.write_back(cache)
    cache.check_integrity(deep=True)


def test_a_seed_that_evicts_a_queued_layers_cached_experts_puts_them_back(bank, monkeypatch):
    """A prefill computes the cached experts from the pool in place, so the streamer's queued
    load of the next layer leaves them out. The seed after a layer evicts the least recently used
    slots, here exactly that next layer's experts (filled first, plain LRU): the streamer copies
    them into the queued buffer before the layer runs, and every layer's rows stay bit for bit
    the reference's; nothing is copied on the device."""
    from freetoken_engine.cache.offload import OffloadedExperts
    monkeypatch.setenv("FREETOKEN_PREFILL_SEED", "on")
    cache = ExpertCache(bank, 2 * LAYERS, CUDA, fill_fraction=1.0, admit_window=0)
    for layer in [*range(1, LAYERS), 0]:              # layer 1's slots are the least recently used
        cache.step(layer, torch.arange(2, device=CUDA) + 2 * layer)
    experts = OffloadedExperts(bank, cache, prefill_threshold=4, cpu_backend="reference", backend="triton", top_k=K)
    _exact_prefill_pass(experts, bank, torch.Generator().manual_seed(7), 16, 0)
    assert experts.streamer.restored >= 2 and experts.seeded > 0
    assert experts.streamer.device_bytes == 0
    experts.control.write_back(cache)
    cache.check_integrity(deep=True)


@pytest.mark.parametrize("in_place", [True, False])
def test_decode_steps_between_a_prefills_layers_keep_it_exact(bank, in_place, monkeypatch):
    """The scheduler's decode beside a long pass (scheduler/beside.py): after each layer of a
    prefill pass a whole decode step runs (``OffloadedExperts.beside_prefill``), whose fills
    into a small pool evict every slot, the next layer's cached experts among them, under the
    load the streamer has already queued. Every prefill layer's rows stay bit for bit the
    reference's, and the decode steps' rows are the bank's experts' too."""
    from freetoken_engine.cache.offload import OffloadedExperts
    monkeypatch.setattr(OffloadedExperts, "prefill_in_place", in_place)
    monkeypatch.setenv("FREETOKEN_PREFILL_SEED", "off")
    cache = ExpertCache(bank, 2 * LAYERS, CUDA, fill_fraction=1.0, admit_window=0)
    for layer in range(LAYERS):
        cache.step(layer, torch.arange(2, device=CUDA) + 2 * layer)
    experts = OffloadedExperts(bank, cache, prefill_threshold=4, cpu_backend="reference", backend="triton", top_k=K)
    g = torch.Generator().manual_seed(11)
    steps = []

    def decode_step(after: int) -> None:
        with experts.beside_prefill():
            for layer in range(LAYERS):       # two experts no slot holds: every slot turns over
                x = (torch.randn(1, HID, generator=g) * 0.5).to(torch.bfloat16).to(CUDA)
                ids = (torch.arange(K, device=CUDA) + 8 + 2 * (after + len(steps))) % EXPERTS
                rows = experts.forward(layer, x, ids[None])
                want = moe_slots_forward(x, bank.w13[layer].to(CUDA), bank.w2[layer].to(CUDA),
                                         torch.zeros(K, dtype=torch.long, device=CUDA), ids)
                torch.testing.assert_close(rows, want, rtol=2e-2, atol=1e-3)
        steps.append(after)
    for rnd in range(2):
        _exact_prefill_pass(experts, bank, g, 16, rnd, between=decode_step)
    assert len(steps) == 2 * LAYERS
    if in_place:
        assert experts.streamer.restored > 0          # evicted under a queued load, put back
    experts.control.write_back(cache)
    cache.check_integrity(deep=True)
