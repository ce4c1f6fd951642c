"""``/v1/completions``: raw prompts (text or token ids) for agents that render their own prompts, through the
official ``openai`` client against the real gateway and engine (the shared ``stack`` of test_gateway.py).

Checked: the recorded prompt ids are the text's tokens or the ids as sent; a text that extends the previous prompt +
the sampled tokens continues the segment with those tokens kept (never re-tokenised), one that does not starts a
new segment; a chat call in between is not a continuation; streams equal non-streaming answers; logprobs are the
recorded ones; malformed bodies are 400s naming the field."""

import pytest
from transformers import AutoTokenizer

from tests.middleware.test_gateway import calls, client, http, new_session

PROMPT = "Q: What is 2 + 3?\nA:"


def test_text_prompt_and_its_continuation_keep_the_sampled_tokens(stack, model_dir):
    gw, _ = stack
    s = new_session(gw)
    c = client(s)
    r1 = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3, logprobs=1)
    assert r1.object == "text_completion" and r1.choices[0].finish_reason in ("stop", "length")
    tok = AutoTokenizer.from_pretrained(model_dir)
    [first] = calls(gw, s)
    assert first["prompt_ids"] == tok.encode(PROMPT, add_special_tokens=False)
    lp = r1.choices[0].logprobs
    assert lp.token_logprobs == first["logprobs"] and lp.tokens == [tok.decode([t]) for t in first["completion_ids"]]
    assert lp.text_offset == [len(PROMPT) + len("".join(lp.tokens[:i])) for i in range(len(lp.tokens))]
    assert [len(alternatives) for alternatives in lp.top_logprobs] == [1] * len(lp.tokens)  # logprobs=1: the likeliest
    assert r1.usage.completion_tokens == len(first["completion_ids"])
    # the agent appends to what the model wrote (the sampled tokens, decoded) and asks again
    sampled = tok.decode(first["completion_ids"], skip_special_tokens=False)
    c.completions.create(model="tiny", prompt=PROMPT + sampled + "\nQ: And 4 + 4?\nA:", max_tokens=4, temperature=0)
    second = calls(gw, s)[1]
    assert second["segment_index"] == 0
    assert second["prompt_ids"][:len(first["prompt_ids"]) + len(first["completion_ids"])] == \
        first["prompt_ids"] + first["completion_ids"]
    # a prompt that rewrote the history is a new segment; so is a chat call, then a raw prompt after it
    c.completions.create(model="tiny", prompt="Q: What is 7 + 1?\nA:", max_tokens=2, temperature=0)
    c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    c.completions.create(model="tiny", prompt="Q: What is 7 + 1?\nA: 8", max_tokens=2, temperature=0)
    assert [x["segment_index"] for x in calls(gw, s)] == [0, 0, 1, 2, 3]


def test_token_id_prompts_are_sent_as_they_are(stack, model_dir):
    gw, _ = stack
    s = new_session(gw)
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok.encode(PROMPT, add_special_tokens=False)
    r = client(s).completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0)
    [first] = calls(gw, s)
    visible = first["completion_ids"][:-1] if r.choices[0].finish_reason == "stop" else first["completion_ids"]
    assert first["prompt_ids"] == ids and r.choices[0].text == tok.decode(visible)  # an end-of-turn token is hidden
    client(s).completions.create(model="tiny", prompt=ids + first["completion_ids"] + ids[:3], max_tokens=2,
                                 temperature=0)
    assert [x["segment_index"] for x in calls(gw, s)] == [0, 0]


def test_streamed_completion_equals_the_answer(stack):
    gw, _ = stack
    c = client(new_session(gw))
    whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    pieces = [ch.choices[0] for ch in c.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                                            stream=True) if ch.choices]
    assert "".join(p.text for p in pieces) == whole.choices[0].text
    assert pieces[-1].finish_reason == whole.choices[0].finish_reason and len(pieces) > 2


@pytest.mark.parametrize("body,param", [
    ({}, "prompt"), ({"prompt": ""}, "prompt"), ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 10 ** 9]}, "prompt"), ({"prompt": "x", "echo": True}, "echo"), ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logprobs": 6}, "logprobs"), ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": "x", "suffix": "y"}, "suffix"), ({"prompt": "x", "frequency_penalty": 0.3}, "frequency_penalty"),
])
def test_malformed_completions_are_400s(stack, body, param):
    gw, _ = stack
    s = new_session(gw)
    status, err = http(s["base_url"] + "/completions", body, headers={"Authorization": "Bearer " + s["api_key"]})
    assert status == 400 and err["error"]["param"] == param, err
