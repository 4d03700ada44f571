"""Poison: property-based fuzzing (hypothesis) of every decoder and every check a consumer makes
before it acts on a record. Whatever the bytes, a decoder returns a message of its schema or raises
MessageDecodeError (the consumer dead-letters the record with it); whatever the message, a check
returns a reason or None. Nothing else escapes, so no input can stop a partition.

The same inputs against the running services, over Kafka and gRPC, are in test_poison_services.py.
"""
from __future__ import annotations

import json
import math
import re

import pytest
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from crucible.ml import tasks as task_checks
from crucible.services.generator.__main__ import policy_problem
from crucible.services.generator.episodes import episode_problem
from crucible.services.learner.groups import sample_problem
from crucible.services.reward_aggregator.handler import check_verdict
from crucible.shared import bus, messages
from crucible.shared.settings import Settings
from crucible.v1 import episode_pb2, policy_pb2, task_pb2, trajectory_pb2, verdict_pb2

SCHEMAS = sorted({cls for cls in messages.TOPIC_SCHEMAS.values()}, key=lambda c: c.DESCRIPTOR.full_name)
FUZZ = hsettings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])

_SCALARS = {
    FieldDescriptor.TYPE_DOUBLE: st.floats(allow_nan=True, allow_infinity=True),
    FieldDescriptor.TYPE_FLOAT: st.floats(width=32, allow_nan=True, allow_infinity=True),
    FieldDescriptor.TYPE_INT64: st.integers(-(2 ** 63), 2 ** 63 - 1),
    FieldDescriptor.TYPE_SINT64: st.integers(-(2 ** 63), 2 ** 63 - 1),
    FieldDescriptor.TYPE_SFIXED64: st.integers(-(2 ** 63), 2 ** 63 - 1),
    FieldDescriptor.TYPE_UINT64: st.integers(0, 2 ** 64 - 1),
    FieldDescriptor.TYPE_FIXED64: st.integers(0, 2 ** 64 - 1),
    FieldDescriptor.TYPE_INT32: st.integers(-(2 ** 31), 2 ** 31 - 1),
    FieldDescriptor.TYPE_SINT32: st.integers(-(2 ** 31), 2 ** 31 - 1),
    FieldDescriptor.TYPE_SFIXED32: st.integers(-(2 ** 31), 2 ** 31 - 1),
    FieldDescriptor.TYPE_UINT32: st.integers(0, 2 ** 32 - 1),
    FieldDescriptor.TYPE_FIXED32: st.integers(0, 2 ** 32 - 1),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_STRING: st.one_of(st.text(max_size=30), st.sampled_from(["", " ", "\x00", "a" * 5000])),
    FieldDescriptor.TYPE_BYTES: st.binary(max_size=40),
}


def _values(field: FieldDescriptor, depth: int) -> st.SearchStrategy:
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        return messages_of(field.message_type._concrete_class, depth + 1)
    if field.type == FieldDescriptor.TYPE_ENUM:
        return st.integers(0, 20)  # numbers the enum does not name too (open enums)
    return _SCALARS[field.type]


@st.composite
def messages_of(draw, cls: type[Message], depth: int = 0) -> Message:
    """Any message of `cls`: each field set or not, to any value of its type, nested a few levels."""
    message = cls()
    if depth > 3:
        return message
    for field in cls.DESCRIPTOR.fields:
        if not draw(st.booleans()):
            continue
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            entries = draw(st.dictionaries(_values(key_field, depth), _values(value_field, depth), max_size=3))
            target = getattr(message, field.name)
            for k, v in entries.items():
                if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                    target[k].CopyFrom(v)
                else:
                    target[k] = v
        elif field.is_repeated:
            items = draw(st.lists(_values(field, depth), max_size=3))
            if field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(message, field.name).extend(items)
            else:
                getattr(message, field.name).extend(items)
        elif field.type == FieldDescriptor.TYPE_MESSAGE:
            getattr(message, field.name).CopyFrom(draw(_values(field, depth)))
        else:
            setattr(message, field.name, draw(_values(field, depth)))
    return message


def decodes_or_refuses(value, schema: type[Message], headers) -> None:
    """The one property of a decoder: a message of its schema, or MessageDecodeError."""
    try:
        decoded = bus.decode_record(value, headers, schema)
    except messages.MessageDecodeError as exc:
        assert str(exc)  # the reason the DLQ record will carry
        return
    assert isinstance(decoded, schema)


HEADERS = st.lists(st.tuples(st.sampled_from([bus.H_SCHEMA, bus.H_CONTENT_TYPE, "traceparent", "x"]),
                             st.one_of(st.binary(max_size=30),
                                       st.sampled_from([s.DESCRIPTOR.full_name.encode() for s in SCHEMAS]),
                                       st.sampled_from([messages.CONTENT_TYPE_JSON.encode(),
                                                        messages.CONTENT_TYPE_PROTOBUF.encode()]))),
                   max_size=4)


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda c: c.DESCRIPTOR.name)
@FUZZ
@given(value=st.one_of(st.none(), st.binary(max_size=300)), headers=HEADERS)
def test_any_bytes_with_any_headers_decode_or_are_refused_with_a_reason(schema, value, headers):
    decodes_or_refuses(value, schema, headers)


def _first(headers, key):
    return next((v.decode("utf-8", "replace") for k, v in headers if k == key), None)


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda c: c.DESCRIPTOR.name)
@FUZZ
@given(data=st.data(), headers=HEADERS, as_tuple=st.booleans())
def test_a_record_is_judged_by_the_first_value_of_each_header_however_they_are_ordered(schema, data, headers,
                                                                                         as_tuple):
    # A real message, under headers that may name it rightly (as publish_headers writes them) or not.
    value = messages.encode(data.draw(messages_of(schema)))
    if data.draw(st.booleans()):
        headers = bus.publish_headers(schema()) + headers
    headers = tuple(headers) if as_tuple else headers  # aiokafka hands a record's headers as a tuple
    try:
        expected = messages.decode(value, schema, schema=_first(headers, bus.H_SCHEMA),
                                   content_type=_first(headers, bus.H_CONTENT_TYPE))
    except messages.MessageDecodeError as exc:
        with pytest.raises(messages.MessageDecodeError, match=re.escape(str(exc))):
            bus.decode_record(value, headers, schema)
    else:
        assert bus.decode_record(value, headers, schema) == expected


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda c: c.DESCRIPTOR.name)
@FUZZ
@given(data=st.data())
def test_a_real_message_cut_or_flipped_anywhere_decodes_or_is_refused(schema, data):
    encoded = bytearray(messages.encode(data.draw(messages_of(schema))))
    for _ in range(data.draw(st.integers(1, 4))):
        how = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        at = data.draw(st.integers(0, max(0, len(encoded) - 1)))
        if how == "flip" and encoded:
            encoded[at] ^= 1 << data.draw(st.integers(0, 7))
        elif how == "cut":
            del encoded[at:]
        else:
            encoded[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    decodes_or_refuses(bytes(encoded), schema, [(bus.H_SCHEMA, schema.DESCRIPTOR.full_name.encode())])


JSON = st.recursive(st.none() | st.booleans() | st.floats(allow_nan=False) | st.integers() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=12), inner, max_size=4),
                    max_leaves=30)


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda c: c.DESCRIPTOR.name)
@FUZZ
@given(document=st.one_of(JSON, st.dictionaries(st.sampled_from(["id", "prompt", "kind", "groupSize", "group_size",
                                                                  "metadata", "python_tests", "version"]),
                                                JSON, max_size=5)),
       depth=st.sampled_from([0, 0, 50, 5000, 20000]))
def test_any_json_document_decodes_or_is_refused(schema, document, depth):
    text = "[" * depth + json.dumps(document) + "]" * depth
    decodes_or_refuses(text.encode(), schema, [(bus.H_CONTENT_TYPE, messages.CONTENT_TYPE_JSON.encode())])


# --- the checks consumers make on a decoded message ------------------------------------------

def is_reason_or_none(value) -> bool:
    return value is None or (isinstance(value, str) and value != "")


@FUZZ
@given(sample=messages_of(trajectory_pb2.Trajectory))
def test_the_learner_names_what_is_wrong_with_any_sample(sample):
    problem = sample_problem(sample)
    assert is_reason_or_none(problem)
    if problem is None:  # what it lets through is a sample the optimiser can use
        assert sample.id and sample.group_id and len(sample.logprobs) == len(sample.completion_token_ids)
        assert math.isfinite(sample.reward) and math.isfinite(sample.advantage)


@FUZZ
@given(verdict=messages_of(verdict_pb2.Verdict))
def test_the_aggregator_names_what_is_wrong_with_any_verdict(verdict):
    problem = check_verdict(verdict)
    assert is_reason_or_none(problem)
    if problem is None:
        assert verdict.sample.group_id and verdict.sample.sample_index < verdict.sample.group_size
        assert math.isfinite(verdict.reward) and all(map(math.isfinite, verdict.components.values()))


@FUZZ
@given(task=messages_of(task_pb2.Task))
def test_the_task_checks_name_every_problem_of_any_task(task):
    problems = task_checks.task_problems(task, Settings())
    assert isinstance(problems, list) and all(isinstance(p, str) and p for p in problems)


@FUZZ
@given(policy=messages_of(policy_pb2.PolicyVersion), ours=st.booleans())
def test_the_generator_refuses_any_policy_version_the_learner_did_not_sign(policy, ours, tmp_path_factory):
    settings = Settings(home=tmp_path_factory.getbasetemp() / "policy-home", run_id="fuzz")
    if ours:
        policy.run_id = "fuzz"
    problem = policy_problem(settings, policy)
    assert is_reason_or_none(problem) and problem is not None  # nothing random carries the learner's signature


@FUZZ
@given(episode=messages_of(episode_pb2.Episode))
def test_the_generator_names_what_is_wrong_with_any_observation(episode):
    assert is_reason_or_none(episode_problem(episode))
