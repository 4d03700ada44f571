"""The committed generated code matches the .proto files (regenerate with `crucible protos`)."""
from crucible.local import protogen


def test_generated_code_is_fresh():
    stale = protogen.stale_files()
    assert not stale, f"generated code is stale for {stale}: run `crucible protos` and commit the result"


def test_every_proto_has_generated_modules():
    for proto in protogen.proto_files():
        stem = proto.with_suffix("")
        for suffix in protogen.GENERATED_SUFFIXES:
            assert stem.with_name(stem.name + suffix).exists(), f"{stem.name}{suffix} is missing"
