"""vLLM's `guided_*` request fields on the `structured_outputs` path, and oversized or
malformed specs as 400s naming the field (never a 500), over the in-process server of
tests/test_structured_api.py (embedded model, k = 2)."""

from __future__ import annotations

import json

import jsonschema
import pytest
from test_structured_api import MSGS, PERSON, client, engine, http, server, server_state  # noqa: F401

from mtpserve.workers.structured.spec import MAX_SPEC_CHARS

BIG = MAX_SPEC_CHARS + 10


def test_guided_fields_constrain_the_output(client):  # noqa: F811
    kw = dict(model="tiny-code-mtp", max_tokens=48, temperature=0)
    r = client.completions.create(prompt="def f(x):", extra_body={
        "guided_choice": ["yes", "no"]}, **kw)
    assert r.choices[0].text in ("yes", "no")
    r = client.chat.completions.create(messages=MSGS, extra_body={
        "guided_regex": "[0-9]{3}"}, **kw)
    assert len(r.choices[0].message.content) == 3 and r.choices[0].message.content.isdigit()
    r = client.chat.completions.create(messages=MSGS, extra_body={"guided_json": PERSON},
                                       max_tokens=120, model="tiny-code-mtp", temperature=0)
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.chat.completions.create(messages=MSGS, extra_body={
        "guided_grammar": 'root ::= "ab" | "cd"', "guided_decoding_backend": "xgrammar"}, **kw)
    assert r.choices[0].message.content in ("ab", "cd")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ("/v1/chat/completions", {"guided_regex": "a", "structured_outputs": {"regex": "b"}},
     "guided_regex"),
    ("/v1/completions", {"guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/completions", {"guided_regex": "a", "guided_decoding_backend": "outlines"},
     "guided_decoding_backend"),
    ("/v1/completions", {"guided_choice": "yes"}, "guided_choice"),
    ("/v1/completions", {"guided_json": "{not json"}, "guided_json"),
    ("/v1/chat/completions", {"guided_regex": "a" * BIG}, "guided_regex"),
    ("/v1/completions", {"guided_grammar": "root ::= " + '"a" | ' * (BIG // 6) + '"b"'},
     "guided_grammar"),
    ("/v1/completions", {"structured_outputs": {"regex": "a" * BIG}},
     "structured_outputs.regex"),
    ("/v1/completions", {"structured_outputs": {"choice": ["x" * 1000] * 70}},
     "structured_outputs.choice"),
    ("/v1/chat/completions", {"structured_outputs": {"json": {
        "type": "object", "description": "d" * BIG}}}, "structured_outputs.json"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "description": "d" * BIG}}}},
     "response_format.json_schema.schema"),
])
def test_bad_or_oversized_specs_are_400_naming_the_field(http, path, body, param):  # noqa: F811
    base = ({"messages": MSGS} if "chat" in path else {"prompt": "def f():"})
    r = http.post(path, json={**base, "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
