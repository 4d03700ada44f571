"""`sql`: a SQLite database built for each episode from the task's schema and rows.

The model explores it with `sql` (one statement a call; what it changes stays for the rest of the
episode: earlier statements are replayed first) and answers with the rows the question asks for,
one row a line, values separated by commas. The answer is checked against the result of the task's
reference query, order-insensitive unless the task says `"ordered": true`. Every statement the
model writes runs in the sandbox; only the task's own reference query runs here, and only reads.
"""
from __future__ import annotations

import json
import random
import sqlite3
from collections import Counter, OrderedDict
from collections.abc import Iterator
from decimal import MAX_EMAX, MIN_EMIN, Context, Decimal

from crucible.ml import envs
from crucible.ml.envs.base import Call, Environment, InstanceError, Observation, Tool, program_output, split_of
from crucible.v1 import execution_pb2

MAX_ROWS_SHOWN = 30

# The program the sandbox runs: fixed code; the database and the statements arrive on its stdin.
RUNNER = """\
import json, sqlite3, sys
d = json.loads(sys.stdin.read())
db = sqlite3.connect(":memory:")
for statement in d["schema"]:
    db.execute(statement)
for table, rows in d["rows"].items():
    if rows:
        db.executemany(f"INSERT INTO {table} VALUES ({','.join('?' * len(rows[0]))})", rows)
for statement in d["earlier"]:
    try:
        db.execute(statement)
    except sqlite3.Error:
        pass
try:
    cursor = db.execute(d["query"])
except sqlite3.Error as exc:
    print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(1)
if cursor.description is None:
    print(f"ok, {max(cursor.rowcount, 0)} rows changed")
    sys.exit(0)
rows = cursor.fetchmany(d["limit"] + 1)
print(" | ".join(c[0] for c in cursor.description))
for row in rows[: d["limit"]]:
    print(" | ".join("NULL" if v is None else str(v) for v in row))
if len(rows) > d["limit"]:
    print(f"[more than {d['limit']} rows: only the first {d['limit']} shown]")
"""

FIRST = ["Ada", "Ben", "Cy", "Dee", "Eli", "Fay", "Gus", "Hal", "Ivy", "Jo", "Kai", "Lu", "Mo", "Ned", "Oz", "Pam"]
DEPTS = ["sales", "ops", "research", "legal"]
CITIES = ["Lyon", "Oslo", "Porto", "Riga"]
SCHEMA = ["CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, dept TEXT, salary INTEGER, city TEXT)",
          "CREATE TABLE departments (name TEXT PRIMARY KEY, floor INTEGER)"]


def _value(v) -> str:
    """A value as both sides compare it: the reference's (Python values) and the answer's (text). No
    value is written `null` (the tool shows NULL; Python says None); a number is its value, however
    written (90000, 90000.0, 9e4); anything else is its text, case and surrounding space aside."""
    if v is None:
        return "null"
    text = str(v).strip().lower()
    if text in ("null", "none"):
        return "null"
    if type(v) is not bool and text[:1] in "+-.0123456789":
        try:
            number = Decimal(text)
            if number.is_finite() and MIN_EMIN < number.adjusted() < MAX_EMAX:
                # written in its shortest form (9E+4): never expanded, never rounded
                exact = Context(prec=max(1, len(number.as_tuple().digits)), Emax=MAX_EMAX, Emin=MIN_EMIN)
                return str(number.normalize(exact)) if number else "0"
        except ArithmeticError:
            pass
    return text


def answer_rows(answer: str) -> list[tuple]:
    """The model's answer as rows, in order (a line a row, commas or | between values)."""
    return [tuple(_value(c) for c in line.replace("|", ",").split(",")) for line in answer.strip().splitlines()
            if line.strip()]


# SQLite VM steps a reference query (the task's own, trusted) may take; one that takes more is an error, not a
# hang. Counted, not timed: a deadline in seconds accepted a task on an idle machine and failed it where a
# busy verifier scored its episodes (every one Unverifiable). About 4 s here (~50 million steps a second).
REFERENCE_STEPS = 200_000_000
_STEP_GROUP = 10_000  # steps between two calls of the progress handler that counts them
REFERENCE_VALUE_BYTES = 64 << 10  # the largest string or blob the reference's database holds
REFERENCE_COLUMNS = 64  # of a table or a result
REFERENCE_DATABASE_BYTES = 64 << 20  # the database the schema builds (CREATE TABLE ... AS a recursive query)
REFERENCE_RESULT_BYTES = 8 << 20  # the reference's answer, as its values' text
# All SQLite's memory in the process (a PRAGMA of the whole process: the only SQLite a service runs is this):
# a DISTINCT over wide rows held 2 GB of temporary rows, which no database size limit bounds.
REFERENCE_HEAP_BYTES = 256 << 20
REFERENCE_ROWS = 10_000  # an answer of more rows is no answer a model writes, and a cross join's could fill memory
# Functions whose value changes from call to call: a database or an answer built with them differs between
# the processes that build it (control, the generator, the verifier) and between an episode's calls, so
# a right answer scored 0. The date and time functions are taken as long as they read no clock (reference_result).
CHANGING_FUNCTIONS = frozenset({"random", "randomblob", "changes", "total_changes", "last_insert_rowid",
                                "current_timestamp", "current_date", "current_time"})
# Date and time functions, and where their time value is: with none, or 'now', they read the clock;
# 'localtime' and 'utc' read the machine's time zone.
DATE_FUNCTIONS = {"date": 0, "time": 0, "datetime": 0, "julianday": 0, "unixepoch": 0, "strftime": 1, "timediff": 0}
_CLOCK_WORDS = frozenset({"now", "localtime", "utc"})


def reference_rows(data: dict) -> list[tuple]:
    """The reference query's result as answers are compared (_value)."""
    return _reference(data)[1]


def _reference(data: dict) -> tuple[list[tuple], list[tuple]]:
    """(the reference query's result, as reference_result returns it, and as reference_rows does). Kept
    for the instances last asked about (their failures too: the error's type and text, never the error
    itself, whose traceback held every frame it was raised through and grew each time it was raised
    again): a task is checked where it comes in and where each episode is scored, and a reference may
    take up to REFERENCE_STEPS."""
    key = json.dumps([data.get("schema"), data.get("rows"), data.get("reference")], sort_keys=True)
    kept = _REFERENCES.get(key)
    if kept is None:
        try:
            raw = reference_result(data)
            kept = (raw, [tuple(_value(v) for v in row) for row in raw])
        except (sqlite3.Error, OverflowError, MemoryError) as exc:
            kept = (type(exc), str(exc))
        _REFERENCES[key] = kept
        if len(_REFERENCES) > REFERENCES_KEPT:
            _REFERENCES.popitem(last=False)
    if isinstance(kept[0], type):
        raise kept[0](kept[1])
    return kept


REFERENCES_KEPT = 256
_REFERENCES: "OrderedDict[str, tuple]" = OrderedDict()


def reference_result(data: dict) -> list[tuple]:
    """The reference query's result, computed here on a fresh in-memory database that it may only read,
    within REFERENCE_STEPS (sqlite3.OperationalError "interrupted" after that) and the REFERENCE_*
    bounds: a user's task runs here, in every service that checks or scores it (a schema of
    zeroblobs once took one to 4.8 GB)."""
    db = sqlite3.connect(":memory:")
    # The progress handler runs between groups of VM steps: one step making a 200 MB blob (randomblob,
    # zeroblob, printf's width) ran on past the deadline. No value here may be larger than this.
    db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, REFERENCE_VALUE_BYTES)
    db.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, REFERENCE_COLUMNS)
    db.execute(f"PRAGMA max_page_count = {REFERENCE_DATABASE_BYTES // 4096}")
    db.execute(f"PRAGMA hard_heap_limit = {REFERENCE_HEAP_BYTES}")
    db.execute("PRAGMA temp_store = MEMORY")  # sorts and DISTINCTs in memory, under that limit: not in files on disk
    budget = iter(range(REFERENCE_STEPS // _STEP_GROUP))  # the same verdict on every machine, however busy
    db.set_progress_handler(lambda: next(budget, None) is None, _STEP_GROUP)
    reads = {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
    builds = reads | {sqlite3.SQLITE_CREATE_TABLE, sqlite3.SQLITE_INSERT, sqlite3.SQLITE_CREATE_INDEX,
                      sqlite3.SQLITE_UPDATE, sqlite3.SQLITE_TRANSACTION}  # what creating the tables and filling them needs; never ATTACH
    changing: list[str] = []
    own = sqlite3.connect(":memory:")  # SQLite's own date functions, for the calls that read no clock

    def dated(name: str, at: int):
        def call(*args):
            words = [(a.decode(errors="replace") if isinstance(a, bytes) else a) for a in args]  # CAST('now' AS BLOB)
            if len(args) <= at or any(isinstance(a, str) and a.strip().lower() in _CLOCK_WORDS for a in words):
                changing.append(f"{name}() of now or in local time")
                raise sqlite3.DataError("reads the clock")
            return own.execute(f"SELECT {name}({', '.join('?' * len(args))})", args).fetchone()[0]
        return call

    for name, at in DATE_FUNCTIONS.items():
        db.create_function(name, -1, dated(name, at), deterministic=True)

    def changes_each_time(name: str):
        def call(*args):
            changing.append(f"{name}()")
            raise sqlite3.DataError("changes each time")
        return call

    # Replaced where they are evaluated, not refused by the authorizer: a column's DEFAULT (random()), or
    # DEFAULT CURRENT_TIMESTAMP, is evaluated at insert time, and the authorizer is never asked about it.
    for name in CHANGING_FUNCTIONS:
        for arguments in (-1, 0, 1, 2):
            db.create_function(name, arguments, changes_each_time(name))

    def allowed(permitted: set[int]):
        return lambda action, *_: sqlite3.SQLITE_OK if action in permitted else sqlite3.SQLITE_DENY

    try:
        try:
            db.set_authorizer(allowed(builds))
            for statement in data["schema"]:
                db.execute(statement)
            for table, rows in data["rows"].items():
                if rows:
                    db.executemany(f"INSERT INTO {table} VALUES ({','.join('?' * len(rows[0]))})", rows)
            db.set_authorizer(allowed(reads))
            cursor = db.execute(data["reference"])
            rows, size = [], 0
            for row in cursor:
                size += sum(len(v) if isinstance(v, (str, bytes)) else 24 for v in row)
                rows.append(row)
                if len(rows) > REFERENCE_ROWS:
                    raise sqlite3.DataError(f"the reference query answers more than {REFERENCE_ROWS} rows")
                if size > REFERENCE_RESULT_BYTES:
                    raise sqlite3.DataError(f"the reference query's answer is over {REFERENCE_RESULT_BYTES >> 20} MiB")
            return rows
        except MemoryError:
            raise sqlite3.DataError(f"the reference needs more than {REFERENCE_HEAP_BYTES >> 20} MiB of memory") from None
        except sqlite3.Error as exc:
            if isinstance(exc, sqlite3.OperationalError) and "full" in str(exc):
                raise sqlite3.DataError(f"the database the schema builds is over "
                                        f"{REFERENCE_DATABASE_BYTES >> 20} MiB") from None
            if changing:
                raise sqlite3.DataError(f"{changing[0]} gives another value each time it is called: the database "
                                        "and the reference's answer must be the same wherever they are built") from None
            raise
    finally:
        db.close()
        own.close()


class SQL(Environment):
    name = "sql"
    description = "Answer a question about a database by querying it."
    tools = (Tool("sql", "Runs one SQLite statement and shows its result.", {"query": "the SQL statement"},
                  sandboxed=True),)
    max_turns = 6
    answer_lines = True  # a row a line

    def problems(self, task) -> list[str]:
        """Also the reference query's: one that fails, or answers no rows (which an empty answer would
        match), is refused when the task comes in, not found out episode by episode."""
        try:
            rows = reference_rows(self.instance(task))
        except InstanceError as exc:
            return [str(exc)]
        except (sqlite3.Error, OverflowError, MemoryError) as exc:
            return [f"sql: the reference query fails: {exc}"]
        if not rows:
            return ["sql: the reference query answers no rows: no answer a model writes could be checked"]
        return self.scoring_problems(task)

    def check_instance(self, data: dict) -> None:
        schema, rows, reference = data.get("schema"), data.get("rows"), data.get("reference")
        if not (isinstance(schema, list) and all(isinstance(s, str) for s in schema) and schema):
            raise InstanceError("sql needs 'schema': a list of CREATE TABLE statements")
        if not (isinstance(rows, dict) and all(isinstance(r, list) for r in rows.values())):
            raise InstanceError("sql needs 'rows': an object of table name to a list of rows")
        for table, table_rows in rows.items():
            if not all(isinstance(row, list) and row and len(row) == len(table_rows[0])
                       and all(v is None or type(v) in (str, int, float, bool) for v in row) for row in table_rows):
                raise InstanceError(f"sql: every row of {table[:60]!r} must be a list of values (text, numbers, "
                                    "booleans, null), all of one length")
        if not all(t.isidentifier() for t in rows):
            raise InstanceError("sql: every table name in 'rows' must be an identifier")
        if not isinstance(reference, str) or not reference.strip():
            raise InstanceError("sql needs 'reference': the query whose result is the answer")

    def job(self, task, earlier, call) -> execution_pb2.ExecuteRequest:
        data = self.instance(task)
        payload = {"schema": data["schema"], "rows": data["rows"], "limit": MAX_ROWS_SHOWN,
                   "earlier": [c.arguments["query"] for c in earlier if c.name == "sql"],
                   "query": call.arguments["query"]}
        return execution_pb2.ExecuteRequest(language="python", code=RUNNER, stdin=json.dumps(payload).encode(),
                                            timeout_s=10.0)

    def observe(self, task, earlier, call, result=None) -> Observation:
        return program_output(result)

    def check_answer(self, task, answer: str, calls: list[Call]) -> dict[str, float]:
        data = self.instance(task)
        try:
            expected = reference_rows(data)
        except (sqlite3.Error, OverflowError, MemoryError) as exc:
            raise InstanceError(f"the task's reference query fails: {exc}") from None
        rows = answer_rows(answer)
        given = Counter(rows)
        right = rows == expected if data.get("ordered") else given == Counter(expected)
        # Rows both right and asked for, against all rows given and all expected (F1): naming every row
        # of the table covers the expected ones, and is mostly wrong.
        common = sum((given & Counter(expected)).values())
        overlap = 2 * common / (sum(given.values()) + len(expected)) if common else 0.0
        return {"answer_correct": float(right), "rows_overlap": overlap}

    def generate(self, split: str, *, seed: int, group_size: int = 8) -> Iterator:
        rng = random.Random(seed)
        while True:
            names = rng.sample(FIRST, rng.randrange(6, 11))
            employees = [[i + 1, n, rng.choice(DEPTS), rng.randrange(30, 120) * 1000, rng.choice(CITIES)]
                         for i, n in enumerate(names)]
            floors = rng.sample(range(1, 9), len(DEPTS))
            departments = [[d, f] for d, f in zip(DEPTS, floors)]
            dept, city = rng.choice(DEPTS), rng.choice(CITIES)
            floor = dict(zip(DEPTS, floors))[dept]
            threshold = rng.randrange(40, 110) * 1000
            question, reference = rng.choice([
                (f"Which employees work in {dept}? Answer with their names, one per line.",
                 f"SELECT name FROM employees WHERE dept = '{dept}'"),
                (f"How many employees earn more than {threshold}?",
                 f"SELECT COUNT(*) FROM employees WHERE salary > {threshold}"),
                (f"What is the total salary paid in {city}?",
                 f"SELECT COALESCE(SUM(salary), 0) FROM employees WHERE city = '{city}'"),
                (f"Which employees work on floor {floor}? Answer with name and city separated by a comma, "
                 "one employee per line.",
                 f"SELECT e.name, e.city FROM employees e JOIN departments d ON e.dept = d.name WHERE d.floor = {floor}"),
            ])
            data = {"schema": SCHEMA, "rows": {"employees": employees, "departments": departments},
                    "reference": reference}
            identity = json.dumps(data, sort_keys=True)
            if split_of(identity) != split or not reference_rows(data):
                continue
            yield self.task(question + " The database has the tables employees and departments.", data,
                            split=split, key=f"{identity}:{rng.randrange(1 << 30)}", group_size=group_size)

    def reference(self, task) -> list[str]:
        data = self.instance(task)
        answer = "\n".join(", ".join("NULL" if v is None else str(v) for v in row) for row in _reference(data)[0])
        return ["@sql " + json.dumps({"query": data["reference"]}), answer]


envs.register(SQL())
