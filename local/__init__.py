"""One-machine infrastructure: the local Kafka broker, the embedded chDB store server, protobuf code generation. No service imports it."""
