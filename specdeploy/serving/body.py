"""The JSON body of a request: parsed into a dict, with the checks no parser should skip."""
from __future__ import annotations

import json
from typing import Any

from specdeploy.serving.errors import bad

MAX_JSON_DEPTH = 32  # no request needs more; deeper is an attack on the parser's recursion


def parse_json(raw: bytes) -> dict:
    """The body as a dict; 400 for invalid UTF-8 or JSON, nesting deeper than MAX_JSON_DEPTH
    and lone surrogates (`"\\ud800"` is valid JSON but no text: tokenizers and the UTF-8
    encoder of our own error bodies fail on it)."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise bad(None, f"could not parse the JSON body of the request ({e})",
                  "invalid_json") from None
    except RecursionError:
        raise bad(None, f"JSON nested deeper than {MAX_JSON_DEPTH} levels",
                  "invalid_json") from None
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object", "invalid_json")
    _check_tree(body)
    return body


def _check_tree(body: dict) -> None:
    stack: list[tuple[Any, int, str]] = [(body, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad(None, f"JSON nested deeper than {MAX_JSON_DEPTH} levels", "invalid_json")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in items:
            if isinstance(k, str) and not _is_text(k):  # name the parent: the key is not text
                raise bad(path or None, "has a key with a lone surrogate (not valid Unicode "
                          "text)", "invalid_value")
            where = f"{path}.{k}".lstrip(".") if isinstance(k, str) else f"{path}[{k}]"
            if isinstance(v, str) and not _is_text(v):
                raise bad(where, "contains a lone surrogate (not valid Unicode text)",
                          "invalid_value")
            if isinstance(v, (dict, list)):
                stack.append((v, depth + 1, where))


def _is_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
