"""Schema migrations, applied idempotently when a service starts.

Migrations are the files shared/store/migrations/NNNN_name.sql, applied in name order to the
client's database. Each applied file is recorded in `schema_migrations` with its sha256, so:

* running again applies nothing and changes nothing;
* a migration whose file changed after it was applied is an error, not a silent divergence between
  databases (add a new migration instead of editing an old one);
* a migration that failed half-way is not recorded, and runs again from the top next time; its
  statements are all `CREATE ... IF NOT EXISTS` so that re-running them is harmless.
"""
from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from crucible.shared.store.sqltext import split_statements

if TYPE_CHECKING:  # the store process imports this module and has no use for clickhouse-connect
    from clickhouse_connect.driver.client import Client

log = logging.getLogger("crucible.store.migrate")

_NAME_RE = re.compile(r"^\d{4}_[a-z0-9_]+\.sql$")

SCHEMA_MIGRATIONS_DDL = """
CREATE TABLE IF NOT EXISTS schema_migrations
(
    name String,
    checksum String,
    applied_at DateTime64(3, 'UTC') DEFAULT now64(3)
)
ENGINE = ReplacingMergeTree(applied_at)
ORDER BY name
"""


class MigrationError(RuntimeError):
    """The migrations on disk and the ones recorded in the database disagree, or one failed."""


@dataclass(frozen=True)
class Migration:
    name: str
    checksum: str
    statements: tuple[str, ...]


def migrations_directory() -> Path:
    """Where the migration files shipped with this package live."""
    return Path(str(resources.files("crucible.shared.store") / "migrations"))


def load_migrations(directory: Path | None = None) -> list[Migration]:
    """The migration files in name order, each split into its statements."""
    directory = Path(directory) if directory is not None else migrations_directory()
    migrations = []
    for path in sorted(directory.glob("*.sql")):
        if not _NAME_RE.match(path.name):
            raise MigrationError(f"migration file {path} is not named NNNN_lowercase_name.sql")
        raw = path.read_bytes()
        statements = tuple(split_statements(raw.decode("utf-8")))
        if not statements:
            raise MigrationError(f"migration file {path} contains no statement")
        migrations.append(Migration(path.name, hashlib.sha256(raw).hexdigest(), statements))
    return migrations


def applied_migrations(client: Client) -> dict[str, str]:
    """name -> checksum of every migration recorded in the client's database."""
    client.command(SCHEMA_MIGRATIONS_DDL)
    # argMax rather than FINAL: two services migrating at once may both record a file, and the
    # duplicate rows only collapse at the next merge.
    result = client.query("SELECT name, argMax(checksum, applied_at) FROM schema_migrations GROUP BY name")
    return {name: checksum for name, checksum in result.result_rows}


def migrate(client: Client, directory: Path | None = None) -> list[str]:
    """Apply the migrations not yet recorded in the client's database; returns the names applied now."""
    migrations = load_migrations(directory)
    applied = applied_migrations(client)
    on_disk = {m.name for m in migrations}
    for name in sorted(set(applied) - on_disk):
        log.warning("migration %s is recorded in the database but has no file here (a newer version applied it?)", name)
    done: list[str] = []
    for migration in migrations:
        recorded = applied.get(migration.name)
        if recorded is not None:
            if recorded != migration.checksum:
                raise MigrationError(
                    f"migration {migration.name} was applied with checksum {recorded[:16]}... but the file now has "
                    f"{migration.checksum[:16]}...; applied migrations must not change. Restore the file and put "
                    "the change in a new migration (the next NNNN_ number)."
                )
            continue
        for index, statement in enumerate(migration.statements, 1):
            try:
                client.command(statement)
            except Exception as ex:
                raise MigrationError(
                    f"migration {migration.name} failed at statement {index} of {len(migration.statements)}: {ex}"
                ) from ex
        client.insert("schema_migrations", [[migration.name, migration.checksum]], column_names=["name", "checksum"])
        log.info("applied migration %s", migration.name)
        done.append(migration.name)
    return done
