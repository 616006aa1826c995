"""The committed generated code in libs/fedhive/proto must match proto/ exactly."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "libs" / "fedhive" / "proto"


def test_generated_code_is_current(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "proto" / "generate.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = tmp_path / "fedhive" / "proto"
    want = {p.relative_to(fresh): p.read_text() for p in fresh.rglob("*") if p.is_file()}
    have = {
        p.relative_to(GENERATED): p.read_text()
        for p in GENERATED.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    stale = sorted(str(k) for k in want.keys() | have.keys() if want.get(k) != have.get(k))
    assert not stale, f"generated protobuf code is stale, run `make proto`: {stale}"


def test_generated_modules_import_as_fedhive_proto() -> None:
    from fedhive.proto.v1 import admin_pb2_grpc, common_pb2, task_pb2

    dxo = task_pb2.Dxo(tensors=[common_pb2.TensorRef(name="w", shape=[2, 3])])
    assert task_pb2.Dxo.FromString(dxo.SerializeToString()) == dxo
    assert common_pb2.Error.DESCRIPTOR.full_name == "fedhive.v1.Error"
    assert hasattr(admin_pb2_grpc, "AdminServiceStub")
