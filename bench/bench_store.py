"""What the store process costs over chDB in-process: insert throughput and small-query latency.

    python bench/bench_store.py [--rows 500000] [--batch 100000] [--queries 200]

Both paths insert the same rows into the same schema in the same run, and both pay for encoding the
Python rows into ClickHouse's Native format with clickhouse-connect's encoder:

* store:  clickhouse-connect -> HTTP (lz4, as clickhouse-connect sends by default) -> store process -> chDB
* direct: clickhouse-connect's Native encoder -> chDB streaming insert, in this process

The ratio store/direct is the price of running chDB behind ClickHouse's HTTP interface. The
latency figures are for `SELECT count() FROM bench WHERE id < 1000` on the filled table.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path


from clickhouse_connect.datatypes.registry import get_from_name  # noqa: E402
from clickhouse_connect.driver.insert import InsertContext  # noqa: E402
from clickhouse_connect.driver.transform import NativeTransform  # noqa: E402

from crucible.shared.settings import Settings  # noqa: E402
from crucible.shared.store.client import connect  # noqa: E402
from crucible.local.store.launcher import free_port, spawn_store, stop_store, wait_ready  # noqa: E402

COLUMNS = [
    ("id", "UInt64"),
    ("task_id", "String"),
    ("group_id", "String"),
    ("sample_index", "UInt32"),
    ("policy_version", "UInt64"),
    ("reward", "Float64"),
    ("advantage", "Float64"),
    ("exit_code", "Int32"),
    ("duration_ms", "Float64"),
    ("completion", "String"),
]
DDL = (
    "CREATE TABLE bench ("
    + ", ".join(f"{name} {type_}" for name, type_ in COLUMNS)
    + ") ENGINE = MergeTree ORDER BY (task_id, group_id, sample_index)"
)
SMALL_QUERY = "SELECT count() FROM bench WHERE id < 1000"


def make_rows(n: int) -> list[list]:
    rng = random.Random(42)
    words = ["def", "return", "for", "in", "range", "if", "else", "x", "y", "+", "*", "(", ")", ":"]
    return [
        [
            i,
            f"task-{i % 2000}",
            f"group-{i // 8}",
            i % 8,
            i // 50_000,
            rng.random(),
            rng.gauss(0, 1),
            rng.choice((0, 0, 0, 1)),
            rng.uniform(1, 500),
            " ".join(rng.choices(words, k=30)),
        ]
        for i in range(n)
    ]


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[int(q) - 1] if len(values) > 1 else values[0]


def bench_store(rows: list[list], batch: int, queries: int, workdir: Path) -> tuple[float, list[float]]:
    port = free_port()
    proc = spawn_store(workdir / "store-data", port=port, log_path=workdir / "store.log")
    try:
        wait_ready(f"http://127.0.0.1:{port}", timeout=60, proc=proc)
        client = connect(Settings(), url=f"http://127.0.0.1:{port}", database="bench")
        client.command(DDL)
        names = [c for c, _ in COLUMNS]
        started = time.perf_counter()
        for start in range(0, len(rows), batch):
            client.insert("bench", rows[start:start + batch], column_names=names)
        elapsed = time.perf_counter() - started
        assert client.query("SELECT count() FROM bench").result_rows[0][0] == len(rows)
        latencies = []
        for _ in range(queries):
            t = time.perf_counter()
            client.query(SMALL_QUERY)
            latencies.append(time.perf_counter() - t)
        client.close()
        return elapsed, latencies
    finally:
        stop_store(proc)


def bench_direct(rows: list[list], batch: int, queries: int, workdir: Path) -> tuple[float, float, list[float]]:
    import chdb.session

    session = chdb.session.Session(str(workdir / "direct-data"))
    try:
        session.query(DDL)
        names = [c for c, _ in COLUMNS]
        types = [get_from_name(t) for _, t in COLUMNS]
        engine_time = 0.0
        started = time.perf_counter()
        for start in range(0, len(rows), batch):
            ctx = InsertContext("bench", names, types, data=rows[start:start + batch])
            blocks = list(NativeTransform.build_insert(ctx))
            blocks[0] = blocks[0].split(b"FORMAT Native\n", 1)[1]  # the encoder prefixes the HTTP statement
            t = time.perf_counter()
            inserter = session.send_insert(f"INSERT INTO bench ({', '.join(names)})", "Native")
            for block in blocks:
                inserter.append(block)
            inserter.finish()
            engine_time += time.perf_counter() - t
        elapsed = time.perf_counter() - started
        count = int(session.query("SELECT count() FROM bench", "TabSeparated").bytes())
        assert count == len(rows), count
        latencies = []
        for _ in range(queries):
            t = time.perf_counter()
            session.query(SMALL_QUERY, "Native").bytes()
            latencies.append(time.perf_counter() - t)
        return elapsed, engine_time, latencies
    finally:
        session.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--batch", type=int, default=100_000, help="rows per insert call")
    parser.add_argument("--queries", type=int, default=200, help="small queries timed for the latency figures")
    args = parser.parse_args()

    t = time.perf_counter()
    rows = make_rows(args.rows)
    print(f"generated {len(rows):,} rows in {time.perf_counter() - t:.1f} s", flush=True)
    with tempfile.TemporaryDirectory(prefix="crucible-bench-") as tmp:
        workdir = Path(tmp)
        store_s, store_lat = bench_store(rows, args.batch, args.queries, workdir)
        direct_s, engine_s, direct_lat = bench_direct(rows, args.batch, args.queries, workdir)

    store_rps, direct_rps = len(rows) / store_s, len(rows) / direct_s
    print(f"insert via store (clickhouse-connect, HTTP, lz4): {store_rps:>12,.0f} rows/s  ({store_s:.2f} s)")
    print(f"insert direct (same encoder, chDB in-process):   {direct_rps:>12,.0f} rows/s  ({direct_s:.2f} s, "
          f"of which chDB {engine_s:.2f} s)")
    print(f"ratio store/direct: {store_rps / direct_rps:.2f}")
    print(f"small SELECT p50: store {statistics.median(store_lat) * 1e3:.2f} ms "
          f"(p90 {percentile(store_lat, 90) * 1e3:.2f} ms), direct {statistics.median(direct_lat) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
