"""``freetoken serve --model PACKED``: the CLI starts the bank's read before torch (preload), the
server's loading thread takes it over, and the official client gets the offline engine's tokens."""
from __future__ import annotations

import openai
from procs import serving

from freetoken_engine import LLM, SamplingParams

KEY = "k-packed"
PROMPT = [5, 17, 99, 200, 3]


def test_a_packed_folder_serves_the_engines_tokens(tiny_packed):
    src, out = tiny_packed
    llm = LLM(src)
    want = llm.tokenizer.decode(llm.generate(PROMPT, SamplingParams(max_new_tokens=6, temperature=0)).token_ids)
    with serving(["--model", str(out), "--api-key", KEY, "--served-model-name", "tiny"]) as (url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
        # the server holds back an unfinished UTF-8 sequence at the end (a random model's bytes)
        assert r.choices[0].text == want.rstrip("\ufffd") and r.usage.completion_tokens == 6
