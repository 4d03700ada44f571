"""The library every Crucible service imports: settings, bus, rpc, store, telemetry."""
