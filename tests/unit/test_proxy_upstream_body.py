"""app.proxy.http._upstream_body: what the proxy sends upstream for a client's JSON body that the
interceptor answered: the client's own bytes with the keys it added, or the answer serialised."""

from __future__ import annotations

import json

from app.proxy.http import _upstream_body


def _sent(raw: bytes, change) -> tuple[dict, bytes]:
    parsed = json.loads(raw)
    given = list(parsed.items())
    sent = change(parsed)
    return sent, _upstream_body(raw, given, sent)


def test_added_keys_are_appended_to_the_clients_bytes():
    raw = b'{"messages": [{"role": "user", "content": "caf\\u00e9 \xc3\xa9"}], "stream": true}\n'
    sent, out = _sent(raw, lambda b: dict(b, id_slot=2, cache_prompt=True))
    assert out.startswith(raw.strip()[:-1]) and out.endswith(b',"id_slot":2,"cache_prompt":true}')
    assert json.loads(out) == sent


def test_an_unchanged_body_goes_as_it_came():
    raw = b'{"prompt": "x",  "n_predict": 4}'
    sent, out = _sent(raw, lambda b: b)
    assert out == raw


def test_a_changed_or_removed_value_is_serialised_again():
    raw = b'{"prompt": "x", "id_slot": -1, "cache_prompt": true}'
    sent, out = _sent(raw, lambda b: dict(b, id_slot=0))
    assert out == b'{"prompt":"x","id_slot":0,"cache_prompt":true}'
    sent, out = _sent(raw, lambda b: {k: v for k, v in b.items() if k != "id_slot"})
    assert json.loads(out) == sent == {"prompt": "x", "cache_prompt": True}


def test_other_encodings_and_an_empty_object_are_serialised_again():
    for raw in ('{"prompt": "x"}'.encode("utf-16"), b'\xef\xbb\xbf{"prompt": "x"}', b"{}"):
        sent, out = _sent(raw, lambda b: dict(b, id_slot=1))
        assert json.loads(out) == sent and out.startswith(b"{") and out.isascii()
