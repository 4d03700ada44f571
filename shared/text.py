"""Text from outside (task authors, the model, stored rows, the command line) checked and shown safely,
in one place."""
from __future__ import annotations

import json
import unicodedata


def valid_text(text: str) -> str:
    """`text` with whatever UTF-8 cannot encode (a lone surrogate, from JSON's \\ud800) replaced by '?': every
    text field of an episode is a protobuf string, which refuses such text when it is set."""
    if text.isascii():
        return text
    return text.encode("utf-8", "replace").decode("utf-8")


def valid_texts(data):
    """JSON data (json.loads') with every string in it, keys too, at any depth, as valid_text makes it:
    what another process wrote as `\\ud800` becomes text a protobuf string field takes."""
    if isinstance(data, str):
        return valid_text(data)
    if isinstance(data, list):
        return [valid_texts(v) for v in data]
    if isinstance(data, dict):
        return {valid_texts(k): valid_texts(v) for k, v in data.items()}
    return data


def is_unicode(data) -> bool:
    """Whether every string in JSON data (keys too, at any depth) is valid Unicode."""
    try:
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, RecursionError):  # (nested past what can be checked: not taken either)
        return False
    except (ValueError, TypeError):  # not data json.loads made: the caller's checks say what
        return True
    return True


def is_utf8(text: str) -> bool:
    """Whether a command-line value is UTF-8 text (argv's other bytes arrive as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


# Characters a terminal acts on instead of showing: controls (ESC starts sequences that clear the screen,
# move the cursor or set the title; NUL, newline), formats (U+202E reverses what follows, zero-width
# characters hide), line and paragraph separators, and lone surrogates (which cannot be printed at all).
_UNSHOWN = frozenset({"Cc", "Cf", "Zl", "Zp", "Cs"})


def shown_lines(value: object) -> str:
    """`value` as `shown` writes it, its line breaks ("\\n") kept: for messages of several lines."""
    text = str(value)
    if text.isprintable():
        return text
    return "\n".join(shown(line) for line in text.split("\n"))


def shown(value: object) -> str:
    """`value` as text for a terminal: task ids, completions and alert messages come from task authors and
    the model, so each character a terminal would act on is written as its escape (\\x1b, \\u202e, \\n)."""
    text = str(value)
    if text.isprintable():  # no such character (isprintable is False for each of them)
        return text
    return "".join(repr(c)[1:-1] if unicodedata.category(c) in _UNSHOWN else c for c in text)
