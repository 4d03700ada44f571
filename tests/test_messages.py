"""Codecs, without a broker."""
import pytest

from crucible.v1 import episode_pb2, rollout_pb2, task_pb2, verdict_pb2
from crucible.shared import messages


def test_protobuf_round_trip_and_deterministic_encoding():
    task = task_pb2.Task(id="a", kind="exact", prompt="p", group_size=2, metadata={"b": "2", "a": "1"})
    data = messages.encode(task)
    assert messages.decode(data, task_pb2.Task) == task
    assert messages.encode(messages.decode(data, task_pb2.Task)) == data


@pytest.mark.parametrize("value,reason", [
    (None, "tombstone"),
    (b"\xff\xff\xff", "not a valid crucible.v1.Task"),
    (b"\x08\x01", "unknown to crucible.v1.Task"),
    (b'{"id": 5}', "JSON does not match"),
    (b'{"id": "x", "group_sizee": 1}', "JSON does not match"),
    (b'{"id": "x",', "invalid JSON"),
    (b'{"metadata": ' + b'[' * 10_000 + b']' * 10_000 + b'}', "nested too deeply|does not"),
    (b'{"id": ' + b'{"a": ' * 5_000 + b'1' + b'}' * 5_001, "nested too deeply|does not"),
])
def test_bad_values_raise_with_reason(value, reason):
    with pytest.raises(messages.MessageDecodeError, match=reason):
        messages.decode(value, task_pb2.Task)


def test_unknown_fields_deep_inside_are_rejected():
    # A RolloutGroup whose second rollout carries an unknown field number 99.
    inner = rollout_pb2.Rollout(id="r").SerializeToString() + b"\x98\x06\x01"
    first = rollout_pb2.Rollout(id="ok").SerializeToString()
    group = (b"\x3a" + bytes([len(first)]) + first) + (b"\x3a" + bytes([len(inner)]) + inner)
    with pytest.raises(messages.MessageDecodeError, match=r"rollouts\[1\] field #99"):
        messages.decode(group, rollout_pb2.RolloutGroup)


def test_values_written_longer_or_shorter_than_canonical_decode_and_unknown_fields_in_them_are_found():
    # group_size = 3 as an overlong varint (canonical: 2 bytes; written: 4), and prompt_token_ids = [5]
    # unpacked (canonical, packed: 3 bytes; written: 2): both decode as what they say.
    overlong = b"\x38\x83\x80\x00" + messages.encode(task_pb2.Task(id="t"))
    assert messages.decode(overlong, task_pb2.Task) == task_pb2.Task(id="t", group_size=3)
    unpacked = b"\x30\x05" + messages.encode(episode_pb2.Episode(id="e"))
    assert messages.decode(unpacked, episode_pb2.Episode) == episode_pb2.Episode(id="e", prompt_token_ids=[5])
    # An unknown field beside them is still found, and named.
    for value, schema in ((overlong, task_pb2.Task), (unpacked, episode_pb2.Episode)):
        with pytest.raises(messages.MessageDecodeError, match="field #99"):
            messages.decode(value + b"\x98\x06\x01", schema)


def test_schema_header_must_match_topic():
    data = messages.encode(task_pb2.Task(id="a"))
    with pytest.raises(messages.MessageDecodeError, match="schema header"):
        messages.decode(data, task_pb2.Task, schema="crucible.v1.Rollout")


def test_json_only_for_tasks():
    with pytest.raises(messages.MessageDecodeError, match="only for crucible.v1.Task"):
        messages.decode(b'{"id": "r"}', rollout_pb2.Rollout, content_type="application/json")
    task = messages.decode(b'{"id": "t", "groupSize": 3, "python_tests": {"entry_point": "f"}}', task_pb2.Task)
    assert task.group_size == 3 and task.python_tests.entry_point == "f"


def test_oversized_value_rejected():
    with pytest.raises(messages.MessageDecodeError, match="exceeds"):
        messages.decode(b"\x00" * (messages.MAX_MESSAGE_BYTES + 1), task_pb2.Task)


def _record(topic, offset, value, headers):
    from aiokafka import ConsumerRecord

    return ConsumerRecord(topic, 0, offset, 0, 0, None, value, None, 0, 0, headers)


def test_a_batch_decodes_together_as_each_value_alone():
    """A consumer's batch is parsed in one call (decode_protobuf_many); whatever is in it, each record
    ends up as decode_protobuf makes it alone or is decoded alone, so the same records are refused for
    the same reasons."""
    import gc

    from crucible.shared import bus

    tasks = [task_pb2.Task(id=f"t{i}", kind="exact", prompt="p" * i, group_size=i, metadata={"k": str(i)})
             for i in range(200)] + [task_pb2.Task(), task_pb2.Task(id="long", prompt="q" * 70_000)]
    values = [messages.encode(t) for t in tasks]
    together = messages.decode_protobuf_many(values, task_pb2.Task)
    assert together == tasks and all(type(m) is task_pb2.Task for m in together)
    together[0].prompt = "changed"  # each is a message of its own, and outlives the batch it came in
    del values
    gc.collect()
    assert together[1] == tasks[1] and together[-1] == tasks[-1] and together[0].id == "t0"

    good = [messages.encode(t) for t in tasks[:5]]
    overlong = b"\x38\x83\x80\x00" + messages.encode(task_pb2.Task(id="t"))  # decodes alone, not canonical
    for bad in (good[1] + b"\x98\x06\x01", good[1][:-1], b"\xff\xff\xff", overlong,
                b"\x00" * (messages.MAX_MESSAGE_BYTES + 1)):
        assert messages.decode_protobuf_many([*good, bad, *good], task_pb2.Task) is None
    big = messages.encode(task_pb2.Task(id="big", prompt="b" * (messages.MAX_MESSAGE_BYTES - 100)))
    assert messages.decode_protobuf_many([big] * 3, task_pb2.Task) == [task_pb2.Task.FromString(big)] * 3
    assert messages.decode_protobuf_many([big] * 5, task_pb2.Task) is None  # too much to copy at once

    headers = bus.publish_headers(task_pb2.Task())
    verdict_headers = bus.publish_headers(verdict_pb2.Verdict())
    schemas = {"tasks": task_pb2.Task, "verdicts": verdict_pb2.Verdict}
    verdicts = [verdict_pb2.Verdict(id=f"v{i}") for i in range(3)]
    records = [_record("tasks", i, v, headers) for i, v in enumerate(good)]
    records += [_record("verdicts", 10 + i, messages.encode(v), verdict_headers) for i, v in enumerate(verdicts)]
    records += [_record("tasks", 20, b'{"id": "j"}', [(bus.H_CONTENT_TYPE, b"application/json")]),  # JSON: alone
                _record("tasks", 21, None, headers),                                                  # a tombstone
                _record("tasks", 22, good[0], verdict_headers),                                       # wrong schema
                _record("tasks", 23, good[0], [])]                                                    # no headers
    decoded = bus.decode_records(records, schemas)
    assert decoded[:8] == [*tasks[:5], *verdicts] and decoded[8:] == [None] * 4
    # One record that does not decode cleanly: its topic's records are all left to be decoded alone
    # (where it is found, and why), another topic's are not.
    poisoned = records[:2] + [_record("tasks", 30, overlong + b"\x98\x06\x01", headers)] + records[2:8]
    decoded = bus.decode_records(poisoned, schemas)
    assert decoded[:6] == [None] * 6 and decoded[6:] == verdicts
    with pytest.raises(messages.MessageDecodeError, match="field #99"):
        bus.decode_record(poisoned[2].value, poisoned[2].headers, task_pb2.Task)


def test_records_are_decoded_together_whatever_runs_their_headers_make():
    """decode_records reads headers once a run of equal ones (bus.header_runs): shuffled topics, trace
    contexts, tombstones and empty values inside runs, records as published or not; every record as
    published with a value is decoded, as it decodes alone, and no other is."""
    import random

    from crucible.shared import bus

    rng = random.Random(65)
    schemas = {"tasks": task_pb2.Task, "verdicts": verdict_pb2.Verdict}
    published = {topic: bus.publish_headers(schema()) for topic, schema in schemas.items()}
    for _ in range(200):
        records = []
        for offset in range(rng.randint(1, 30)):
            topic = rng.choice(list(schemas))
            message = schemas[topic](id=f"m{offset}")
            value = rng.choice([messages.encode(message)] * 6 + [None, b""])
            headers = rng.choice([published[topic]] * 4 + [
                [*published[topic], ("traceparent", b"00-" + b"1" * 32 + b"-" + b"2" * 16 + b"-01")],
                published["verdicts" if topic == "tasks" else "tasks"], [(bus.H_CONTENT_TYPE, b"x")], [],
                [published[topic][0], (bus.H_CONTENT_TYPE, b"application/json")]])
            records.append(_record(topic, offset, value, list(headers)))
        runs = bus.header_runs(records)
        assert [i for start, end in runs for i in range(start, end)] == list(range(len(records)))
        for start, end in runs:
            assert all(r.headers == records[start].headers and r.topic == records[start].topic
                       for r in records[start:end])
        for (_, end), (start, _) in zip(runs, runs[1:]):
            assert (records[end - 1].headers, records[end - 1].topic) != (records[start].headers, records[start].topic)
        decoded = bus.decode_records(records, schemas)
        as_published = [bus._as_published(r.value, r.headers, schemas[r.topic]) for r in records]
        for topic in schemas:
            mine = [i for i, r in enumerate(records) if r.topic == topic and as_published[i]]
            for i, r in enumerate(records):
                if r.topic != topic:
                    continue
                if i in mine and len(mine) > 1:
                    assert decoded[i] == bus.decode_record(r.value, r.headers, schemas[topic])
                else:  # decoded alone, later (or refused there)
                    assert decoded[i] is None
