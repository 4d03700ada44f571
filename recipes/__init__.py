"""The shipped recipes (`crucible train recipes/<name>.toml`); installed as package data so that
`crucible train` with no argument finds digits.toml wherever Crucible is installed."""
