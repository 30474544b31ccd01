"""Structured outputs, logit_bias, logprobs and repetition penalties through the official clients
against a live server.

The tiny random checkpoint here has a Qwen3-style template: ``enable_thinking=False`` writes an
empty reasoning block (so the answer starts at once), ``open_thinking=True`` opens one (as
Qwen3.5's does). A random model writes nonsense, so every JSON answer that parses and satisfies
its schema is the grammar's doing.
"""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from live import API_KEY, serving
from tiny_models import CHAT_TEMPLATE, copy_folder

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "ok", "n"],
          "properties": {"city": {"enum": ["Paris", "Rome"]}, "ok": {"type": "boolean"},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
FORMAT = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
MSGS = [{"role": "user", "content": "Which city? Answer in JSON."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
TEMPLATE = CHAT_TEMPLATE.replace(
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- elif open_thinking %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def live(tiny_dir, tmp_path_factory):
    folder = copy_folder(tiny_dir, tmp_path_factory.mktemp("qwen3-style") / "m")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TEMPLATE}))
    with serving(folder, max_context=512) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(live):
    return live.openai()


def chat(client, live, **kw):
    kw.setdefault("messages", MSGS)
    kw.setdefault("max_tokens", 80)
    kw.setdefault("extra_body", NO_THINKING)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model=live.model, **kw)


def token_id(live, text: str) -> int:
    return live.service.tokenizer.token_to_id(text)


def test_json_schema_answers_parse_and_satisfy_the_schema(client, live):
    r = chat(client, live, response_format=FORMAT)
    content = r.choices[0].message.content
    jsonschema.validate(json.loads(content), SCHEMA)
    assert r.choices[0].finish_reason == "stop"
    for seed in range(3):      # sampled answers too
        s = chat(client, live, response_format=FORMAT, temperature=1.0, seed=seed)
        jsonschema.validate(json.loads(s.choices[0].message.content), SCHEMA)
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(
        client, live, response_format=FORMAT, stream=True) if c.choices)
    assert streamed == content
    plain = chat(client, live).choices[0].message.content
    assert plain != content     # without the format, the random model writes something else


def test_json_object_answers_are_objects(client, live):
    r = chat(client, live, response_format={"type": "json_object"}, max_tokens=200)
    content = r.choices[0].message.content
    assert content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_reasoning_stays_free_and_the_answer_follows_the_schema(client, live):
    # the template opens <think>; a bias closes it at once, then the grammar takes over (and
    # masks the biased </think> from then on)
    r = chat(client, live, response_format=FORMAT, logit_bias={str(token_id(live, "</think>")): 100},
             extra_body={"chat_template_kwargs": {"open_thinking": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_logprobs_cover_every_token_and_greedy_picks_the_likeliest(client, live):
    r = chat(client, live, logprobs=True, top_logprobs=3, max_tokens=12)
    entries = r.choices[0].logprobs.content
    assert len(entries) == r.usage.completion_tokens
    for e in entries:
        tops = [t.logprob for t in e.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert e.top_logprobs[0].token == e.token and e.logprob == pytest.approx(tops[0])
    chunks = [c for c in chat(client, live, logprobs=True, top_logprobs=3, max_tokens=12, stream=True)
              if c.choices and c.choices[0].logprobs]
    streamed = [e for c in chunks for e in c.choices[0].logprobs.content or ()]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in entries]
    assert chat(client, live, max_tokens=4).choices[0].logprobs is None


def test_logprobs_of_a_constrained_answer_spell_it(client, live):
    r = chat(client, live, response_format=FORMAT, logprobs=True, top_logprobs=1)
    entries = r.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes) for e in entries).decode() == r.choices[0].message.content
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    # the model's own probabilities: a masked choice can be less likely than the top one
    assert all(e.logprob <= e.top_logprobs[0].logprob + 1e-6 for e in entries)
    assert any(e.logprob < e.top_logprobs[0].logprob for e in entries)


def test_logit_bias_steers_the_answer(client, live):
    plain = chat(client, live, max_tokens=4)
    forced = chat(client, live, max_tokens=4, logit_bias={"77": 100})
    piece = live.service.tokenizer.decode([77])
    assert forced.choices[0].message.content == piece * 4 != plain.choices[0].message.content


def test_completions_regex_choice_and_logprobs(client, live):
    r = client.completions.create(model=live.model, prompt="Code:", max_tokens=20, temperature=1.0, seed=4,
                                  logprobs=2, extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}})
    text = r.choices[0].text
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text), text
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == text and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset) and all(len(t) <= 2 for t in lp.top_logprobs)
    picked = client.completions.create(model=live.model, prompt="Yes or no?", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert picked.choices[0].text in ("yes", "no")


def test_responses_text_format(client, live):
    r = client.responses.create(model=live.model, input="Which city?", temperature=0, max_output_tokens=80,
                                text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}},
                                extra_body=NO_THINKING)
    jsonschema.validate(json.loads(r.output_text), SCHEMA)
    assert r.text.format.type == "json_schema"


def test_anthropic_output_format(live):
    a = live.anthropic()
    m = a.messages.create(model=live.model, max_tokens=80, messages=MSGS,
                          output_config={"format": {"type": "json_schema", "schema": SCHEMA}})
    jsonschema.validate(json.loads(m.content[0].text), SCHEMA)
    beta = a.messages.create(model=live.model, max_tokens=80, messages=MSGS,
                             extra_body={"output_format": {"type": "json_schema", "schema": SCHEMA}})
    assert beta.content[0].text == m.content[0].text


@pytest.mark.parametrize("patch, param, says", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format.json_schema.schema", "nonsense"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "structured_outputs", "one of"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "[unclosed"}}, "structured_outputs.regex", "regex"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "-100..100"),
    ({"logit_bias": {"1000000": 1}}, None, "outside the vocabulary"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
])
def test_bad_formats_and_biases_are_400_saying_what_to_fix(live, patch, param, says):
    body = {"model": live.model, "messages": MSGS, "max_tokens": 4, **patch}
    r = httpx.post(f"{live.url}/v1/chat/completions", json=body, timeout=30,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert says.lower() in err["message"].lower(), err["message"]
    if param is not None:
        assert err["param"] == param


def test_anthropic_bad_schema_is_a_400(live):
    with pytest.raises(Exception) as err:
        live.anthropic().messages.create(model=live.model, max_tokens=8, messages=MSGS,
                                         output_config={"format": {"type": "json_schema",
                                                                   "schema": {"type": "nonsense"}}})
    assert getattr(err.value, "status_code", None) == 400 and "nonsense" in str(err.value)


def test_completions_logprobs_above_five_is_a_400(client, live):
    with pytest.raises(openai.BadRequestError, match="logprobs"):
        client.completions.create(model=live.model, prompt="x", max_tokens=2, logprobs=6)


WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "days"],
           "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
CLOCK = {"type": "object", "additionalProperties": False, "required": ["zone"],
         "properties": {"zone": {"enum": ["UTC", "CET"]}}}


def tools(strict: bool | None = None) -> list[dict]:
    extra = {} if strict is None else {"strict": strict}
    return [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, **extra}},
            {"type": "function", "function": {"name": "get_time", "parameters": CLOCK, **extra}}]


def assert_valid_calls(message, cut: bool = False) -> list[str]:
    """Every call parses and satisfies its schema, but a last one ``cut`` by max_tokens."""
    schemas = {"get_weather": WEATHER, "get_time": CLOCK}
    assert message.tool_calls
    whole = message.tool_calls[:-1] if cut else message.tool_calls
    for call in whole:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    return [c.function.name for c in message.tool_calls]


@pytest.mark.parametrize("seed", range(3))
def test_forced_tool_calls_follow_their_schemas(client, live, seed):
    """tool_choice required or named: the random model's calls parse and satisfy the schema, and
    the answer is calls only (no text after them; one call when parallel calls are off or the
    call is named, the request ending at its close)."""
    required = chat(client, live, tools=tools(), tool_choice="required", temperature=1.0, seed=seed)
    choice = required.choices[0]
    assert choice.finish_reason in ("tool_calls", "length") and not choice.message.content
    assert_valid_calls(choice.message, cut=choice.finish_reason == "length")
    single = chat(client, live, tools=tools(), tool_choice="required", temperature=1.0, seed=seed,
                  parallel_tool_calls=False)
    assert single.choices[0].finish_reason == "tool_calls" and len(assert_valid_calls(single.choices[0].message)) == 1
    named = chat(client, live, tools=tools(), temperature=1.0, seed=seed,
                 tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.choices[0].finish_reason == "tool_calls"
    assert assert_valid_calls(named.choices[0].message) == ["get_time"]


def test_strict_tools_constrain_calls_the_model_opens_itself(client, live):
    bias = {str(token_id(live, "<tool_call>")): 100}     # make the random model open a call
    strict = chat(client, live, tools=tools(strict=True), tool_choice="auto", logit_bias=bias)
    assert_valid_calls(strict.choices[0].message)
    loose = chat(client, live, tools=tools(strict=False), tool_choice="auto", logit_bias=bias)
    assert not loose.choices[0].message.tool_calls      # unconstrained, the random model writes no valid call


def test_anthropic_strict_tool_use(live):
    m = live.anthropic().messages.create(
        model=live.model, max_tokens=80, messages=MSGS, tool_choice={"type": "any"},
        tools=[{"name": "get_weather", "input_schema": WEATHER, "strict": True}])
    uses = [b for b in m.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, WEATHER)
    one = live.anthropic().messages.create(
        model=live.model, max_tokens=80, messages=MSGS,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        tools=[{"name": "get_weather", "input_schema": WEATHER, "strict": True}])
    assert one.stop_reason == "tool_use" and [b.type for b in one.content] == ["tool_use"]


def test_a_strict_tool_whose_schema_cannot_be_used_is_a_400(live):
    bad = [{"type": "function", "function": {"name": "f", "strict": True,
                                             "parameters": {"type": "object", "properties": {"x": {"type": "nonsense"}}}}}]
    r = httpx.post(f"{live.url}/v1/chat/completions", timeout=30, headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"model": live.model, "messages": MSGS, "max_tokens": 4, "tools": bad})
    assert r.status_code == 400 and "nonsense" in r.json()["error"]["message"], r.text


def test_penalties_and_min_p_as_qwen_recommends(client, live):
    """Qwen's model cards recommend presence_penalty up to 1.5-2; vLLM's repetition_penalty and
    min_p are accepted too. Penalised greedy output repeats less, and streams the same."""
    plain = chat(client, live, max_tokens=24, response_format=None).choices[0].message.content
    kw = dict(max_tokens=24, presence_penalty=1.5, frequency_penalty=0.5,
              extra_body={**NO_THINKING, "repetition_penalty": 1.2, "min_p": 0.05})
    penalised = chat(client, live, **kw).choices[0].message.content
    assert penalised != plain
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, live, stream=True, **kw) if c.choices)
    assert streamed == penalised


def test_responses_output_text_logprobs(client, live):
    kw = dict(model=live.model, input="Which city?", temperature=0, max_output_tokens=80, top_logprobs=2,
              include=["message.output_text.logprobs"], extra_body=NO_THINKING,
              text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}})
    r = client.responses.create(**kw)
    part = r.output[-1].content[0]
    assert "".join(e.token for e in part.logprobs) == part.text == r.output_text
    assert all(len(e.top_logprobs) == 2 and e.logprob <= e.top_logprobs[0].logprob + 1e-6 for e in part.logprobs)
    streamed = [e for ev in client.responses.create(stream=True, **kw)
                if ev.type == "response.output_text.delta" for e in ev.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in part.logprobs]
    plain = client.responses.create(**{k: v for k, v in kw.items() if k not in ("top_logprobs", "include")})
    assert plain.output[-1].content[0].logprobs == []


def test_n_choices_are_the_seeded_single_requests(client, live):
    """``n`` choices: choice i is what the same request with ``seed + i`` answers alone, streamed
    or not; the prompt is counted once."""
    kw = dict(max_tokens=12, temperature=1.0, seed=7)
    r = chat(client, live, n=3, **kw)
    got = [c.message.content for c in sorted(r.choices, key=lambda c: c.index)]
    alone = [chat(client, live, **{**kw, "seed": 7 + i}) for i in range(3)]
    assert got == [a.choices[0].message.content for a in alone] and len(set(got)) > 1
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.prompt_tokens == alone[0].usage.prompt_tokens
    streamed = ["", "", ""]
    for c in chat(client, live, n=3, stream=True, **kw):
        for choice in c.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == got
    t = client.completions.create(model=live.model, prompt="Paris", n=2, max_tokens=6, temperature=1.0,
                                  seed=3, logprobs=1)
    assert [c.index for c in t.choices] == [0, 1]
    assert all("".join(c.logprobs.tokens).startswith(c.text) for c in t.choices)
    one = client.completions.create(model=live.model, prompt="Paris", max_tokens=6, temperature=1.0, seed=4)
    assert t.choices[1].text == one.choices[0].text
