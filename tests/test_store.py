"""The store, end to end: clickhouse-connect (or raw HTTP) against a real store process, no fakes.

Every test also passes against a real ClickHouse server (CRUCIBLE_TEST_CLICKHOUSE_URL), except the
ones that need their own store process, which skip there.
"""
from __future__ import annotations

import datetime
import gzip
import http.client
import math
import random
import shutil
import socket
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
import zlib

import lz4.frame
import pytest
from backports import zstd
from clickhouse_connect.driver.exceptions import DatabaseError

from crucible.shared.settings import Settings
from crucible.shared.store.client import connect
from crucible.local.store.lock import LOCK_NAME
from crucible.shared.store.migrate import MigrationError, migrations_directory, load_migrations, migrate
from tests.fixtures_store import external_clickhouse_url

pytestmark = pytest.mark.store


def raw(url: str, body: bytes | None = None, params: dict | None = None, headers: dict | None = None, method=None):
    """One HTTP request with nothing in between: (status, headers, body)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    try:
        path = "/?" + urllib.parse.urlencode(params or {})
        conn.request(method or ("POST" if body is not None else "GET"), path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.headers, response.read()
    finally:
        conn.close()


def client_for(store_url: str, database: str, **kwargs):
    return connect(Settings(), url=store_url, database=database, **kwargs)


# -- migrations ---------------------------------------------------------------------------------


def test_migrations_apply_once_and_change_nothing_the_second_time(store_client):
    names = [m.name for m in load_migrations()]
    assert migrate(store_client) == names

    tables = [r[0] for r in store_client.query("SHOW TABLES").result_rows]
    assert {"trajectories", "train_steps", "policy_versions", "alerts", "otel_traces", "schema_migrations"} <= set(tables)
    before = {t: store_client.command(f"SHOW CREATE TABLE `{t}`") for t in tables}

    assert migrate(store_client) == []
    after = {t: store_client.command(f"SHOW CREATE TABLE `{t}`") for t in tables}
    assert after == before
    rows = store_client.query("SELECT name, count() FROM schema_migrations FINAL GROUP BY name ORDER BY name").result_rows
    assert rows == [(name, 1) for name in names]
    # The tables a run writes to a small insert at a time merge less eagerly (0011): new parts are not
    # merged into the table's big part every few inserts, so a step's store work does not grow with history.
    for table in ("trajectories", "otel_traces", "tasks", "run_tasks", "train_steps", "policy_versions",
                  "episode_turns", "evaluations"):
        assert "merge_selector_base = 20" in after[table], after[table]


def test_the_schema_takes_crucibles_rows_and_a_replay_duplicates_nothing(store_client):
    migrate(store_client)
    now = datetime.datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=datetime.timezone.utc)
    trajectory = {
        "trajectory_id": "t-1", "task_id": "task-9", "group_id": "g-1", "sample_index": 3, "task_kind": "code",
        "policy_version": 12, "completion": "def f(): return 1",
        "reward_components": {"tests": 1.0, "format": 0.5}, "reward": 1.5, "advantage": 0.25,
        "tamper_flags": ["reads_tests"], "exit_code": 0, "duration_ms": 12.5, "violation": "",
        "generation_ms": 80.0, "execution_ms": 12.5, "trace_id": "ab" * 16, "created_at": now, "turns": 3,
        "cpu_s": 0.25, "max_rss_bytes": 12_345_678, "run_id": "train-1",
    }
    for _ in range(2):  # the second insert is a Kafka replay of the first
        store_client.insert("trajectories", [list(trajectory.values())], column_names=list(trajectory))
    rows = [dict(r) for r in store_client.query("SELECT * FROM trajectories FINAL").named_results()]
    assert len(rows) == 1
    # clickhouse-connect returns UTC datetimes naive or aware depending on its timezone settings
    assert rows[0].pop("created_at").replace(tzinfo=datetime.timezone.utc) == trajectory.pop("created_at")
    assert rows[0] == trajectory

    span = {
        "Timestamp": now, "TraceId": "ab" * 16, "SpanId": "cd" * 8, "ParentSpanId": "", "TraceState": "",
        "SpanName": "score", "SpanKind": "SPAN_KIND_INTERNAL", "ServiceName": "scorer",
        "ResourceAttributes": {"service.name": "scorer"}, "ScopeName": "crucible", "ScopeVersion": "1",
        "SpanAttributes": {"task_id": "task-9"}, "Duration": 1_500_000, "StatusCode": "STATUS_CODE_OK",
        "StatusMessage": "", "Events.Timestamp": [now], "Events.Name": ["scored"],
        "Events.Attributes": [{"reward": "1.5"}], "Links.TraceId": [], "Links.SpanId": [], "Links.TraceState": [],
        "Links.Attributes": [],
    }
    store_client.insert("otel_traces", [list(span.values())], column_names=list(span))
    got = store_client.query("SELECT SpanName, Duration, Events.Name, SpanAttributes['task_id'] FROM otel_traces")
    assert got.result_rows == [("score", 1_500_000, ["scored"], "task-9")]


def test_an_applied_migration_whose_file_changed_is_refused(store_client, tmp_path):
    copy = tmp_path / "migrations"
    shutil.copytree(migrations_directory(), copy)
    migrate(store_client, copy)
    edited = sorted(copy.glob("*.sql"))[-1]
    edited.write_text(edited.read_text() + "\n-- an innocent-looking edit\n")
    with pytest.raises(MigrationError, match=rf"{edited.name} was applied with checksum .* must not change"):
        migrate(store_client, copy)


def test_a_half_applied_migration_runs_again(store_client, tmp_path):
    directory = tmp_path / "migrations"
    directory.mkdir()
    (directory / "0001_pair.sql").write_text(
        "CREATE TABLE IF NOT EXISTS first_half (a UInt8) ENGINE = MergeTree ORDER BY a;\n"
        "CREATE TABLE IF NOT EXISTS second_half (a UInt8) ENGINE = MergeTree ORDER BY a;\n"
    )
    store_client.command("CREATE TABLE first_half (a UInt8) ENGINE = MergeTree ORDER BY a")  # as if it stopped half-way
    assert migrate(store_client, directory) == ["0001_pair.sql"]
    assert migrate(store_client, directory) == []


def test_the_task_log_keeps_a_row_for_each_run_of_a_task_and_carries_over_what_it_held(store_client, tmp_path):
    """Task ids repeat from run to run (a task file's, a seeded family's); the log keyed by task id alone
    (0003) kept the later run's row only, and the earlier run's status and rescore found none of its tasks."""
    from crucible.services.control.handler import TASK_COLUMNS, task_row
    from crucible.shared import store
    from crucible.v1 import task_pb2

    before = tmp_path / "migrations"
    before.mkdir()
    for path in migrations_directory().glob("*.sql"):
        if path.name < "0012":
            shutil.copy(path, before / path.name)
    migrate(store_client, before)
    task = task_pb2.Task(id="digits-0001", kind="exact", prompt="2+2?", group_size=4,
                         answer=task_pb2.ExpectedAnswer(answer="4"))
    store_client.insert("tasks", [task_row(task, "t" * 32, "run-old")], column_names=TASK_COLUMNS)
    assert "0012_run_tasks.sql" in migrate(store_client)
    for run in ("run-a", "run-b"):
        store_client.insert(store.TASKS_TABLE, [task_row(task, "t" * 32, run)], column_names=TASK_COLUMNS)
    store_client.command(f"OPTIMIZE TABLE {store.TASKS_TABLE} FINAL")
    rows = store_client.query(f"SELECT run_id, count() FROM {store.TASKS_TABLE} FINAL WHERE task_id = 'digits-0001' "
                              "GROUP BY run_id ORDER BY run_id").result_rows
    assert rows == [("run-a", 1), ("run-b", 1), ("run-old", 1)]


# -- data through clickhouse-connect ------------------------------------------------------------


def test_100k_rows_round_trip_with_exact_aggregates(store_client):
    store_client.command(
        "CREATE TABLE samples (id UInt64, grp String, value Float64, n Int32, tags Array(String)) "
        "ENGINE = MergeTree ORDER BY id"
    )
    rng = random.Random(7)
    rows = [
        [i, f"g{rng.randrange(5000)}", rng.uniform(-1e6, 1e6), rng.randrange(-2**31, 2**31), [f"t{i % 7}"] * (i % 3)]
        for i in range(100_000)
    ]
    summary = store_client.insert("samples", rows, column_names=["id", "grp", "value", "n", "tags"])
    assert summary.written_rows == 100_000

    count, n_sum, v_sum, v_avg, v_min, v_max, groups, tag_count = store_client.query(
        "SELECT count(), sum(n), sum(value), avg(value), min(value), max(value), uniqExact(grp), sum(length(tags)) "
        "FROM samples"
    ).result_rows[0]
    values = [r[2] for r in rows]
    assert count == 100_000
    assert n_sum == sum(r[3] for r in rows)  # integer sum: exact
    assert math.isclose(v_sum, math.fsum(values), rel_tol=1e-9, abs_tol=1e-3)
    assert math.isclose(v_avg, math.fsum(values) / len(values), rel_tol=1e-9, abs_tol=1e-6)
    assert (v_min, v_max) == (min(values), max(values))
    assert groups == len({r[1] for r in rows})
    assert tag_count == sum(len(r[4]) for r in rows)
    # and the rows themselves come back intact
    back = store_client.query("SELECT id, grp, value, n, tags FROM samples WHERE id % 9973 = 0 ORDER BY id").result_rows
    assert back == [tuple(r) for r in rows if r[0] % 9973 == 0]


def test_two_clients_insert_and_query_at_the_same_time(store_url, store_client, store_database):
    store_client.command("CREATE TABLE events (writer UInt8, seq UInt32) ENGINE = MergeTree ORDER BY (writer, seq)")
    clients = [client_for(store_url, store_database) for _ in range(2)]
    batches, batch_size = 20, 500
    errors: list[BaseException] = []
    counts: list[int] = []
    done = threading.Event()

    def write(writer: int):
        try:
            for b in range(batches):
                clients[writer].insert(
                    "events", [[writer, b * batch_size + i] for i in range(batch_size)], column_names=["writer", "seq"]
                )
        except BaseException as ex:  # surfaced below
            errors.append(ex)

    def read():
        reader = client_for(store_url, store_database)
        try:
            while not done.is_set():
                counts.append(reader.query("SELECT count() FROM events").result_rows[0][0])
        except BaseException as ex:
            errors.append(ex)
        finally:
            reader.close()

    writers = [threading.Thread(target=write, args=(w,)) for w in range(2)]
    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in writers + readers:
        t.start()
    for t in writers:
        t.join(120)
    done.set()
    for t in readers:
        t.join(60)
    for c in clients:
        c.close()

    assert not errors, errors
    total = 2 * batches * batch_size
    assert counts and all(0 <= c <= total for c in counts)
    per_writer = store_client.query(
        "SELECT writer, count(), uniqExact(seq), sum(seq) FROM events GROUP BY writer ORDER BY writer"
    ).result_rows
    n = batches * batch_size
    assert per_writer == [(w, n, n, n * (n - 1) // 2) for w in range(2)]


def test_a_service_inserting_rows_does_not_load_pandas_or_numpy(store_url, store_client, store_database):
    """clickhouse-connect imports pandas and numpy on a process's first insert to ask whether the rows
    are a DataFrame or an array (2 s and 0.1 s of CPU in every service that writes, in the first
    second of a run); Crucible's client says they never are."""
    store_client.command("CREATE TABLE lean (id UInt32, name String) ENGINE = MergeTree ORDER BY id")
    script = (
        "import sys\n"
        "from crucible.shared.settings import Settings\n"
        "from crucible.shared.store import writes\n"
        "from crucible.shared.store.client import connect\n"
        f"client = connect(Settings(), url={store_url!r}, database={store_database!r})\n"
        "writes.insert(client, 'lean', [[7, 'seven']], ['id', 'name'])\n"
        "print('pandas' in sys.modules, 'numpy' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False False"
    assert store_client.query("SELECT id, name FROM lean").result_rows == [(7, "seven")]


@pytest.mark.parametrize("compression", ["lz4", "zstd", "gzip", False])
def test_each_compression_for_insert_and_query(store_url, store_database, store_client, compression):
    client = client_for(store_url, store_database, compress=compression)
    try:
        client.command("CREATE TABLE IF NOT EXISTS comp (k UInt32, s String) ENGINE = MergeTree ORDER BY k")
        rows = [[i, f"value {i} " * (i % 5)] for i in range(20_000)]
        assert client.insert("comp", rows).written_rows == len(rows)
        assert client.query("SELECT k, s FROM comp ORDER BY k").result_rows == [tuple(r) for r in rows]
    finally:
        client.close()


@pytest.mark.parametrize("encoding", ["lz4", "zstd", "gzip", "deflate"])
def test_raw_compressed_request_and_response(store_url, store_database, store_client, encoding):
    store_client.command("CREATE TABLE raw_comp (a UInt32, b String) ENGINE = MergeTree ORDER BY a")
    payload = b"INSERT INTO raw_comp FORMAT TSV\n" + b"".join(b"%d\tx%d\n" % (i, i) for i in range(1000))
    body = {
        "lz4": lz4.frame.compress,
        "zstd": zstd.compress,
        "gzip": gzip.compress,
        "deflate": zlib.compress,
    }[encoding](payload)
    status, _, text = raw(store_url, body, {"database": store_database}, {"Content-Encoding": encoding})
    assert status == 200, text

    status, headers, data = raw(
        store_url,
        b"SELECT a, b FROM raw_comp ORDER BY a FORMAT TSV",
        {"database": store_database, "enable_http_compression": "1"},
        {"Accept-Encoding": encoding},
    )
    assert status == 200
    assert headers["Content-Encoding"] == encoding
    plain = {
        "lz4": lz4.frame.decompress,
        "zstd": zstd.decompress,
        "gzip": lambda d: zlib.decompress(d, wbits=31),
        "deflate": zlib.decompress,
    }[encoding](data)
    assert plain == payload.split(b"\n", 1)[1]


# -- errors -------------------------------------------------------------------------------------


def test_a_bad_query_surfaces_clickhouses_error_and_the_store_keeps_serving(store_client):
    with pytest.raises(DatabaseError) as caught:
        store_client.query("SELEC 1")
    message = str(caught.value)
    assert "Code: 62" in message and "SYNTAX_ERROR" in message and "Syntax error" in message
    assert caught.value.code == 62
    assert store_client.query("SELECT 1 + 1").result_rows == [(2,)]


def test_unknown_table_is_a_404_with_clickhouses_text(store_url, store_client, store_database):
    with pytest.raises(DatabaseError) as caught:
        store_client.query("SELECT * FROM no_such_table")
    assert caught.value.code == 60 and "UNKNOWN_TABLE" in str(caught.value)
    status, headers, body = raw(store_url, b"SELECT * FROM no_such_table", {"database": store_database})
    assert status == 404
    assert headers["X-ClickHouse-Exception-Code"] == "60"
    assert body.startswith(b"Code: 60. DB::Exception: ") and b"(UNKNOWN_TABLE)" in body


def test_unknown_database_and_unknown_setting(store_url):
    status, headers, body = raw(store_url, b"SELECT 1", {"database": "no_such_database_here"})
    assert (status, headers["X-ClickHouse-Exception-Code"]) == (404, "81"), body
    status, headers, body = raw(store_url, b"SELECT 1", {"no_such_setting_here": "1"})
    assert (status, headers["X-ClickHouse-Exception-Code"]) == (404, "115"), body
    assert raw(store_url, b"SELECT 1")[2] == b"1\n"


def test_query_parameters_round_trip_and_cannot_inject(store_client):
    store_client.command("CREATE TABLE victim (a UInt8) ENGINE = MergeTree ORDER BY a")
    nasty = ["it's", 'say "hi"', "back\\slash", "tab\tnew\nline", "\\'; DROP TABLE victim; --", "ünïcödé ✓", "", "{x:String}"]
    for value in nasty:
        got = store_client.query("SELECT {x:String}", parameters={"x": value}).result_rows
        assert got == [(value,)], value
    assert store_client.query("SELECT {n:UInt32} + 1", parameters={"n": 4_000_000_000}).result_rows == [(4_000_000_001,)]
    assert store_client.query("SELECT {a:Array(String)}", parameters={"a": nasty}).result_rows == [(nasty,)]
    assert store_client.query("SELECT {a:Array(UInt16)}", parameters={"a": [1, 2, 65535]}).result_rows == [([1, 2, 65535],)]
    # a long parameter makes clickhouse-connect switch to multipart/form-data
    long_value = "'" * 5000 + "x" * 50_000
    assert store_client.query("SELECT length({p:String})", parameters={"p": long_value}).result_rows == [(55_000,)]
    assert store_client.command("EXISTS TABLE victim") == 1


def test_a_parameter_that_does_not_fit_its_type_is_an_error_not_sql(store_url):
    status, headers, body = raw(store_url, b"SELECT {n:UInt8}", {"param_n": "1; DROP DATABASE default"})
    assert status >= 400 and headers["X-ClickHouse-Exception-Code"] != "0", body
    assert raw(store_url, b"SELECT count() > 0 FROM system.databases WHERE name = 'default'")[2] == b"1\n"


def test_raw_urllib_post_of_select_1(store_url):
    with urllib.request.urlopen(urllib.request.Request(store_url, data=b"SELECT 1"), timeout=30) as response:
        assert response.read() == b"1\n"
        assert response.headers["X-ClickHouse-Format"] == "TabSeparated"
        assert response.headers["X-ClickHouse-Query-Id"]
        assert "read_rows" in response.headers["X-ClickHouse-Summary"]
    with urllib.request.urlopen(store_url + "/ping", timeout=30) as response:
        assert response.read() == b"Ok.\n"


def test_get_is_read_only_and_multi_statements_are_refused(store_url, store_client, store_database):
    status, headers, body = raw(store_url, params={"query": "CREATE TABLE nope (a UInt8) ENGINE = Memory", "database": store_database})
    assert headers["X-ClickHouse-Exception-Code"] == "164" and b"readonly" in body, body
    status, headers, body = raw(store_url, b"SELECT 1; SELECT 2")
    assert (status, headers["X-ClickHouse-Exception-Code"]) == (400, "62") and b"Multi-statements" in body
    status, headers, body = raw(store_url, b"  -- nothing but a comment\n")
    assert (status, headers["X-ClickHouse-Exception-Code"]) == (400, "62") and b"Empty query" in body


@pytest.mark.skipif(external_clickhouse_url() is not None, reason="checks the store's own refusal of web pages")
def test_a_request_a_web_page_makes_is_refused_and_changes_nothing(store_url, store_client, store_database):
    """Any page the user visits may send requests to 127.0.0.1: with no password, one read the deployment's
    integrity key through chDB's file() and sent it out with url(), and wrote rows. A page cannot choose
    its Origin or Sec-Fetch-Site, nor the Host a DNS-rebound name sends; a program's client sends neither."""
    store_client.command("CREATE TABLE web (a UInt8) ENGINE = MergeTree ORDER BY a")
    insert = {"query": "INSERT INTO web VALUES (1)", "database": store_database}
    host = urllib.parse.urlsplit(store_url).hostname
    for headers in ({"Origin": "http://localhost:9999"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"},
                    {"Sec-Fetch-Site": "same-site", "Sec-Fetch-Mode": "no-cors"}, {"Host": "attacker.example"},
                    {"Host": f"attacker.example:{urllib.parse.urlsplit(store_url).port}"},
                    {"Host": f"0.0.0.0:{urllib.parse.urlsplit(store_url).port}"}):  # reaches 127.0.0.1, no Fetch Metadata
        status, reply, body = raw(store_url, b"", params=insert, headers=headers)
        assert (status, reply["X-ClickHouse-Exception-Code"]) == (403, "497"), (headers, status, body)
        status, _, body = raw(store_url, params={"query": "SELECT * FROM file('/etc/hostname', 'LineAsString')"},
                              headers=headers)
        assert status == 403, (headers, body)
    assert store_client.query("SELECT count() FROM web").result_rows == [(0,)]
    # The user's own navigation (Sec-Fetch-Site: none), a program, and the store's IP or localhost by name.
    for headers in ({"Sec-Fetch-Site": "none"}, {}, {"Host": f"localhost:{urllib.parse.urlsplit(store_url).port}"},
                    {"Host": host}):
        status, _, body = raw(store_url, b"", params=insert, headers=headers)
        assert status == 200, (headers, status, body)
    assert store_client.query("SELECT count() FROM web").result_rows == [(4,)]
    # A GET is what a page's <img> sends, with no header saying so in some browsers: it reads no file, and
    # sends nothing out, whatever readonly it asks for.
    for params in ({}, {"readonly": "2"}, {"readonly": "1"}):
        status, reply, body = raw(store_url, params={"query": "SELECT * FROM file('/etc/hostname', 'LineAsString')",
                                                     **params})
        assert reply["X-ClickHouse-Exception-Code"] == "164", (params, status, body)


@pytest.mark.skipif(external_clickhouse_url() is not None, reason="checks how the store's own sessions are reused")
def test_settings_do_not_leak_between_requests(store_url):
    query = b"SELECT getSetting('max_threads'), getSetting('date_time_input_format')"
    default = raw(store_url, query)[2]
    for _ in range(6):  # more requests than pooled sessions
        assert raw(store_url, query, {"max_threads": "1", "date_time_input_format": "best_effort"})[2] == b"1\tbest_effort\n"
        assert raw(store_url, query)[2] == default
    raw(store_url, b"SET max_threads = 1")
    raw(store_url, b"CREATE TEMPORARY TABLE leaked (a UInt8)")
    for _ in range(6):
        assert raw(store_url, query)[2] == default
        status, _, _ = raw(store_url, b"SELECT * FROM leaked")
        assert status == 404


# -- malformed HTTP ---------------------------------------------------------------------------


@pytest.mark.skipif(external_clickhouse_url() is not None, reason="a server answers these with its own codes")
def test_truncated_or_garbage_lz4_body_is_a_400_and_nothing_is_inserted(store_url, store_client, store_database):
    store_client.command("CREATE TABLE lz (a UInt32) ENGINE = MergeTree ORDER BY a")
    frame = lz4.frame.compress(b"INSERT INTO lz FORMAT TSV\n" + b"".join(b"%d\n" % i for i in range(10_000)))
    for body in (frame[: len(frame) // 2], frame[:-4], b"\x04\x22\x4d\x18garbage" * 10, b"not lz4 at all"):
        status, headers, text = raw(store_url, body, {"database": store_database}, {"Content-Encoding": "lz4"})
        assert status == 400, text
        assert headers["X-ClickHouse-Exception-Code"] == "271" and b"CANNOT_DECOMPRESS" in text
    assert raw(store_url, frame, {"database": store_database}, {"Content-Encoding": "lz4"})[0] == 200
    assert store_client.query("SELECT count() FROM lz").result_rows == [(10_000,)]


@pytest.mark.skipif(external_clickhouse_url() is not None, reason="a server answers these with its own codes")
def test_malformed_framing_is_a_clear_400(store_url):
    host, port = urllib.parse.urlsplit(store_url).hostname, urllib.parse.urlsplit(store_url).port

    def exchange(request: bytes, half_close: bool = True) -> bytes:
        with socket.create_connection((host, port), timeout=30) as sock:
            sock.sendall(request)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            return data

    short = exchange(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\nSELECT 1")
    assert short.startswith(b"HTTP/1.1 400") and b"CANNOT_READ_ALL_DATA" in short, short
    chunked = exchange(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\nSELECT 1\r\n0\r\n\r\n")
    assert chunked.startswith(b"HTTP/1.1 400") and b"chunk" in chunked, chunked
    no_length = exchange(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert no_length.startswith(b"HTTP/1.1 411"), no_length
    encoding = exchange(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Encoding: br\r\nContent-Length: 8\r\n\r\nSELECT 1")
    assert encoding.startswith(b"HTTP/1.1 415") and b"UNKNOWN_COMPRESSION_METHOD" in encoding, encoding
    garbage = exchange(b"\x16\x03\x01 not http at all\r\n\r\n")
    assert garbage.startswith(b"HTTP/1.1 400") or garbage.startswith(b"HTTP/1.0 400"), garbage
    not_utf8 = raw(store_url, b"SELECT '\xff\xfe'")
    assert not_utf8[0] == 400 and b"UTF-8" in not_utf8[2]
    ok = exchange(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nSELE\r\n4\r\nCT 1\r\n0\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200") and ok.endswith(b"\r\n\r\n1\n"), ok


# -- the process --------------------------------------------------------------------------------


def test_a_second_store_on_the_same_directory_fails_fast_and_the_first_keeps_serving(spawned_store, tmp_path):
    data = tmp_path / "shared-data"
    first = spawned_store(data)
    second = spawned_store(data, wait=False)
    assert second.proc.wait(timeout=60) == 2
    log = second.log()
    assert str(data) in log and str(first.proc.pid) in log and f"kill {first.proc.pid}" in log and "--data" in log
    assert (data / LOCK_NAME).read_text().strip() == str(first.proc.pid)
    status, _, body = raw(first.url, b"SELECT 42")
    assert (status, body) == (200, b"42\n")


def test_data_persists_across_a_restart(spawned_store, tmp_path):
    data = tmp_path / "persistent"
    store = spawned_store(data)
    client = client_for(store.url, "persist")
    client.command("CREATE TABLE kept (a UInt32, s String) ENGINE = MergeTree ORDER BY a")
    client.insert("kept", [[i, str(i)] for i in range(1234)])
    client.close()
    assert store.stop() == 0
    assert "store stopped" in store.log()

    again = spawned_store(data)
    client = client_for(again.url, "persist")
    try:
        assert client.query("SELECT count(), sum(a) FROM kept").result_rows == [(1234, 1234 * 1233 // 2)]
    finally:
        client.close()


def test_body_limits_hold_against_a_decompression_bomb(spawned_store):
    store = spawned_store(extra_args=["--max-body-bytes", str(8 << 20)])
    bomb = zstd.compress(b"INSERT INTO t FORMAT TSV\n" + b"0\n" * (64 << 20))
    assert len(bomb) < 1 << 20
    status, headers, body = raw(store.url, bomb, headers={"Content-Encoding": "zstd"})
    assert status == 413 and headers["X-ClickHouse-Exception-Code"] == "229", body
    # refused from the headers alone, before the client has sent its body
    with socket.create_connection((store.url.split("//")[1].split(":")[0], int(store.url.rsplit(":", 1)[1])), timeout=30) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\n\r\n" % (9 << 20))
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413") and b"QUERY_IS_TOO_LARGE" in answer, answer
    assert raw(store.url, b"SELECT 1")[2] == b"1\n"


def test_a_store_with_a_password_refuses_queries_without_it_and_beyond_loopback_needs_one(spawned_store, tmp_path):
    import base64

    from pydantic import SecretStr

    from crucible.shared.settings import Settings
    from crucible.shared.store import connect

    store = spawned_store(tmp_path / "guarded", env={"CRUCIBLE_STORE_USER": "crucible",
                                                     "CRUCIBLE_STORE_PASSWORD": "st0re-pw"})
    status, headers, body = raw(store.url, b"SELECT 1")
    assert status == 403 and headers["X-ClickHouse-Exception-Code"] == "516", body
    good = "Basic " + base64.b64encode(b"crucible:st0re-pw").decode()
    assert raw(store.url, b"SELECT 1", headers={"Authorization": good})[::2] == (200, b"1\n")
    assert raw(store.url, b"SELECT 1", headers={"X-ClickHouse-User": "crucible", "X-ClickHouse-Key": "nope"})[0] == 403
    assert raw(store.url)[0] == 200  # the health check stays open
    settings = Settings(clickhouse_url=store.url, clickhouse_user="crucible", clickhouse_password=SecretStr("st0re-pw"))
    assert connect(settings, database="default").query("SELECT 2").result_rows == [(2,)]
    assert "st0re-pw" not in store.log()
    exposed = spawned_store(tmp_path / "exposed", wait=False, extra_args=["--host", "0.0.0.0"])
    assert exposed.proc.wait(timeout=60) == 1 and "without a password" in exposed.log()


def test_the_embedded_store_has_a_password_of_its_own_that_every_client_of_its_home_uses(tmp_path):
    """Without one, any process of the machine (and, until the store refused them, any web page) could
    read the user's files through chDB's file(): the integrity key among them."""
    from pydantic import SecretStr

    from crucible.local.stack import LocalStore
    from crucible.shared.procs import free_port
    from crucible.shared.store import connect

    settings = Settings(home=tmp_path / "home", clickhouse_url=f"http://127.0.0.1:{free_port()}")
    local = LocalStore.from_settings(settings)
    secret = tmp_path / "home" / "secrets" / "store.password"
    assert local.password and secret.read_text() == local.password and oct(secret.stat().st_mode & 0o777) == "0o600"
    local.start(echo=lambda *_: None)
    try:
        status, reply, _ = raw(local.url, b"SELECT * FROM file('/etc/hostname', 'LineAsString')")
        assert (status, reply["X-ClickHouse-Exception-Code"]) == (403, "516")  # another process, no password
        assert connect(settings, database="default").query("SELECT 3").result_rows == [(3,)]  # this home's client
        with pytest.raises(Exception, match="516|Authentication failed"):
            connect(settings.model_copy(update={"clickhouse_password": SecretStr("")}), database="default").query("SELECT 4")
        assert LocalStore.from_settings(settings).password == local.password  # the same on every start
    finally:
        local.stop()


def test_a_write_waits_out_a_store_restart_and_lands_once(tmp_path):
    import threading

    from crucible.shared.settings import Settings
    from crucible.shared.store import connect, migrate, writes
    from tests.fixtures_store import StoreProcess

    first = StoreProcess(tmp_path / "data").wait_ready()
    client = connect(Settings(clickhouse_url=first.url), database="crucible")
    migrate(client)
    first.stop()  # the store is down...
    second: list[StoreProcess] = []
    restart = threading.Timer(2.0, lambda: second.append(StoreProcess(tmp_path / "data", port=first.port).wait_ready()))
    restart.start()
    try:
        row = ["run-x", 1, 1, 0.1, 0.0, 1.0, 0.5, 0.5, 0.5, 1e-4, 10.0, datetime.datetime.now(datetime.timezone.utc)]
        columns = ["run_id", "step", "policy_version", "loss", "kl", "entropy", "grad_norm", "reward_mean",
                   "pass_rate", "lr", "step_time_ms", "ts"]
        writes.insert(client, "train_steps", [row], columns, patience_s=60)  # ...and back within the patience
        restart.join()
        assert client.query("SELECT count() FROM train_steps FINAL WHERE run_id = 'run-x'").result_rows == [(1,)]
        # a refusal (no such table) is not retried
        with pytest.raises(Exception, match="(?i)table"):
            writes.insert(client, "no_such_table", [[1]], ["x"], patience_s=60)
    finally:
        restart.cancel()
        for store in second:
            store.stop()


def test_rows_added_together_share_one_insert_and_column_types_are_described_once(store_client):
    import asyncio
    import inspect

    from crucible.shared.store import writes

    migrate(store_client)
    inserts, describes = [], []
    real_insert, real_context = store_client.insert, store_client.create_insert_context
    store_client.insert = lambda *a, **k: (inserts.append(len(a[1])), real_insert(*a, **k))[1]
    signature = inspect.signature(real_context)

    def context(*a, **k):  # an insert context built without column types asks the store to describe the table
        bound = signature.bind(*a, **k).arguments
        if bound.get("column_types") is None and bound.get("column_type_names") is None:
            describes.append(bound["table"])
        return real_context(*a, **k)

    store_client.create_insert_context = context
    columns = ["run_id", "step", "policy_version", "loss", "kl", "entropy", "grad_norm", "reward_mean",
               "pass_rate", "lr", "step_time_ms", "ts"]
    now = datetime.datetime.now(datetime.timezone.utc)

    def row(step):
        return ["batched", step, step, 0.1, 0.0, 1.0, 0.5, 0.5, 0.5, 1e-4, 10.0, now]

    async def main():
        rows = writes.BatchedRows(store_client, "train_steps", columns, linger_s=0.05)
        await asyncio.gather(*(rows.add(row(i)) for i in range(7)))
        # every add has returned: the rows are in the store
        assert store_client.query("SELECT count() FROM train_steps FINAL WHERE run_id = 'batched'"
                                  ).result_rows == [(7,)]
        await rows.add(row(7))
        broken = writes.BatchedRows(store_client, "no_such_table", ["x"], linger_s=0.05)
        results = await asyncio.gather(*(broken.add([i]) for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, Exception) and "table" in str(r).lower() for r in results), results

    try:
        asyncio.run(main())
    finally:
        store_client.insert, store_client.create_insert_context = real_insert, real_context
    assert inserts[:2] == [7, 1]  # seven concurrent rows in one insert, then the lone one in its own
    assert describes.count("train_steps") == 1  # the column types were asked for once


async def test_a_stored_task_that_does_not_read_is_one_sample_not_rescored_not_the_whole_rescore(
        store_url, store_database, store_client):
    """A task written by another version of Crucible (a field this one does not know), or damaged, ended
    `crucible rescore` with a traceback and nothing of the run rescored."""
    from crucible.cli import rescore
    from crucible.services.control.handler import TASK_COLUMNS, task_row
    from crucible.shared import integrity, store
    from crucible.v1 import task_pb2, verdict_pb2

    migrate(store_client)
    now = datetime.datetime.now(datetime.timezone.utc)
    good = task_pb2.Task(id="good", kind="exact", prompt="2+2?", group_size=1, answer=task_pb2.ExpectedAnswer(answer="4"))
    odd = task_pb2.Task(id="odd", kind="exact", prompt="3+3?", group_size=1, answer=task_pb2.ExpectedAnswer(answer="6"))
    # A task is taken as its run signed it: one written to the store by anyone else (or signed for another
    # run) is not rescored (`--grade-as` signed such a task anew, and paid garbage answers by it).
    settings = Settings(clickhouse_url=store_url, clickhouse_database=store_database)
    forged = task_pb2.Task(id="forged", kind="exact", prompt="1+1?", group_size=1, answer=task_pb2.ExpectedAnswer(answer="@"))
    other = task_pb2.Task(id="other", kind="exact", prompt="1+2?", group_size=1, answer=task_pb2.ExpectedAnswer(answer="3"))
    integrity.sign_task(good, integrity.key(settings.model_copy(update={"run_id": "run-r"})))
    integrity.sign_task(other, integrity.key(settings.model_copy(update={"run_id": "run-q"})))
    rows = [task_row(t, "t" * 32, "run-r") for t in (good, odd, forged, other)]
    swapped = task_row(good, "t" * 32, "run-r")  # a genuine task of the run, stored as another task's
    swapped[TASK_COLUMNS.index("task_id")] = "swapped"
    rows.append(swapped)
    rows[1][TASK_COLUMNS.index("task_json")] = '{"id": "odd", "kind": "exact", "fieldOfATomorrowsCrucible": 1}'
    store_client.insert(store.TASKS_TABLE, rows, column_names=TASK_COLUMNS)
    store_client.insert("trajectories", [[f"s-{t}", t, "exact", 0, "4", 1.0, {}, 0, "run-r", now]
                                         for t in ("good", "odd", "forged", "other", "swapped")],
                        column_names=["trajectory_id", "task_id", "task_kind", "policy_version", "completion", "reward",
                                      "reward_components", "turns", "run_id", "created_at"])
    asked = []
    verifier = settings.model_copy(update={"run_id": "rescore-1"})

    async def verify(request):
        assert integrity.signed_correctly(request.task, integrity.key(verifier))  # signed for the verifier's run
        asked.append(request.task.id)
        return verdict_pb2.Verdict(reward=1.0, components={"answer_correct": 1.0}, verifier_version="v-test")

    report = await rescore.rescore(settings, run_id="run-r", grade_as={}, verify=verify, verifier_settings=verifier,
                                   echo=lambda *_: None)
    assert asked == ["good"] and report.rescored == 1 and report.tasks_unreadable == 1 and report.tasks_unsigned == 3
    assert any("does not read as a task" in line for line in rescore.summary(report))
    assert any("3 samples whose stored task the run did not sign" in line for line in rescore.summary(report))
