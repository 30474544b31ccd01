"""Driving decode's CPU-branch handshake in tests: a bank of random experts (``random_bank``), the
host loop on a thread next to the 'device' (``HostThread``, CPU tests under TRITON_INTERPRET=1),
and a step captured as a CUDA graph and replayed with the host loop answering it
(``graph_replays``, GPU tests)."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor


def random_bank(layers: int, experts: int, hidden: int, inter: int, dtype, seed: int, scale: float):
    """An ``ExpertBank`` of normal weights times ``scale``, the same for a seed."""
    import torch
    from freetoken_engine.cache.bank import ExpertBank

    bank = ExpertBank(layers, experts, hidden, inter, dtype)
    g = torch.Generator().manual_seed(seed)
    bank.w13.copy_(torch.randn(bank.w13.shape, generator=g) * scale)
    bank.w2.copy_(torch.randn(bank.w2.shape, generator=g) * scale)
    return bank


class HostThread:
    """``CpuBranch.run`` for one step on a thread: the host half next to the 'device' (the test's thread)."""

    def __init__(self, br, timeout_s: float = 60.0, tokens: int | None = None):
        self.error: Exception | None = None

        def body():
            try:
                br.run(timeout_s, tokens)
            except Exception as exc:   # noqa: BLE001  (handed to the test thread)
                self.error = exc

        self.thread = threading.Thread(target=body, daemon=True)   # a failed test must not hang the run
        self.thread.start()

    def join(self) -> None:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the host loop did not finish"
        if self.error is not None:
            raise self.error


def graph_replays(br, step: Callable[[], None], new_inputs: Callable[[int], None], seeds: range) -> Iterator[int]:
    """Run ``step`` once eagerly (it compiles; the host loop answers from a thread), capture it as a
    CUDA graph, then for each seed: ``new_inputs(seed)``, replay, answer with the host loop, sync
    and check the handshake; yields the seed once its step's outputs are ready to compare."""
    import torch

    new_inputs(seeds.start - 1)
    with ThreadPoolExecutor(1) as pool:
        host = pool.submit(br.run, 120.0)
        step()
        host.result()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in seeds:
        new_inputs(seed)
        graph.replay()
        br.run()
        torch.cuda.synchronize()
        br.check()
        yield seed
