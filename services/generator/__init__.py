"""The generator: samples groups of completions from the current policy."""
