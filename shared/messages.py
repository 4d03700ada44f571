"""Protobuf message codecs: one place that knows every schema Crucible puts on the bus.

A Kafka value is the protobuf encoding of one message; its `schema` header names
the message's full protobuf name (e.g. `crucible.v1.Task`). Tasks may also be
published by hand as JSON (protobuf's JSON mapping, field names in either
lowerCamel or snake_case).
"""
from __future__ import annotations

import functools
import json

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message
from google.protobuf.unknown_fields import UnknownFieldSet

from crucible.v1 import (
    alert_pb2,
    episode_pb2,
    evaluation_pb2,
    execution_pb2,
    policy_pb2,
    rollout_pb2,
    task_pb2,
    trajectory_pb2,
    verdict_pb2,
)

CONTENT_TYPE_PROTOBUF = "application/x-protobuf"
CONTENT_TYPE_JSON = "application/json"

# Each topic's message type. Topic names are short here; the bus adds the prefix.
TOPIC_SCHEMAS: dict[str, type[Message]] = {
    "tasks": task_pb2.Task,
    "rollouts": rollout_pb2.RolloutGroup,
    "executions": execution_pb2.Execution,
    "verdicts": verdict_pb2.VerdictGroup,  # a group's verdicts in one record (an episode's alone)
    "trajectories": trajectory_pb2.Trajectory,
    "policy": policy_pb2.PolicyVersion,
    "alerts": alert_pb2.Alert,
    "heldout": task_pb2.Task,              # held-out tasks, read by the evaluator only
    "evaluations": evaluation_pb2.Evaluation,
    # multi-turn episodes: generator -> actions -> sandbox-executor -> observations -> generator ... -> episodes -> verifier
    "actions": episode_pb2.Episode,
    "observations": episode_pb2.Episode,
    "episodes": episode_pb2.Episode,
}

SCHEMAS: dict[str, type[Message]] = {cls.DESCRIPTOR.full_name: cls for cls in TOPIC_SCHEMAS.values()}

MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_BATCH_BYTES = 64 * 1024 * 1024  # values decoded together at most (decode_protobuf_many)


class MessageDecodeError(ValueError):
    """A value that is not a valid message of the expected schema; the text says why."""


def schema_name(message: Message) -> str:
    return message.DESCRIPTOR.full_name


def encode(message: Message) -> bytes:
    return message.SerializeToString(deterministic=True)


def decode(
    value: bytes | None,
    expected: type[Message],
    *,
    schema: str | None = None,
    content_type: str | None = None,
) -> Message:
    """Decodes one Kafka value into `expected`, or raises MessageDecodeError with the reason."""
    if value is None:
        raise MessageDecodeError("empty value (a tombstone): expected a message")
    if len(value) > MAX_MESSAGE_BYTES:
        raise MessageDecodeError(f"value of {len(value)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    expected_name = expected.DESCRIPTOR.full_name
    if schema is not None and schema != expected_name:
        raise MessageDecodeError(f"schema header says {schema!r}, this topic carries {expected_name!r}")

    is_json = content_type == CONTENT_TYPE_JSON or (content_type is None and value[:1] == b"{")
    if is_json:
        return _decode_json(value, expected)
    if content_type not in (None, CONTENT_TYPE_PROTOBUF):
        raise MessageDecodeError(f"unsupported content-type {content_type!r}")
    return decode_protobuf(value, expected)


def decode_protobuf(value: bytes, expected: type[Message]) -> Message:
    """`value` as protobuf bytes of `expected` (at most MAX_MESSAGE_BYTES, no unknown fields), or
    MessageDecodeError with the reason."""
    if len(value) > MAX_MESSAGE_BYTES:
        raise MessageDecodeError(f"value of {len(value)} bytes exceeds the {MAX_MESSAGE_BYTES}-byte limit")
    message = expected()
    try:
        message.ParseFromString(value)
    except (DecodeError, RuntimeError, ValueError) as exc:
        raise MessageDecodeError(f"not a valid {expected.DESCRIPTOR.full_name} protobuf: {exc}") from exc
    # Unknown fields (at any depth) take bytes of the value: with them discarded (in C, recursively), a
    # message whose canonical size is its value's length had none, as any protobuf encoder writes it.
    # (Bytes crafted to write known fields shorter than canonical, by exactly what unknown ones take,
    # pass; what they carried is discarded.) Where the sizes differ, sizing before and after discarding
    # says whether there were any, and only then is the message walked, to say where.
    message.DiscardUnknownFields()
    if message.ByteSize() != len(value):
        again = expected.FromString(value)
        size = again.ByteSize()
        again.DiscardUnknownFields()
        if again.ByteSize() != size:
            raise MessageDecodeError(
                f"bytes carry fields unknown to {expected.DESCRIPTOR.full_name} (at "
                f"{_unknown_field_path(expected.FromString(value)) or 'a nested field'}): wrong schema, garbage, "
                "or a newer producer")
    return message


def decode_protobuf_many(values: list[bytes], expected: type[Message]) -> list[Message] | None:
    """Each of `values` as decode_protobuf decodes it, parsed in one call for them all; None where any
    of them would not decode cleanly (too large, broken, unknown fields): decode each alone then, to
    learn which and why. The values are read as the items of a message holding them as a repeated
    field (protobuf parses an embedded message as it parses the message alone), so the parse, the
    discarding of unknown fields and the size check run once in C, not once a value with Python
    between. Each message shares its batch's memory until the last of the batch is dropped."""
    lengths = list(map(len, values))
    if not values or max(lengths) > MAX_MESSAGE_BYTES or sum(lengths) > MAX_BATCH_BYTES:
        return None  # (a batch this large is copied once more here: each is decoded alone instead)
    holder = _holder(expected)()
    parts = [b""] * (2 * len(values))  # each value after its item's prefix
    parts[::2] = map(_ITEM_PREFIXES.__getitem__, lengths)
    parts[1::2] = values
    data = b"".join(parts)
    try:
        holder.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError):
        return None
    holder.DiscardUnknownFields()
    # As in decode_protobuf: the canonical size of what is left is the bytes' length where nothing was
    # discarded (each item's length prefix is then its own value's length, as written here).
    if holder.ByteSize() != len(data) or len(holder.items) != len(values):
        return None
    return list(holder.items)


class _ItemPrefixes(dict):
    """length -> field 1, length-delimited (the holder's `items`), and an item of that length's length as a
    varint; made where first asked (a lookup in C where it was made before), at most 4096 kept."""

    def __missing__(self, length: int) -> bytes:
        if len(self) >= 4096:
            self.clear()
        prefix = self[length] = varint(1 << 3 | 2) + varint(length)
        return prefix


_ITEM_PREFIXES = _ItemPrefixes()


def varint(value: int) -> bytes:
    """A non-negative integer as protobuf's wire format writes it (a tag, a length)."""
    out = bytearray()
    while value >= 0x80:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


@functools.cache
def _holder(expected: type[Message]) -> type[Message]:
    """A message type with one field, `repeated <expected> items = 1`, in `expected`'s own pool."""
    from google.protobuf import descriptor_pb2, message_factory

    name = expected.DESCRIPTOR.full_name
    pool = expected.DESCRIPTOR.file.pool
    package = "crucible.bus_batch"
    holder = name.replace(".", "_")
    file = descriptor_pb2.FileDescriptorProto(name=f"crucible/bus_batch/{holder}.proto", package=package,
                                              dependency=[expected.DESCRIPTOR.file.name], syntax="proto3")
    message = file.message_type.add(name=holder)
    message.field.add(name="items", number=1, label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
                      type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE, type_name=f".{name}")
    try:
        descriptor = pool.FindMessageTypeByName(f"{package}.{holder}")
    except KeyError:
        pool.Add(file)
        descriptor = pool.FindMessageTypeByName(f"{package}.{holder}")
    return message_factory.GetMessageClass(descriptor)


def _unknown_field_path(message: Message, path: str = "") -> str | None:
    """Where the first unknown field sits, if any. Random bytes often parse as
    protobuf made only of unknown fields, so unknown fields are treated as
    corruption rather than silently dropped."""
    unknown = UnknownFieldSet(message)
    if len(unknown):
        return f"{path or '<root>'} field #{unknown[0].field_number}"
    for name, shape in _nested_fields(message.DESCRIPTOR):
        if shape == _SINGULAR:
            if not message.HasField(name):
                continue
            values = (getattr(message, name),)
        else:
            values = getattr(message, name)
            if not values:
                continue
            if shape == _MAP:
                values = values.values()
        for i, item in enumerate(values):
            found = _unknown_field_path(item, f"{path}.{name}[{i}]" if path else f"{name}[{i}]")
            if found:
                return found
    return None


_SINGULAR, _REPEATED, _MAP = range(3)


@functools.cache
def _nested_fields(descriptor) -> tuple[tuple[str, int], ...]:
    """The fields of a message type that hold messages, each with its shape (a map counts only
    where its values are messages): what the unknown-field check descends into, worked out once
    per type rather than per decoded record."""
    out = []
    for field in descriptor.fields:
        if field.message_type is None:
            continue
        if field.message_type.GetOptions().map_entry:
            if field.message_type.fields_by_name["value"].message_type is not None:
                out.append((field.name, _MAP))
        else:
            out.append((field.name, _REPEATED if field.is_repeated else _SINGULAR))
    return tuple(out)


def _decode_json(value: bytes, expected: type[Message]) -> Message:
    name = expected.DESCRIPTOR.full_name
    if expected is not task_pb2.Task:
        raise MessageDecodeError(f"JSON is accepted only for crucible.v1.Task, not {name}")
    try:
        data = json.loads(value.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MessageDecodeError(f"invalid JSON: {exc}") from exc
    except RecursionError:
        raise MessageDecodeError("JSON nested too deeply") from None
    if not isinstance(data, dict):
        raise MessageDecodeError(f"JSON must be an object describing a {name}, got {type(data).__name__}")
    try:
        return json_format.ParseDict(data, expected())
    except json_format.ParseError as exc:
        raise MessageDecodeError(f"JSON does not match {name}: {exc}") from exc
    except (RecursionError, ValueError, TypeError) as exc:
        raise MessageDecodeError(f"JSON does not make a {name}: {type(exc).__name__}") from None


def to_json(message: Message) -> str:
    return json_format.MessageToJson(message, preserving_proto_field_name=True, indent=None)
