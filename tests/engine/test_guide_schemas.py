"""Random JSON Schemas (hypothesis) through the engine on the tiny random model: every answer
that completes parses and satisfies its schema (checked by the ``jsonschema`` package, an
independent implementation), whatever the model would have written; none raises."""
from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from freetoken_engine import LLM, SamplingParams
from freetoken_engine.executor import guide

NAMES = st.sampled_from(["a", "b", "city", "n", "ok", "tags", "x_1"])
WORDS = st.text(st.sampled_from("abcxyz -_"), min_size=1, max_size=6)

LEAVES = st.one_of(
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
              st.integers(-50, 50), st.integers(0, 100)),
    st.builds(lambda lo: {"type": "number", "minimum": lo, "maximum": lo + 10}, st.integers(-5, 5)),
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 8)),
    st.builds(lambda vs: {"enum": vs}, st.lists(WORDS, min_size=1, max_size=3, unique=True)),
    st.builds(lambda v: {"const": v}, WORDS),
)


def _object(children):
    return st.builds(
        lambda props, req: {"type": "object", "additionalProperties": False, "properties": props,
                            "required": sorted(k for k in props if req.get(k))},
        st.dictionaries(NAMES, children, min_size=1, max_size=3),
        st.dictionaries(NAMES, st.booleans()))


SCHEMAS = st.recursive(LEAVES, lambda children: st.one_of(
    _object(children),
    st.builds(lambda item, n: {"type": "array", "items": item, "minItems": 0, "maxItems": n}, children,
              st.integers(1, 3)),
    st.builds(lambda alts: {"anyOf": alts}, st.lists(children, min_size=2, max_size=2)),
), max_leaves=5)


@pytest.fixture(scope="module")
def llm(tiny_checkpoint):
    return LLM(tiny_checkpoint("qwen3_moe"))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 3))
def test_completed_answers_satisfy_random_schemas(llm, schema, seed):
    spec = guide.GuideSpec(guide.json_schema(schema))
    out = llm.generate([5, 17, 99], SamplingParams(max_new_tokens=120, temperature=1.0, seed=seed, guide=spec))
    text = llm.tokenizer.decode(out.token_ids)
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(text), schema)
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == 120
