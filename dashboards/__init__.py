"""The shipped dashboards (Grafana JSON, package data): Grafana provisions them from this folder, and
`crucible dashboard` draws their store panels itself."""
