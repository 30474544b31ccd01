"""The whole engine on a real GPU (``pytest -m gpu tests/gpu``): CUDA against transformers on the
CPU, and the cache/offload/q* split leaving the output unchanged on the device.

Tolerances where GPU and CPU arithmetic meet: float32 logits within 1e-3 of transformers on the
CPU (TF32 is off in the engine's float32 path; the difference is summation order), greedy tokens
identical; bfloat16 logits within 0.1 absolute of the float32 reference and the greedy top-1
agreeing on at least 90% of positions. Across cache capacities and q* fractions on the GPU the
greedy tokens are identical (the same kernels compute every pair; fills and CPU pairs only
change where a pair is computed)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from freetoken_engine import LLM, SamplingParams  # noqa: E402
from tiny_models import load_reference  # noqa: E402

PROMPT = [5, 17, 99, 200, 3, 44, 12, 300, 8, 9, 77, 150]
GREEDY = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_cuda_float32_matches_transformers_on_cpu(tiny_checkpoint, model_type):
    folder = tiny_checkpoint(model_type)
    ref = load_reference(folder)
    with torch.no_grad():
        want = ref(torch.tensor([PROMPT])).logits[0]
    llm = LLM(folder, device="cuda", dtype="float32")
    assert (llm.prefill_logits(PROMPT).cpu() - want).abs().max() < 1e-3
    assert (llm.forward_logits(PROMPT).cpu() - want).abs().max() < 1e-3
    ref.generation_config.eos_token_id = None
    hf = ref.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False, pad_token_id=0)
    assert llm.generate(PROMPT, GREEDY).token_ids == hf[0, len(PROMPT):].tolist()


def test_cuda_bfloat16_within_tolerance(tiny_checkpoint):
    folder = tiny_checkpoint("qwen3_moe")
    ref = LLM(folder, device="cpu", dtype="float32").forward_logits(PROMPT)
    got = LLM(folder, device="cuda", dtype="bfloat16").forward_logits(PROMPT).cpu()
    assert (got - ref).abs().max() < 0.1 * max(1.0, ref.abs().max().item())
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_cache_capacity_and_split_do_not_change_tokens_on_gpu(tiny_checkpoint, backend):
    folder = tiny_checkpoint("qwen3_moe")
    want = LLM(folder, device="cuda", dtype="float32", expert_backend=backend).generate(PROMPT, GREEDY).token_ids
    for capacity, fraction in [(1, 0.0), (3, 0.5), (5, 1.0), (16, 0.5)]:
        llm = LLM(folder, device="cuda", dtype="float32", expert_backend=backend,
                  expert_cache_experts=capacity, cpu_expert_fraction=fraction)
        out = llm.generate(PROMPT, GREEDY)
        assert out.token_ids == want, (capacity, fraction)
        assert out.stats["fills"] + out.stats["cpu_computed"] == out.stats["misses"]
        llm.runner.resize_expert_cache(2)
        llm.runner.cache.check_integrity(deep=True)


def _compiled_variants(jit_fn) -> int:
    """How many specialisations Triton has compiled for a kernel, on every device."""
    return sum(len(entry[0]) for entry in jit_fn.device_caches.values())


def test_resizing_the_cache_compiles_no_new_kernel(tiny_checkpoint):
    # A shrink under VRAM pressure happens while requests stream: a Triton compile at that
    # moment (seconds on a GPU) would stall every request. The first H200 pressure run did stall.
    from freetoken_engine.kernels.triton.control import _control_kernel
    folder = tiny_checkpoint("qwen3_moe")
    llm = LLM(folder, device="cuda", dtype="float32", expert_backend="triton", cpu_expert_fraction=0.5)
    total = llm.runner.bank.total_experts
    want = llm.generate(PROMPT, GREEDY).token_ids
    before = _compiled_variants(_control_kernel)
    for capacity in (total - 1, total // 2 + 1, max(2, total // 3), 2, 1, total):  # across powers of two
        llm.runner.resize_expert_cache(capacity)
        assert llm.generate(PROMPT, GREEDY).token_ids == want, capacity
    assert _compiled_variants(_control_kernel) == before


def test_bank_pinned_in_place_unpins_and_pins_again():
    from freetoken_engine.cache.bank import ExpertBank
    bank = ExpertBank(2, 4, 1024, 512, torch.bfloat16)          # 25 MB: registered in place
    ptr = bank.w13.data_ptr()
    bank.pin()
    assert bank.pinned and bank.w13.is_pinned() and bank.w13.data_ptr() == ptr  # no second copy
    bank.unpin()
    del bank
    again = ExpertBank(2, 4, 1024, 512, torch.bfloat16)        # may reuse the same addresses
    again.pin()
    assert again.w13.is_pinned() and again.w2.is_pinned()
    torch.cuda.synchronize()                                    # no sticky CUDA error left behind


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", None)])
def test_decode_projections_run_through_the_triton_gemv_and_agree_with_cublas(tiny_checkpoint, monkeypatch,
                                                                              dtype, tol):
    """Decode steps' q/k/v, output, shared-expert and LM-head projections go through
    kernels/triton/gemv.py (qwen2_moe: biases and a shared expert), and leaving "gemv" out of
    FREETOKEN_GPU_DECODE_KERNELS (torch's F.linear) decodes the same: float32 tokens identical and
    logits within 1e-4; bfloat16 within the module's bf16 tolerance above."""
    from freetoken_engine import env
    from freetoken_engine.kernels import gpu_decode_kernels
    from freetoken_engine.kernels.triton import gemv
    calls = []
    real = gemv.linear

    def counted(x, w, b=None, config=None):
        calls.append(tuple(w.shape))
        return real(x, w, b, config)
    monkeypatch.setattr(gemv, "linear", counted)
    folder = tiny_checkpoint("qwen2_moe")
    runs = {}
    for kernels in ("on", ",".join(k for k in env.GPU_DECODE_KERNELS if k != "gemv")):
        monkeypatch.setenv(env.FREETOKEN_GPU_DECODE_KERNELS, kernels)
        gpu_decode_kernels.cache_clear()
        before = len(calls)
        llm = LLM(folder, device="cuda", dtype=dtype)
        runs[kernels] = (llm.generate(PROMPT, GREEDY).token_ids, llm.forward_logits(PROMPT).cpu(), len(calls) - before)
    gpu_decode_kernels.cache_clear()
    (tok_on, log_on, n_on), (tok_off, log_off, n_off) = runs.values()
    assert n_on > 0 and n_off == 0                 # (the decode graphs call it while they are captured)
    if tol is not None:
        assert tok_on == tok_off
        assert (log_on - log_off).abs().max() < tol * max(1.0, log_off.abs().max().item())
    else:
        assert (log_on - log_off).abs().max() < 0.1 * max(1.0, log_off.abs().max().item())
