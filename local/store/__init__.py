"""The embedded store: one process owns a chDB data directory and serves ClickHouse's HTTP interface (`python -m crucible.local.store.server`)."""
