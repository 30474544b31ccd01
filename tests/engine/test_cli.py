"""The ``freetoken`` command line: the JSON contract and one-line errors with exit code 2."""
from __future__ import annotations

import json
import logging
import re
import os
import shutil
import subprocess
import sys

import pytest

from freetoken_engine.cli import main


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "freetoken_engine.cli", *args],
                          capture_output=True, text=True, timeout=300, env=env)


def _one_line(rc: int, err: str) -> str:
    """A bad input's end: exit 2, one line on stderr, no traceback."""
    assert rc == 2, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err


def one_line_error(r: subprocess.CompletedProcess) -> str:
    return _one_line(r.returncode, r.stderr)


@pytest.fixture
def cli_error(capsys, caplog):
    """``freetoken ARGS`` in this process (a new interpreter costs 5-6 s of imports per case):
    exit 2, one line on stderr, and no warning logged beside it (a process prints those on
    stderr too). One case of each kind also runs as a real process below."""
    def call(*args: str) -> str:
        caplog.set_level(logging.WARNING)
        caplog.clear()
        capsys.readouterr()             # what the test printed before (a fixture's progress bar)
        try:
            rc = main(list(args))
        except SystemExit as exc:       # argparse's errors
            rc = exc.code
        err = _one_line(rc, capsys.readouterr().err)
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
        return err
    return call


def test_generate_json_contract(tiny_checkpoint, capsys):
    folder = tiny_checkpoint("qwen3_moe")
    assert main(["generate", "--model", str(folder), "--prompt", "Paris is", "--max-new-tokens", "6",
                 "--temperature", "0", "--expert-cache-experts", "3", "--cpu-expert-fraction", "0.5",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(out["token_ids"]) <= 6 and isinstance(out["text"], str)
    stats = out["stats"]
    for key in ("prefill_tokens_per_s", "decode_tokens_per_s", "capacity", "hits", "misses", "fills",
                "cpu_computed"):
        assert key in stats
    assert stats["capacity"] == 3 and stats["fills"] + stats["cpu_computed"] == stats["misses"]


def test_generate_follows_a_json_schema_or_a_regex(tiny_checkpoint, tmp_path, capsys):
    folder = tiny_checkpoint("qwen3_moe")
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    for fmt in (["--json-schema", str(tmp_path / "s.json")], ["--json-schema", json.dumps(schema)]):
        assert main(["generate", "--model", str(folder), "--prompt", "Hi", "--max-new-tokens", "20",
                     "--temperature", "1", "--seed", "3", *fmt, "--json"]) == 0
        out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert json.loads(out["text"]) in ({"ok": True}, {"ok": False}) and out["finish_reason"] == "stop"
    assert main(["generate", "--model", str(folder), "--prompt", "Hi", "--max-new-tokens", "20",
                 "--regex", "[0-9]{4}"]) == 0
    assert re.fullmatch(r"[0-9]{4}\n", capsys.readouterr().out)


def test_prompt_ids_are_sent_as_given(tiny_checkpoint, capsys):
    folder = tiny_checkpoint("qwen3_moe")
    main(["generate", "--model", str(folder), "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["stats"]["prompt_tokens"] == 3


def _broken(tmp_path, tiny_checkpoint, kind: str):
    folder = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("qwen3_moe"), folder)
    if kind == "truncated":
        shard = folder / "model.safetensors"
        shard.write_bytes(shard.read_bytes()[:-100])
    elif kind == "missing-shard":
        (folder / "model.safetensors").unlink()
    elif kind == "model-type":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["model_type"] = "gpt_neox_moe"
        (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("kind,needle", [
    ("truncated", "truncated"),
    ("missing-shard", "no *.safetensors"),
    # every family the engine reads, named in order
    ("model-type", "supported: afmoe, axk1, cohere2_moe, deepseek_v2, deepseek_v3, dots1, ernie4_5_moe, "
                   "ernie4_5_vl_moe, exaone_moe, flex_olmo, flint, freetoken_llama_moe, glm4_moe, glm4_moe_lite, "
                   "glm4v_moe, gpt_oss, granite, granite_swa, granitemoe, granitemoe_swa, granitemoehybrid, "
                   "granitemoeshared, hunyuan_v1_moe, hy_v3, kimi_k2, kimi_linear, kolibri1, lfm2_moe, llama, "
                   "llama4, llama4_text, minicpm5_moe, minimax_m2, mistral, mistral3, mistral4, mixtral, olmo2, "
                   "olmo3, olmoe, param2moe, phimoe, qwen2, qwen2_moe, qwen3, qwen3_5_moe, qwen3_5_moe_text, "
                   "qwen3_moe, qwen3_next, qwen3_omni_moe, qwen3_vl_moe, sarvam_mla, sarvam_moe, solar_open"),



])
def test_broken_folders_fail_in_one_line(tmp_path, tiny_checkpoint, cli_error, kind, needle):
    folder = str(_broken(tmp_path, tiny_checkpoint, kind))
    assert needle in cli_error("generate", "--model", folder, "--prompt-ids", "1,2")
    if kind == "truncated":         # and as a process
        assert needle in one_line_error(run("generate", "--model", folder, "--prompt-ids", "1,2"))


def test_missing_shard_named_in_index(tmp_path):
    from tiny_models import make_tiny_checkpoint
    folder = make_tiny_checkpoint(tmp_path, "qwen3_moe", shard_kb=20)
    sorted(folder.glob("model-*.safetensors"))[1].unlink()
    assert "missing weight shard" in one_line_error(run("generate", "--model", str(folder), "--prompt-ids", "1,2"))


@pytest.mark.parametrize("args,needle", [
    (["--model", "/nonexistent/model", "--prompt-ids", "1"], "does not exist"),
    (["--prompt-ids", "1,2,99999"], "outside the vocabulary"),
    (["--prompt-ids", ",".join(["5"] * 600)], "exceeds the context"),
    (["--prompt-ids", "1", "--expert-cache-experts", "0"], "at least 1"),
    (["--prompt-ids", "1", "--expert-cache-experts", "1000"], "larger than the model"),
    (["--prompt-ids", "1", "--expert-cache-gb", "1e-9"], "holds no expert"),
    (["--prompt-ids", "1", "--expert-cache-gb", "inf"], "--expert-cache-gb must be a finite number, got inf"),
    (["--prompt-ids", "1", "--graph-memory-gb", "inf"], "--graph-memory-gb must be a finite number, got inf"),
    (["--prompt-ids", "1", "--cpu-expert-fraction", "1.5"], "within 0..1"),
    (["--prompt-ids", "1", "--graph-warmup", "-1"], "0 or more"),
    (["--prompt-ids", "1", "--graph-warmup-widths", "-2"], "0 (every width) or more"),
    (["--prompt-ids", "1", "--prefill-chunk", "0"], "--prefill-chunk must be at least 1, got 0"),
    (["--prompt-ids", "a,b"], "comma-separated integers"),
    (["--prompt-ids", "1,,2"], "comma-separated integers"),           # a lost id, not skipped
    (["--model", __file__, "--prompt-ids", "1"], "is a file, not a model folder"),
    (["--prompt", "x", "--json-schema", '{"type": "nonsense"}'], "--json-schema: failed to compile JSON schema: Invalid type: nonsense"),
    (["--prompt", "x", "--json-schema", '{"type": '], "--json-schema is not JSON"),
    (["--prompt", "x", "--json-schema", "/no/such/schema.json"], "cannot read /no/such/schema.json"),
    (["--prompt", "x", "--regex", "(a"], "--regex: invalid regex"),
    (["--prompt", "x", "--regex", "a", "--json-schema", "{}"], "not allowed with argument"),
    (["--prompt-ids", "1", "--no-such-flag"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_2(tiny_checkpoint, cli_error, args, needle):
    if "--model" not in args:
        args = ["--model", str(tiny_checkpoint("qwen3_moe")), *args]
    assert needle in cli_error("generate", *args)
    if needle in ("does not exist", "outside the vocabulary", "unrecognized arguments"):   # and as a process
        assert needle in one_line_error(run("generate", *args))


@pytest.mark.parametrize("name,value,needle", [
    ("FREETOKEN_BYPASS_SLOTS", "eight", "FREETOKEN_BYPASS_SLOTS must be an integer >= 0, got 'eight'"),
    ("FREETOKEN_STREAM_SPLIT", "stages", "FREETOKEN_STREAM_SPLIT"),
    ("FREETOKEN_HOST_BRANCH", "yes", "FREETOKEN_HOST_BRANCH"),
    ("FREETOKEN_GPU_DECODE_KERNELS", "attn", "FREETOKEN_GPU_DECODE_KERNELS"),
    ("FREETOKEN_PREFILL_SEED", "true", "FREETOKEN_PREFILL_SEED"),
    ("FREETOKEN_CPU_EXPERT_THREADS", "all", "FREETOKEN_CPU_EXPERT_THREADS must be an integer, got 'all'"),
    ("FREETOKEN_CPU_EXPERT_THREADS", "0", "FREETOKEN_CPU_EXPERT_THREADS must be >= 1, got 0"),
    ("FREETOKEN_PRELOAD", "yes", "FREETOKEN_PRELOAD must be auto, on or off"),
    ("FREETOKEN_FILL_BEHIND", "1", "FREETOKEN_FILL_BEHIND must be on or off"),
])
def test_bad_engine_settings_are_one_line_and_exit_2_on_a_cpu(tiny_checkpoint, cli_error, monkeypatch,
                                                             name, value, needle):
    """GPU-only settings are still parsed on a CPU: a typo fails at start, not on the first GPU."""
    args = ["generate", "--model", str(tiny_checkpoint("qwen3_moe")), "--prompt-ids", "1", "--expert-cache-experts", "4"]
    monkeypatch.setenv(name, value)
    err = cli_error(*args)
    assert needle in err and value in err
    if name == "FREETOKEN_PRELOAD":     # and as a process
        err = one_line_error(run(*args, env={**os.environ, name: value}))
        assert needle in err and value in err


def test_a_bad_setting_fails_before_the_default_model_is_converted(tmp_path):
    """The first run converts the embedded default model (seconds); a bad setting must fail before
    that, in one line, and leave the cache empty."""
    env = {**os.environ, "FREETOKEN_CACHE_DIR": str(tmp_path), "FREETOKEN_CPU_EXPERT_THREADS": "many"}
    r = subprocess.run([sys.executable, "-m", "freetoken_engine.cli", "generate", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 2 and "FREETOKEN_CPU_EXPERT_THREADS must be an integer, got 'many'" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "converting" not in r.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("command,device,needle", [
    ("calibrate", "tpu", "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    ("calibrate", "cuda", "--device cuda was given but no CUDA GPU is available"),
    ("generate", "cuda:x", "--device must be cpu, cuda or cuda:N, got 'cuda:x'"),
    ("generate", "cuda:1", "--device cuda:1 was given but no CUDA GPU is available"),
])
def test_a_device_the_engine_cannot_use_is_one_line(tiny_checkpoint, cli_error, command, device, needle):
    """Every command that takes --device says what to give instead (calibrate ended in a
    traceback for both until 2026-12-04)."""
    if "CUDA GPU" in needle and _cuda_present():
        pytest.skip("this host has a CUDA GPU")
    args = [command, "--device", device]
    if command == "generate":
        args += ["--model", str(tiny_checkpoint("qwen3_moe")), "--prompt-ids", "1"]
    assert needle in cli_error(*args)
    if command == "calibrate" and device == "tpu":        # and as a process
        assert needle in one_line_error(run(*args))


def _cuda_present() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.mark.parametrize("args,needle", [
    (["serve", "--api-key", ""], "--api-key is empty (an unset variable?)"),     # served open, silently
    (["serve", "--admin-token", " "], "--admin-token is empty"),
    (["serve", "--served-model-name", ""], "--served-model-name is empty"),      # served the default name
    (["serve", "--port", "0"], "--port must be within 1..65535, got 0"),          # served on 1919
    (["generate", "--prompt-ids", "1", "--max-context", "-5"], "--max-context must be at least 1 token, got -5"),
    (["generate", "--prompt-ids", "1", "--max-context", "0"], "--max-context must be at least 1 token, got 0"),
])
def test_empty_secrets_and_a_context_below_one_token_are_refused(tiny_checkpoint, cli_error, args, needle):
    assert needle in cli_error(args[0], "--model", str(tiny_checkpoint("qwen3_moe")), *args[1:])


def test_serve_on_a_busy_port_is_one_line_before_the_model_loads(tiny_checkpoint):
    """It loaded the model, then uvicorn failed to bind and the process aborted ('terminate
    called without an active exception', exit 134). Now the address is taken first."""
    import socket
    import time
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen(1)
    port = str(busy.getsockname()[1])
    try:
        t0 = time.monotonic()
        r = run("serve", "--model", str(tiny_checkpoint("qwen3_moe")), "--port", port)
        assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in one_line_error(r)
        assert "pick another --port" in r.stderr
        assert time.monotonic() - t0 < 60
    finally:
        busy.close()
    r = run("serve", "--model", str(tiny_checkpoint("qwen3_moe")), "--host", "10.255.255.254", "--port", port)
    assert "cannot listen on 10.255.255.254" in one_line_error(r)     # an address not on this machine


def test_calibrate_json_contract():
    r = run("calibrate", "--device", "cpu", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["pcie_gbps"] is None and out["cpu_expert_gbps"] > 0 and out["fill_fraction"] == 1.0
    assert out["pcie_path"] is None                 # no PCIe side on a CPU (a GPU: "gather" or "dma")
    assert set(out["concurrent"]) == {"pcie_gbps", "cpu_expert_gbps"}


def test_a_prompt_prefilled_in_small_chunks_gives_the_same_tokens(tiny_checkpoint, capsys, monkeypatch):
    """--prefill-chunk reaches the engine (three-token steps for a twelve-token prompt) and the
    chunking does not change the answer."""
    from freetoken_engine.llm import LLM
    chunks, real = [], LLM._run

    def run(self, ids, chunk=None, slot=-1, **kw):
        chunks.append(self.config.prefill_tokens)
        return real(self, ids, chunk, slot, **kw)

    monkeypatch.setattr(LLM, "_run", run)
    folder = str(tiny_checkpoint("qwen3_moe"))
    answers = []
    for extra in ([], ["--prefill-chunk", "3"]):
        assert main(["generate", "--model", folder, "--prompt-ids", "5,17,99,200,3,44,12,300,8,9,77,150",
                     "--max-new-tokens", "6", "--temperature", "0", "--json", *extra]) == 0
        answers.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["token_ids"])
    assert chunks == [512, 3] and answers[0] == answers[1]


def test_the_prefill_step_is_larger_on_a_gpu_unless_given():
    """A GPU streams the experts its cache lacks once per prefill step, so it prefills in steps
    of 8192 tokens by default (16x fewer streams of an 8k prompt than the CPU's 512); a value the
    user gives is kept on either device."""
    from freetoken_engine.config import EngineConfig
    assert EngineConfig("m").prefill_tokens == 512
    assert EngineConfig("m", device="cuda").prefill_tokens == 8192
    assert EngineConfig("m", device="cuda:1").prefill_tokens == 8192
    assert EngineConfig("m", device="cuda", prefill_chunk=1024).prefill_tokens == 1024
    assert EngineConfig("m", prefill_chunk=64).prefill_tokens == 64


def test_serve_passes_every_engine_option_it_accepts(tmp_path):
    """Each engine option the CLI shares between generate and serve reaches serve's EngineConfig
    and generate's (``--prefill-chunk`` once did not reach serve's: dropped silently)."""
    import argparse

    from freetoken_engine.cli import _add_engine_options
    from freetoken_engine.server.serve import _ENGINE_OPTIONS
    shared = argparse.ArgumentParser()
    _add_engine_options(shared)
    dests = {a.dest for a in shared._actions if a.dest not in ("help", "model")}
    assert dests <= set(_ENGINE_OPTIONS), dests - set(_ENGINE_OPTIONS)
    from freetoken_engine.cli import _engine_kwargs     # and generate's
    assert dests <= set(_engine_kwargs(shared.parse_args([]))), dests - set(_engine_kwargs(shared.parse_args([])))
