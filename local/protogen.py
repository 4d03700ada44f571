"""Generates the Python code for protos/crucible/v1/*.proto.

The generated modules are committed next to their .proto files (so installing
Crucible needs no protoc); tests/test_protos.py regenerates them into a
temporary folder and fails when the committed ones are stale. Regenerate with
`crucible protos`.
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent.parent / "protos"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files(root: Path = PROTO_ROOT) -> list[Path]:
    return sorted((root / "crucible" / "v1").glob("*.proto"))


def generate(out_dir: Path, root: Path = PROTO_ROOT) -> list[Path]:
    """Runs protoc (from grpcio-tools) over every .proto; returns the files written."""
    import grpc_tools
    from grpc_tools import protoc

    well_known = Path(grpc_tools.__file__).parent / "_proto"
    files = [str(p.relative_to(root)) for p in proto_files(root)]
    args = [
        "protoc",
        f"-I{root}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *files,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {files}; its message is above")
    return sorted(p for p in out_dir.rglob("*") if p.name.endswith(GENERATED_SUFFIXES))


def stale_files(root: Path = PROTO_ROOT) -> list[str]:
    """Names of generated files that differ from a fresh generation (or are missing or extra)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = {p.relative_to(tmp).as_posix(): p.read_bytes() for p in generate(Path(tmp), root)}
    committed = {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in (root / "crucible").rglob("*")
        if p.name.endswith(GENERATED_SUFFIXES)
    }
    return sorted(name for name in fresh.keys() | committed.keys() if fresh.get(name) != committed.get(name))


def regenerate(root: Path = PROTO_ROOT) -> list[Path]:
    """Rewrites the committed generated code in place."""
    with tempfile.TemporaryDirectory() as tmp:
        written = []
        for p in generate(Path(tmp), root):
            target = root / p.relative_to(tmp)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, target)
            written.append(target)
    for p in (root / "crucible").rglob("*"):
        if p.name.endswith(GENERATED_SUFFIXES) and p not in written:
            p.unlink()  # generated from a .proto that no longer exists
    return written
