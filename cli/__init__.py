"""The `crucible` command: the local stack, `crucible train`, the demo, the tests, code generation."""
