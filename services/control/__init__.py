"""The control plane: Control gRPC (submit tasks, run status, query trajectories), the task log, and the CLI."""
