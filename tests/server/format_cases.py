"""Shared parts of the tool-format tests whose tags are special tokens (gpt-oss's harmony,
Cohere's, Mistral's): the tiny model folder with the format's template, and the check that the
stream decoder keeps the format's tags for the parser while plain decoding leaves them out."""
from __future__ import annotations

from tiny_models import mark_special, with_template

from freetoken_engine.models.tokenizer import Tokenizer
from freetoken_engine.server.parser import format_tags
from freetoken_engine.server.prompt import tool_style


def format_folder(tiny_checkpoint, tmp_path_factory, model_type: str, template: str, special: tuple[str, ...],
                  added: tuple[str, ...] = ()):
    """A tiny ``model_type`` folder whose chat template is ``template``, with ``special`` as special
    tokens (and ``added`` as plain added ones)."""
    src = tiny_checkpoint(model_type, extra_tags=special + added, max_position_embeddings=2048)
    folder = with_template(src, tmp_path_factory.mktemp(model_type) / "m", template)
    for tag in special:
        mark_special(folder, tag)
    return folder


def special_tags_reach_the_parser(folder, style: str, answer: str, hidden: str) -> None:
    """The template's format is ``style``; decoding ``answer`` leaves its tag ``hidden`` out, and the
    stream decoder with the format's tags gives the answer back whole."""
    tokenizer = Tokenizer(folder)
    assert tool_style(tokenizer) == style
    ids = tokenizer.encode(answer, add_special_tokens=False)
    assert hidden not in tokenizer.decode(ids)
    decoder = tokenizer.stream_decoder(format_tags(style))
    assert "".join(decoder.step(i) for i in ids) == answer


def answered_without_tools(srv) -> tuple[str | None, str | None]:
    """(reasoning, content) of an OpenAI chat answer to a request without tools: what a format
    whose tags tell the two apart must keep them apart by, tools or not."""
    msg = srv.openai().chat.completions.create(model=srv.model, messages=[
        {"role": "user", "content": "Thanks, that is all."}]).choices[0].message
    return msg.reasoning_content, msg.content
