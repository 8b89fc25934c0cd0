"""Text that cannot be encoded: strings holding lone UTF-16 surrogates (U+D800..U+DFFF).

JSON allows ``"\\ud800"`` on its own, and Python strings can hold it, but it is no Unicode character:
UTF-8 cannot encode it and tokenizers fail on it. kvpilot refuses such text wherever it enters
(prompts, chat messages, stop strings, bad words, tool fields) with an error naming the field,
rather than repairing it silently.
"""

from __future__ import annotations

from typing import Any, Optional


def lone_surrogate(text: str) -> Optional[int]:
    """Index of the first lone surrogate in ``text``, or None when it is valid Unicode."""
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def invalid_text_message(field: str, text: str, index: int) -> str:
    return (f"{field} is not valid Unicode: it holds a lone surrogate U+{ord(text[index]):04X} at character "
            f"{index}; send UTF-8 text (a JSON \\ud800-\\udfff escape must be one half of a surrogate pair)")


def check_text(field: str, text: str) -> None:
    """Raise ValueError naming ``field`` if ``text`` holds a lone surrogate."""
    index = lone_surrogate(text)
    if index is not None:
        raise ValueError(invalid_text_message(field, text, index))


def find_invalid_text(value: Any, path: str = "") -> Optional[tuple[str, str]]:
    """The first string (dict keys included) under ``value`` that holds a lone surrogate.

    Walks dicts, lists and tuples. Returns ``(path, message)`` with the path in the server's
    parameter form (``messages[0].content``), or None when every string is valid.
    """
    if isinstance(value, str):
        index = lone_surrogate(value)
        return None if index is None else (path, invalid_text_message(path or "the request", value, index))
    if isinstance(value, dict):
        for k, v in value.items():
            sub = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and lone_surrogate(k) is not None:
                return path or None, invalid_text_message(f"a key of {path or 'the request'}", k, lone_surrogate(k))
            found = find_invalid_text(v, sub)
            if found is not None:
                return found
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            found = find_invalid_text(v, f"{path}[{i}]")
            if found is not None:
                return found
    return None
