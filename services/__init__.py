"""Crucible's services; each runs as `python -m crucible.services.<name>` and imports only `crucible.shared` and `crucible.ml`."""
