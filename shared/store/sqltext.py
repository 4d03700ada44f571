"""Just enough of ClickHouse's lexer to find where SQL ends and data begins.

The HTTP interface sends `INSERT INTO t FORMAT Native` followed by binary rows in one stream; chDB
takes the statement and the rows separately, so the store must find the boundary the way
ClickHouse's ParserInsertQuery does. The same tokenizer answers the few other questions the server
asks of SQL text (is it blank, which FORMAT does it end with, does it write INTO OUTFILE) and splits
migration files into statements. It never interprets the SQL beyond that: the engine does.

Works on bytes, because the text is followed by arbitrary binary data and only ASCII matters to
the token boundaries (UTF-8 bytes >= 0x80 are treated as identifier characters, as ClickHouse does).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator

_WS = frozenset(b" \t\n\r\f\v")
_WORD_RE = re.compile(rb"[A-Za-z_\x80-\xff][A-Za-z0-9_$\x80-\xff]*")
_NUMBER_RE = re.compile(rb"[0-9][0-9A-Za-z_.]*")
_HEREDOC_OPEN_RE = re.compile(rb"\$([A-Za-z0-9_]*)\$")

WS, COMMENT, STRING, QUOTED, WORD, NUMBER, PUNCT = "ws", "comment", "string", "quoted", "word", "number", "punct"


@dataclass(frozen=True, slots=True)
class Token:
    kind: str
    start: int
    end: int
    closed: bool = True  # False for a string or comment cut off by the end of the buffer

    def text(self, buf: bytes) -> bytes:
        return buf[self.start:self.end]


def _quoted_end(buf: bytes, pos: int, quote: int) -> tuple[int, bool]:
    """End of a quoted literal starting at pos: backslash escapes and doubled quotes, as in ClickHouse."""
    n = len(buf)
    i = pos + 1
    while i < n:
        c = buf[i]
        if c == 0x5C:  # backslash escapes the next byte, whatever it is
            i += 2
            continue
        if c == quote:
            if i + 1 < n and buf[i + 1] == quote:
                i += 2
                continue
            return i + 1, True
        i += 1
    return n, False


def _block_comment_end(buf: bytes, pos: int) -> tuple[int, bool]:
    """ClickHouse block comments nest: /* a /* b */ c */ is one comment."""
    depth = 0
    i = pos
    n = len(buf)
    while i < n:
        if buf.startswith(b"/*", i):
            depth += 1
            i += 2
        elif buf.startswith(b"*/", i):
            depth -= 1
            i += 2
            if depth == 0:
                return i, True
        else:
            i += 1
    return n, False


def tokens(buf: bytes, pos: int = 0) -> Iterator[Token]:
    """Yield the tokens of buf from pos on; never raises, whatever the bytes."""
    n = len(buf)
    while pos < n:
        c = buf[pos]
        if c in _WS:
            end = pos + 1
            while end < n and buf[end] in _WS:
                end += 1
            yield Token(WS, pos, end)
        elif buf.startswith(b"--", pos) or (c == 0x23 and pos + 1 < n and buf[pos + 1] in b" !"):
            end = buf.find(b"\n", pos)
            end = n if end < 0 else end
            yield Token(COMMENT, pos, end)
        elif buf.startswith(b"/*", pos):
            end, closed = _block_comment_end(buf, pos)
            yield Token(COMMENT, pos, end, closed)
        elif c == 0x27:  # '
            end, closed = _quoted_end(buf, pos, c)
            yield Token(STRING, pos, end, closed)
        elif c in (0x22, 0x60):  # " `
            end, closed = _quoted_end(buf, pos, c)
            yield Token(QUOTED, pos, end, closed)
        elif c == 0x24 and (m := _HEREDOC_OPEN_RE.match(buf, pos)):  # $tag$ ... $tag$
            close = buf.find(m.group(0), m.end())
            end, closed = (n, False) if close < 0 else (close + len(m.group(0)), True)
            yield Token(STRING, pos, end, closed)
        elif m := _WORD_RE.match(buf, pos):
            end = m.end()
            yield Token(WORD, pos, end)
        elif m := _NUMBER_RE.match(buf, pos):
            end = m.end()
            yield Token(NUMBER, pos, end)
        else:
            end = pos + 1
            yield Token(PUNCT, pos, end)
        pos = end


def _significant(buf: bytes, pos: int = 0) -> Iterator[Token]:
    return (t for t in tokens(buf, pos) if t.kind not in (WS, COMMENT))


def _is_word(tok: Token | None, buf: bytes, *words: bytes) -> bool:
    return tok is not None and tok.kind == WORD and tok.text(buf).upper() in words


@dataclass(frozen=True, slots=True)
class InsertSplit:
    """An INSERT whose rows follow the statement: `statement` goes to the engine, rows from `data_offset`."""

    statement: str
    format: str
    data_offset: int


def split_insert(buf: bytes) -> InsertSplit | None:
    """Find the data of `INSERT INTO ... FORMAT name <data>` or `INSERT INTO ... VALUES <data>`.

    Returns None for anything else (not an INSERT, INSERT ... SELECT, or a statement that does not
    end within buf), which the caller runs as an ordinary query. The data offset follows
    ClickHouse's rule: after the format name, skip spaces and tabs, then one optional CR and one
    optional LF; for VALUES the data starts right after the keyword.
    """
    it = _significant(buf)
    tok = next(it, None)
    if not _is_word(tok, buf, b"INSERT"):
        return None
    if not _is_word(next(it, None), buf, b"INTO"):
        return None
    tok = next(it, None)
    if _is_word(tok, buf, b"FUNCTION"):
        # Table function call: skip its name and its balanced argument list.
        next(it, None)
        tok = next(it, None)
        if tok is None or tok.text(buf) != b"(":
            return None
        depth = 1
        for tok in it:
            if not tok.closed:
                return None
            text = tok.text(buf)
            depth += (text == b"(") - (text == b")") if tok.kind == PUNCT else 0
            if depth == 0:
                break
        else:
            return None
    else:
        if _is_word(tok, buf, b"TABLE"):
            tok = next(it, None)
        # [db.]table, either part bare or quoted.
        if tok is None or tok.kind not in (WORD, QUOTED) or not tok.closed:
            return None
        probe = next(it, None)
        if probe is not None and probe.text(buf) == b".":
            tok = next(it, None)
            if tok is None or tok.kind not in (WORD, QUOTED):
                return None
            probe = None
        if probe is not None:
            it = _chain_one(probe, it)
    depth = 0
    for tok in it:
        if not tok.closed:
            return None
        if tok.kind == PUNCT:
            text = tok.text(buf)
            if text == b"(":
                depth += 1
            elif text == b")":
                depth -= 1
            continue
        if depth != 0 or tok.kind != WORD:
            continue
        word = tok.text(buf).upper()
        if word in (b"SELECT", b"WITH", b"FROM"):  # INSERT ... SELECT / FROM INFILE: no inline data
            return None
        if word == b"VALUES":
            return InsertSplit(_decode(buf[: tok.start]), "Values", tok.end)
        if word == b"FORMAT":
            name = next(it, None)
            if name is None or name.kind not in (WORD, QUOTED) or not name.closed:
                return None
            fmt = name.text(buf)
            if name.kind == QUOTED:
                fmt = fmt[1:-1]
            data = name.end
            while data < len(buf) and buf[data] in b" \t\f":
                data += 1
            if data < len(buf) and buf[data] == 0x0D:
                data += 1
            if data < len(buf) and buf[data] == 0x0A:
                data += 1
            return InsertSplit(_decode(buf[: tok.start]), _decode(fmt), data)
    return None


def _chain_one(first: Token, rest: Iterator[Token]) -> Iterator[Token]:
    yield first
    yield from rest


def _decode(raw: bytes) -> str:
    # SQL text must be UTF-8; the caller turns UnicodeDecodeError into a client error.
    return raw.decode("utf-8")


def is_blank(sql: str) -> bool:
    """True when sql holds nothing but whitespace and comments (ClickHouse answers 'Empty query')."""
    return next(_significant(sql.encode("utf-8", "surrogatepass")), None) is None


def explicit_format(sql: str) -> str | None:
    """The output format named by a trailing `FORMAT name` clause, if there is one.

    Only a FORMAT followed by nothing but an optional SETTINGS clause and semicolons counts, so a
    column or table that happens to be called `format` is not mistaken for the clause.
    """
    buf = sql.encode("utf-8", "surrogatepass")
    if b"format" not in buf.lower():  # the common case, without tokenizing the whole query
        return None
    toks = list(_significant(buf))
    for i in range(len(toks) - 2, -1, -1):
        if not _is_word(toks[i], buf, b"FORMAT") or toks[i + 1].kind not in (WORD, QUOTED):
            continue
        tail = toks[i + 2:]
        while tail and tail[-1].text(buf) == b";":
            tail.pop()
        if not tail or _is_word(tail[0], buf, b"SETTINGS"):
            name = toks[i + 1].text(buf)
            return _decode(name[1:-1] if toks[i + 1].kind == QUOTED else name)
    return None


def writes_outfile(sql: str) -> bool:
    """True for `... INTO OUTFILE ...`, which the HTTP interface refuses (the server's disk is not the client's)."""
    buf = sql.encode("utf-8", "surrogatepass")
    previous_into = False
    for tok in _significant(buf):
        if previous_into and _is_word(tok, buf, b"OUTFILE"):
            return True
        previous_into = _is_word(tok, buf, b"INTO")
    return False


def split_statements(text: str) -> list[str]:
    """Split a SQL script on semicolons that end a line, ignoring those in strings and comments.

    A `;` ends a statement only when nothing but whitespace or a comment follows it on its line, so
    a semicolon inside a string, a comment, or in the middle of a line never splits. Statements
    that are only comments are dropped.
    """
    buf = text.encode("utf-8")
    statements: list[str] = []
    start = 0
    toks = list(tokens(buf))
    for i, tok in enumerate(toks):
        if tok.kind != PUNCT or tok.text(buf) != b";":
            continue
        ends_line = True
        for after in toks[i + 1:]:
            if after.kind == COMMENT and buf[after.start:after.start + 2] != b"/*":
                break  # a line comment runs to the end of the line
            if after.kind == WS:
                if b"\n" in after.text(buf):
                    break
                continue
            ends_line = False
            break
        if ends_line:
            statements.append(buf[start:tok.start].decode("utf-8"))
            start = tok.end
    statements.append(buf[start:].decode("utf-8"))
    return [s.strip() for s in statements if not is_blank(s)]
