"""Chat templates render as transformers renders them: the same text for templates that use
transformers' extras (``{% break %}`` / ``{% continue %}``, ``{% generation %}`` blocks,
``tojson``'s keyword arguments, ``raise_exception``), and a template that does not parse fails
the load with a message naming its line instead of a traceback."""
from __future__ import annotations

import json
import shutil

import pytest

from freetoken_engine.errors import ConfigError, InvalidRequest
from freetoken_engine.models.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Wetter in München?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}]},
            {"role": "tool", "content": "sunny"},
            {"role": "user", "content": "Thanks."}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
TEMPLATES = {
    # the last user turn found by a reversed loop that breaks, system turns skipped by continue
    "loopcontrols": (
        "{%- set ns = namespace(last=0) %}{%- for m in messages[::-1] %}{%- if m.role == 'user' %}"
        "{%- set ns.last = messages | length - loop.index0 - 1 %}{%- break %}{%- endif %}{%- endfor %}"
        "{%- for m in messages %}{%- if m.role == 'system' %}{%- continue %}{%- endif %}"
        "{{- '<|' + m.role + '|>' + (m.content or '') + ('*' if loop.index0 == ns.last else '') + '\\n' }}"
        "{%- endfor %}{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"),
    # assistant turns wrapped in generation blocks, tool calls and tools as JSON with options
    "generation_tojson": (
        "{%- if tools %}{{- tools | tojson(indent=2, sort_keys=true) + '\\n' }}{%- endif %}"
        "{%- for m in messages %}{{- '<|' + m.role + '|>' }}"
        "{%- if m.role == 'assistant' %}{% generation %}{{- m.content }}"
        "{%- for tc in m.tool_calls or [] %}{{- tc.function | tojson(separators=(',', ':')) }}{%- endfor %}"
        "{% endgeneration %}{%- else %}{{- m.content | tojson }}{%- endif %}{{- '\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|assistant|>' }}{%- endif %}"),
}


def _folder(tiny_checkpoint, tmp_path, template: str):
    shutil.copy(tiny_checkpoint("qwen3_moe") / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    return tmp_path


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_templates_render_as_transformers_renders_them(tiny_checkpoint, tmp_path, name):
    folder = _folder(tiny_checkpoint, tmp_path, TEMPLATES[name])
    ours = Tokenizer(folder).apply_chat_template(MESSAGES, TOOLS)
    reference = transformers.PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    theirs = reference.apply_chat_template(MESSAGES, tools=TOOLS, chat_template=TEMPLATES[name], tokenize=False,
                                           add_generation_prompt=True)
    assert ours == theirs
    assert "München" in ours                   # tojson keeps non-ASCII text, as transformers' does


def test_a_template_that_raises_rejects_the_request_with_its_message(tiny_checkpoint, tmp_path):
    template = "{%- if messages[0].role != 'user' %}{{ raise_exception('the first turn must be the user') }}{% endif %}x"
    tok = Tokenizer(_folder(tiny_checkpoint, tmp_path, template))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "x"
    with pytest.raises(InvalidRequest, match="the first turn must be the user"):
        tok.apply_chat_template(MESSAGES)


def test_a_template_that_does_not_parse_fails_the_load_naming_its_line(tiny_checkpoint, tmp_path):
    folder = _folder(tiny_checkpoint, tmp_path, "{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(ConfigError, match=r"chat template in .* does not parse: line 2"):
        Tokenizer(folder)
