"""JSON helpers shared by the benches and training data (no specdeploy imports)."""
from __future__ import annotations

import json


def iter_json_array(text: str):
    """Records of a top-level JSON array, decoded one at a time: stops early, and tolerates a
    truncated tail (the packaged ShareGPT file ends mid-record)."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return
        yield obj
