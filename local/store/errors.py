"""ClickHouse-shaped errors: the code, the name, the text and the HTTP status a real server would send.

Clients (clickhouse-connect among them) parse `Code: N. DB::Exception: ... (NAME)` out of the body
and the number out of the `X-ClickHouse-Exception-Code` header, so every failure the store reports,
whether it came from the engine or from the HTTP layer, goes through `StoreError`.
"""
from __future__ import annotations

import re

# The numbers are ClickHouse's own (src/Common/ErrorCodes.cpp); the store uses them for the
# failures it detects itself, before the engine ever sees a query.
UNSUPPORTED_METHOD = 1
CANNOT_READ_ALL_DATA = 33
BAD_ARGUMENTS = 36
NOT_IMPLEMENTED = 48
SYNTAX_ERROR = 62
UNKNOWN_SETTING = 115
READONLY = 164
TOO_MANY_SIMULTANEOUS_QUERIES = 202
QUERY_IS_TOO_LARGE = 229
CANNOT_DECOMPRESS = 271
INTO_OUTFILE_NOT_ALLOWED = 358
HTTP_LENGTH_REQUIRED = 381
UNKNOWN_COMPRESSION_METHOD = 89
UNSUPPORTED_MEDIA_TYPE = 779
STD_EXCEPTION = 1001
UNKNOWN_EXCEPTION = 1002
AUTHENTICATION_FAILED = 516
ACCESS_DENIED = 497

_NAMES = {
    UNSUPPORTED_METHOD: "UNSUPPORTED_METHOD",
    CANNOT_READ_ALL_DATA: "CANNOT_READ_ALL_DATA",
    BAD_ARGUMENTS: "BAD_ARGUMENTS",
    NOT_IMPLEMENTED: "NOT_IMPLEMENTED",
    SYNTAX_ERROR: "SYNTAX_ERROR",
    UNKNOWN_SETTING: "UNKNOWN_SETTING",
    READONLY: "READONLY",
    TOO_MANY_SIMULTANEOUS_QUERIES: "TOO_MANY_SIMULTANEOUS_QUERIES",
    QUERY_IS_TOO_LARGE: "QUERY_IS_TOO_LARGE",
    CANNOT_DECOMPRESS: "CANNOT_DECOMPRESS",
    INTO_OUTFILE_NOT_ALLOWED: "INTO_OUTFILE_NOT_ALLOWED",
    HTTP_LENGTH_REQUIRED: "HTTP_LENGTH_REQUIRED",
    UNKNOWN_COMPRESSION_METHOD: "UNKNOWN_COMPRESSION_METHOD",
    UNSUPPORTED_MEDIA_TYPE: "UNSUPPORTED_MEDIA_TYPE",
    STD_EXCEPTION: "STD_EXCEPTION",
    UNKNOWN_EXCEPTION: "UNKNOWN_EXCEPTION",
    AUTHENTICATION_FAILED: "AUTHENTICATION_FAILED",
    ACCESS_DENIED: "ACCESS_DENIED",
}

# ClickHouse's exceptionCodeToHTTPStatus (src/Server/HTTP/exceptionCodeToHTTPStatus.cpp), by code.
_STATUS_BY_CODE: dict[int, int] = {}
for _status, _codes in {
    401: (194,),  # REQUIRED_PASSWORD
    403: (192, 193, 516, 512, 497),  # UNKNOWN_USER WRONG_PASSWORD AUTHENTICATION_FAILED SET_NON_GRANTED_ROLE ACCESS_DENIED
    400: (
        36, 427, 6, 25, 26, 38, 41, 72, 441, 675, 676, 27, 376, 15, 44, 37, 123, 8, 167, 168, 223,
        62, 117, 53, 321,
    ),  # BAD_ARGUMENTS ... SYNTAX_ERROR INCORRECT_DATA TYPE_MISMATCH VALUE_IS_OUT_OF_RANGE_OF_DATA_TYPE
    404: (60, 46, 47, 50, 56, 81, 115, 152, 63, 73, 336, 78, 511),  # UNKNOWN_TABLE ... UNKNOWN_ROLE
    413: (229,),  # QUERY_IS_TOO_LARGE
    501: (48,),  # NOT_IMPLEMENTED
    503: (209, 76, 439),  # SOCKET_TIMEOUT CANNOT_OPEN_FILE CANNOT_SCHEDULE_TASK
    411: (381,),  # HTTP_LENGTH_REQUIRED
    408: (159,),  # TIMEOUT_EXCEEDED
    415: (779,),  # UNSUPPORTED_MEDIA_TYPE
}.items():
    for _code in _codes:
        _STATUS_BY_CODE[_code] = _status

_CODE_RE = re.compile(r"Code:\s*(\d+)\.\s*")
_NAME_AT_END_RE = re.compile(r"\s*\(([A-Z][A-Z0-9_]+)\)\s*$")
# The engine sometimes appends its own "(version X)" trailer; the store appends exactly one.
_VERSION_TRAILER_RE = re.compile(r"\s*\(version\s+(?:[^()]|\([^()]*\))*\)\s*$")


def http_status_for(code: int) -> int:
    """The HTTP status a ClickHouse server answers with for this exception code (500 by default)."""
    return _STATUS_BY_CODE.get(code, 500)


class StoreError(Exception):
    """A failure reported to the client exactly the way a ClickHouse server reports it.

    `http_status` is normally derived from the code; the HTTP layer overrides it where the fault is
    plainly the request's (a corrupt body is a 400 even though ClickHouse itself answers 500).
    """

    def __init__(
        self,
        code: int,
        message: str,
        name: str | None = None,
        http_status: int | None = None,
        kind: str = "DB::Exception",
    ):
        self.code = code
        self.name = name or _NAMES.get(code, "UNKNOWN_EXCEPTION")
        self.message = message.rstrip()
        self.http_status = http_status or http_status_for(code)
        self.kind = kind
        super().__init__(self.text())

    def text(self) -> str:
        """`Code: N. DB::Exception: <message>. (NAME)`, without the version trailer."""
        message = self.message if self.message.endswith(".") else self.message + "."
        return f"Code: {self.code}. {self.kind}: {message} ({self.name})"

    def body(self, version: str) -> bytes:
        """The response body: the text plus the `(version ...)` trailer a server appends."""
        return f"{self.text()} (version {version} (chdb))\n".encode("utf-8", "backslashreplace")

    @classmethod
    def from_engine(cls, raw: str) -> StoreError:
        """Wrap an error string from chDB, keeping the engine's own code, text and name.

        chDB's Python layer prefixes some messages ("Streaming insert finish failed: ...");
        the ClickHouse part starts at `Code:`. A message without a code (a Python-side check
        in chDB) becomes UNKNOWN_EXCEPTION with the text kept.
        """
        raw = str(raw).strip()
        match = _CODE_RE.search(raw)
        if not match:
            return cls(UNKNOWN_EXCEPTION, raw or "unknown engine error")
        code = int(match.group(1))
        rest = _VERSION_TRAILER_RE.sub("", raw[match.end():])
        name_match = _NAME_AT_END_RE.search(rest)
        name = name_match.group(1) if name_match else None
        if name_match:
            rest = rest[: name_match.start()]
        kind = "DB::Exception"
        kind_match = re.match(r"(DB::\w+): ", rest)
        if kind_match:
            kind = kind_match.group(1)
            rest = rest[kind_match.end():]
        return cls(code, rest, name=name, kind=kind)
