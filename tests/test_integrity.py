"""The MAC over a signed message: what it covers, whatever the message holds (pure logic, no broker)."""
from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor

from crucible.shared import integrity

SECRET = bytes(range(32))


def _filled(kind, depth: int = 0):
    """A message of `kind` with every field set (nested messages to a few levels, two items in each
    repeated field and map), values that differ from field to field."""
    message = kind()
    for n, field in enumerate(kind.DESCRIPTOR.fields, 1):
        value = _value(field, n)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            entries = getattr(message, field.name)
            key_field, value_field = field.message_type.fields_by_name["key"], field.message_type.fields_by_name["value"]
            for i in (1, 2):
                key = _value(key_field, n + i)
                if value_field.message_type is not None:
                    if depth < 2:
                        entries[key].CopyFrom(_filled(entries[key].__class__, depth + 1))
                else:
                    entries[key] = _value(value_field, n * 7 + i)
        elif field.message_type is not None:
            if depth >= 2 or field.message_type.full_name.startswith("google.protobuf."):
                continue
            target = getattr(message, field.name)
            if _repeated(field):
                for _ in range(2):
                    item = target.add()
                    item.CopyFrom(_filled(type(item), depth + 1))
            else:
                target.CopyFrom(_filled(type(target), depth + 1))
        elif _repeated(field):
            getattr(message, field.name).extend([value, _value(field, n + 100)])
        else:
            setattr(message, field.name, value)
    return message


def _repeated(field) -> bool:
    return field.is_repeated if hasattr(field, "is_repeated") else field.label == FieldDescriptor.LABEL_REPEATED


def _value(field, n: int):
    if field.type == FieldDescriptor.TYPE_BOOL:
        return True
    if field.type == FieldDescriptor.TYPE_STRING:
        return f"{field.name}-{n}"
    if field.type == FieldDescriptor.TYPE_BYTES:
        return f"{field.name}:{n}".encode() * 3
    if field.type == FieldDescriptor.TYPE_ENUM:
        return field.enum_type.values[-1].number
    if field.cpp_type == FieldDescriptor.CPPTYPE_FLOAT or field.cpp_type == FieldDescriptor.CPPTYPE_DOUBLE:
        return n + 0.25
    return n * 1000 + 3  # a varint of several bytes


def _copied_body(message) -> bytes:
    """The body as defined: a copy without its signature, serialized."""
    unsigned = type(message)()
    unsigned.CopyFrom(message)
    unsigned.ClearField("signature")
    return unsigned.SerializeToString(deterministic=True)


@pytest.mark.parametrize("kind", integrity.SIGNED, ids=lambda k: k.DESCRIPTOR.name)
def test_a_signed_messages_body_is_the_message_without_its_signature_for_every_signed_type(kind):
    message = _filled(kind)
    assert message.ByteSize() > 100 and message.signature  # every field set, the signature too
    # Where the signature is the type's last field, the body is cut from the bytes, not copied (Task's
    # min_policy_version came after its signature: copied).
    last = max(f.number for f in kind.DESCRIPTOR.fields) == kind.DESCRIPTOR.fields_by_name["signature"].number
    assert (integrity._signature_prefix(kind, len(message.signature)) is not None) == last
    assert last or kind.DESCRIPTOR.name == "Task"
    assert integrity._body(message) == _copied_body(message)
    integrity.sign(message, SECRET)
    assert integrity._body(message) == _copied_body(message) and integrity.signed_correctly(message, SECRET)
    for size in (0, 1, 127, 128, 300, 20000):  # signatures of any length (a forger's), tags and lengths of any width
        message.signature = bytes(range(256)) * (size // 256) + bytes(size % 256)
        assert integrity._body(message) == _copied_body(message)
        assert not integrity.signed_correctly(message, SECRET)


@pytest.mark.parametrize("kind", integrity.SIGNED, ids=lambda k: k.DESCRIPTOR.name)
def test_a_change_anywhere_and_unknown_fields_after_the_signature_break_the_mac(kind):
    message = integrity.sign(_filled(kind), SECRET)
    wire = message.SerializeToString(deterministic=True)
    # An unknown field written after the signature: the bytes no longer end with it, so the body is
    # copied, and it holds the unknown field, which the signer never covered.
    extended = kind.FromString(wire + bytes([0xF8, 0xFF, 0x03, 0x01]))  # field 65535, varint 1
    assert extended.signature == message.signature
    assert integrity._body(extended) == _copied_body(extended)
    assert not integrity.signed_correctly(extended, SECRET)
    for field in kind.DESCRIPTOR.fields:
        if field.name == "signature" or field.message_type is not None or _repeated(field):
            continue
        changed = kind.FromString(wire)
        setattr(changed, field.name, False if field.type == FieldDescriptor.TYPE_BOOL else
                field.enum_type.values[0].number if field.type == FieldDescriptor.TYPE_ENUM else _value(field, 999))
        assert not integrity.signed_correctly(changed, SECRET), field.name
    assert integrity.signed_correctly(kind.FromString(wire), SECRET)
    assert not integrity.signed_correctly(kind.FromString(wire), bytes(32))  # another deployment's key


def test_the_mac_is_hmac_sha256_of_the_domain_a_nul_and_the_body():
    import hashlib
    import hmac

    assert integrity._mac(SECRET, b"crucible.v1.Task", b"body") == hmac.new(
        SECRET, b"crucible.v1.Task\0body", hashlib.sha256).digest()
    assert integrity._mac(bytes(32), b"crucible.v1.Task", b"body") != integrity._mac(SECRET, b"crucible.v1.Task", b"body")


def test_a_key_file_others_may_read_or_too_short_to_be_a_key_is_never_used(tmp_path):
    """An empty key file (a crash between creating and writing it) MACed with the empty key, which anyone
    can compute: a forged trajectory of reward 1 passed. A key others may read makes them trusted."""
    from crucible.shared.settings import Settings

    def fresh_key(home):
        integrity._cache.clear()
        return integrity.deployment_key(Settings(home=home))

    made = fresh_key(tmp_path / "a")
    path = tmp_path / "a" / "secrets" / "integrity.key"
    assert len(made) == integrity.KEY_BYTES and oct(path.stat().st_mode & 0o777) == "0o600"
    assert fresh_key(tmp_path / "a") == made  # read back as written
    for text, mode, said in (("", 0o600, "damaged"), ("ab", 0o600, "damaged"), ("  \n", 0o600, "damaged"),
                             ("zz" * 40, 0o600, "damaged"), (made.hex(), 0o644, "read or written by others")):
        path.write_text(text)
        path.chmod(mode)
        with pytest.raises(integrity.IntegrityError, match=said):
            fresh_key(tmp_path / "a")
    integrity._cache.clear()
