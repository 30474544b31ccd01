"""The `models:` list (FreeTokenNode.spec or a standalone file): validation and file watching."""

import os

import pytest

from freetoken_agent.assignments import AssignmentError, StandaloneFile, parse_models

GOOD = {"key": "default.m", "namespace": "default", "model": "m", "source": {"path": "/models/q"},
        "format": "safetensors", "port": 1919,
        "engine": {"device": "cuda", "dtype": "bfloat16", "expertCacheShare": 0.5, "contextLength": 4096},
        "apiKeySecret": {"name": "s", "key": "k"}}


def test_contract_example_parses():
    [a] = parse_models([GOOD]).values()
    assert (a.key, a.path, a.port, a.engine.device, a.engine.expert_cache_share) == (
        "default.m", "/models/q", 1919, "cuda", 0.5)
    assert a.api_key_secret == ("s", "k")


def test_defaults_for_the_embedded_model():
    [a] = parse_models([{"model": "tiny", "port": 2000}]).values()
    assert (a.key, a.path, a.format, a.engine.device) == ("default.tiny", None, "default", "cpu")


@pytest.mark.parametrize("patch,message", [
    ({"port": 0}, "port"), ({"port": "80"}, "port"), ({"format": "onnx"}, "format"),
    ({"engine": {"device": "tpu"}}, "device"), ({"engine": {"expertCacheShare": 1.5}}, "expertCacheShare"),
    ({"source": {}}, "source"), ({"model": ""}, "model"), ({"apiKeySecret": {"name": "s"}}, "apiKeySecret"),
    ({"engine": {"features": {"decodePauseMs": -1}}}, "decodePauseMs"),
    ({"engine": {"features": {"decodePauseMs": "fast"}}}, "decodePauseMs"),
    ({"engine": {"features": {"prefillChunk": 0}}}, "prefillChunk"),
    ({"engine": {"features": {"prefillChunk": 1.5}}}, "prefillChunk"),
    ({"engine": {"features": {"stateCheckpoints": -1}}}, "stateCheckpoints"),
    ({"engine": {"features": {"speculativeTokens": 17}}}, "speculativeTokens"),
    ({"engine": {"features": {"speculativeTokens": True}}}, "speculativeTokens"),
    ({"engine": {"features": {"speculativeTokens": 4, "speculativeMethod": "eagle"}}}, "speculativeMethod"),
    ({"engine": {"features": {"speculativeMethod": "mtp"}}}, "speculativeMethod mtp needs speculativeTokens"),
    ({"engine": {"features": {"speculativeMethod": "mtp", "speculativeTokens": 0}}}, "speculativeMethod mtp"),
    ({"engine": {"features": [1]}}, "features"),
    ({"source": {"path": "/m", "url": "https://h/m.gguf"}}, "exactly one of .* got path and url"),
    ({"source": {"url": "ftp://h/m.gguf"}}, "source.url must be an http"),
    ({"source": {"url": "https://h/m.gguf", "sha256": "ABC"}}, "sha256 must be 64 lowercase hex"),
    ({"source": {"default": True, "sha256": "a" * 64}}, "sha256 checks a downloaded or local file"),
    ({"source": {"pvc": {"claimName": "c"}}}, "source.pvc is not supported"),
])
def test_bad_entries_are_rejected_with_the_field_named(patch, message):
    with pytest.raises(AssignmentError, match=message):
        parse_models([{**GOOD, **patch}])


def test_a_url_source_with_its_sha256():
    digest = "0123456789abcdef" * 4
    [a] = parse_models([{**GOOD, "source": {"url": "https://h.example/q.tar", "sha256": digest}}]).values()
    assert (a.path, a.url, a.sha256, a.format) == (None, "https://h.example/q.tar", digest, "safetensors")
    [b] = parse_models([{**GOOD, "source": {"path": "/models/q.gguf", "sha256": digest}}]).values()
    assert (b.path, b.url, b.sha256) == ("/models/q.gguf", None, digest)


def test_speculative_method_defaults_to_ngram():
    def method(features):
        [a] = parse_models([{**GOOD, "engine": {**GOOD["engine"], "features": features}}]).values()
        return a
    assert parse_models([GOOD])["default.m"].engine.speculative_method == "ngram"
    assert method({"speculativeTokens": 4}).engine.speculative_method == "ngram"
    # an explicit default (what the API server fills in) is the same assignment: no engine restart
    assert method({"speculativeTokens": 4, "speculativeMethod": "ngram"}) == method({"speculativeTokens": 4})
    assert method({"speculativeTokens": 2, "speculativeMethod": "mtp"}).engine.speculative_method == "mtp"


def test_duplicate_keys_rejected():
    with pytest.raises(AssignmentError, match="duplicate"):
        parse_models([GOOD, GOOD])


def test_standalone_file_is_watched_and_keeps_last_good(tmp_path):
    f = tmp_path / "models.yaml"
    f.write_text("models:\n- model: a\n  port: 2001\n")
    src = StandaloneFile(str(f))
    assert list(src.read()) == ["default.a"]
    f.write_text("models:\n- model: a\n  port: 2001\n- model: b\n  port: 2002\n")
    os.utime(f, ns=(2 * 10**18, 2 * 10**18))
    assert sorted(src.read()) == ["default.a", "default.b"] and src.error is None
    f.write_text("models: [ {model: c, port: nope} ]\n")
    os.utime(f, ns=(3 * 10**18, 3 * 10**18))
    assert sorted(src.read()) == ["default.a", "default.b"]  # a typo does not stop engines
    assert "port" in src.error
    f.write_text("models: []\n")
    os.utime(f, ns=(4 * 10**18, 4 * 10**18))
    assert src.read() == {} and src.error is None
