"""Regenerate the bridge's Python code from ``stagecosim/v1/*.proto``.

Run ``python -m stage_cosim.bridge.proto.generate`` (needs grpcio-tools) after editing a .proto;
commit the .proto together with the generated ``_pb2.py``, ``_pb2_grpc.py`` and ``.pyi`` files.

Why a script: protoc names imports after the proto package (``from stagecosim.v1 import …``),
which is not importable once installed; the files live inside ``stage_cosim.bridge.proto``, so
the imports are rewritten to that absolute path. The proto's own file name stays
``stagecosim/v1/bridge.proto``, which is what server reflection and grpcurl show.

The generated code checks its runtime: ``_pb2.py`` needs protobuf >= the protoc version that
wrote it, ``_pb2_grpc.py`` needs grpcio >= the grpcio-tools version; pyproject.toml pins both.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "stage_cosim.bridge.proto"


def _fix_imports(path: Path) -> None:
    text = path.read_text()
    text = re.sub(r"^from stagecosim\.v1 import ", f"from {PACKAGE}.stagecosim.v1 import ", text, flags=re.M)
    text = re.sub(r"^import stagecosim\.v1\.", f"import {PACKAGE}.stagecosim.v1.", text, flags=re.M)
    path.write_text(text)


def generate() -> list[Path]:
    """Compile every .proto under stagecosim/; returns the files written."""
    from grpc_tools import protoc
    import grpc_tools

    include = str(Path(grpc_tools.__file__).parent / "_proto")
    protos = sorted(p.relative_to(HERE).as_posix() for p in (HERE / "stagecosim").rglob("*.proto"))
    args = ["protoc", f"-I{HERE}", f"-I{include}", f"--python_out={HERE}", f"--pyi_out={HERE}",
            f"--grpc_python_out={HERE}", *protos]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    written = []
    for proto in protos:
        stem = HERE / proto[: -len(".proto")]
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            out = stem.with_name(stem.name + suffix)
            _fix_imports(out)
            written.append(out)
    return written


if __name__ == "__main__":
    for f in generate():
        print(f.relative_to(HERE.parent.parent.parent), file=sys.stdout)
