"""The library every Crucible service imports: settings, bus, rpc, store client, telemetry, framing, worker processes."""
