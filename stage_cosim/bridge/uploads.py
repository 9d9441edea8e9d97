"""Receive a trace set over a client stream: checked names, sizes and digests, all or nothing.

The client first sends a header listing every file with its size and SHA-256, then the bytes in
chunks (at most 1 MiB each), file after file. The server refuses the whole upload — and keeps
nothing — on an unsafe name, a size over the limit, bytes out of order or a digest mismatch. A
finished upload is content-addressed: the same files give the same id, stored once.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Any, AsyncIterator, BinaryIO

import grpc

from stage_cosim.bridge.codec import dumps
from stage_cosim.bridge.paths import check_relative
from stage_cosim.bridge.proto.stagecosim.v1 import bridge_pb2 as pb
from stage_cosim.bridge.status import RpcAbort, invalid
from stage_cosim.errors import UserError

CHUNK_BYTES = 1 << 20
UPLOAD_ID = re.compile(r"^u-[0-9a-f]{32}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def manifest_digest(files: list[pb.FileSpec]) -> str:
    return hashlib.sha256(dumps(sorted([f.path, f.sha256] for f in files)).encode()).hexdigest()


class UploadStore:
    def __init__(self, root: Path, max_bytes: int, max_files: int = 1_000_000) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.max_files = max_files

    def clean(self) -> int:
        """Remove what uploads cut short by a crash left behind (at start, before serving)."""
        left = [p for p in self.root.iterdir() if p.name.startswith((".incoming-", ".u-"))] if self.root.is_dir() else []
        for p in left:
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return len(left)

    def path(self, upload_id: str, field: str = "upload_id") -> Path:
        """The directory of a finished upload; INVALID_ARGUMENT or NOT_FOUND otherwise."""
        if not UPLOAD_ID.match(upload_id or ""):
            raise invalid(field, f"is not an upload id, got {upload_id!r}")
        directory = self.root / upload_id
        if not directory.is_dir():
            raise RpcAbort(grpc.StatusCode.NOT_FOUND, f"{field}: no upload {upload_id!r}", "NOT_FOUND", field)
        return directory

    def index(self, upload_id: str) -> list[dict[str, Any]]:
        self.path(upload_id)
        return json.loads((self.root / f"{upload_id}.json").read_text())["files"]

    def _check_header(self, header: pb.UploadHeader) -> None:
        if not header.files:
            raise invalid("files", "the header lists no files")
        if len(header.files) > self.max_files:
            raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"files: more than {self.max_files} files",
                           "TOO_LARGE", "files")
        seen: set[str] = set()
        total = 0
        for i, f in enumerate(header.files):
            try:
                check_relative(f.path, f"files[{i}].path")
            except UserError as exc:
                raise invalid(exc.parameter, exc.rule) from None
            if f.path in seen:
                raise invalid(f"files[{i}].path", f"{f.path!r} is listed twice")
            seen.add(f.path)
            if f.size < 0:
                raise invalid(f"files[{i}].size", "must not be negative")
            if not _HEX64.match(f.sha256):
                raise invalid(f"files[{i}].sha256", "must be 64 lowercase hex digits")
            total += f.size
        folders = {f.path.rsplit("/", k)[0] for f in header.files for k in range(1, f.path.count("/") + 1)}
        for i, f in enumerate(header.files):
            if f.path in folders:
                raise invalid(f"files[{i}].path", f"{f.path!r} is both a file and a folder of other files")
        if total > self.max_bytes:
            raise RpcAbort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"upload: {total} bytes exceed the server's limit of {self.max_bytes}", "TOO_LARGE", "files")

    async def receive(self, stream: AsyncIterator[pb.UploadTracesRequest]) -> pb.Upload:
        loop = asyncio.get_running_loop()
        messages = aiter(stream)
        first = await anext(messages, None)
        if first is None or first.WhichOneof("part") != "header":
            raise invalid("header", "the first message must be the header")
        header = first.header
        self._check_header(header)
        specs = {f.path: f for f in header.files}
        order = [f.path for f in header.files]
        scratch = self.root / f".incoming-{secrets.token_hex(8)}"
        scratch.mkdir(parents=True)
        current: tuple[str, BinaryIO, Any] | None = None      # (path, file, hash)
        received = 0
        position = 0
        try:
            async for msg in messages:
                if msg.WhichOneof("part") != "chunk":
                    raise invalid("header", "only the first message may be a header")
                chunk = msg.chunk
                if current is None or chunk.path != current[0]:
                    if current is not None:
                        await loop.run_in_executor(None, self._close, current, specs[current[0]])
                        position += 1
                    # files come in the header's order
                    while position < len(order) and specs[order[position]].size == 0 and order[position] != chunk.path:
                        await loop.run_in_executor(None, self._write_empty, scratch, order[position])
                        position += 1
                    if position >= len(order) or order[position] != chunk.path:
                        raise invalid("chunk.path", f"{chunk.path!r} is not the next file of the header")
                    current = await loop.run_in_executor(None, self._open, scratch, chunk.path)
                    written = 0
                spec = specs[chunk.path]
                if chunk.offset != written:
                    raise invalid("chunk.offset", f"expected {written} for {chunk.path!r}, got {chunk.offset}")
                if len(chunk.data) > CHUNK_BYTES:
                    raise invalid("chunk.data", f"chunks carry at most {CHUNK_BYTES} bytes")
                written += len(chunk.data)
                received += len(chunk.data)
                if written > spec.size or received > self.max_bytes:
                    raise invalid("chunk", f"{chunk.path!r} is longer than the header said ({spec.size} bytes)")
                await loop.run_in_executor(None, self._write, current, chunk.data)
            if current is not None:
                await loop.run_in_executor(None, self._close, current, specs[current[0]])
                current = None
                position += 1
            for path in order[position:]:
                if specs[path].size:
                    raise invalid("chunk", f"the stream ended before {path!r}")
                await loop.run_in_executor(None, self._write_empty, scratch, path)
            return await loop.run_in_executor(None, self._commit, scratch, list(header.files))
        finally:
            if current is not None:
                current[1].close()
            if scratch.exists():
                shutil.rmtree(scratch, ignore_errors=True)

    # -- blocking helpers (run in the executor) ----------------------------------------------------

    @staticmethod
    def _open(scratch: Path, rel: str) -> tuple[str, BinaryIO, Any]:
        path = scratch / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        return rel, open(path, "xb"), hashlib.sha256()

    @staticmethod
    def _write(current: tuple[str, BinaryIO, Any], data: bytes) -> None:
        current[1].write(data)
        current[2].update(data)

    @staticmethod
    def _close(current: tuple[str, BinaryIO, Any], spec: pb.FileSpec) -> None:
        rel, f, h = current
        size = f.tell()
        f.close()
        if size != spec.size:
            raise invalid("chunk", f"{rel!r} has {size} bytes, the header said {spec.size}")
        if h.hexdigest() != spec.sha256:
            raise RpcAbort(grpc.StatusCode.DATA_LOSS, f"sha256: {rel!r} does not match its digest",
                           "DIGEST_MISMATCH", "sha256")

    @classmethod
    def _write_empty(cls, scratch: Path, rel: str) -> None:
        current = cls._open(scratch, rel)
        cls._close(current, pb.FileSpec(path=rel, size=0, sha256=hashlib.sha256().hexdigest()))

    def _commit(self, scratch: Path, files: list[pb.FileSpec]) -> pb.Upload:
        digest = manifest_digest(files)
        upload = pb.Upload(upload_id=f"u-{digest[:32]}", files=files, total_bytes=sum(f.size for f in files),
                           sha256=digest)
        final = self.root / upload.upload_id
        if final.is_dir():
            shutil.rmtree(scratch, ignore_errors=True)       # the same files are already here
            return upload
        index = {"files": [{"path": f.path, "size": f.size, "sha256": f.sha256} for f in files]}
        tmp = self.root / f".{upload.upload_id}.json.partial"
        tmp.write_text(json.dumps(index))
        os.replace(tmp, self.root / f"{upload.upload_id}.json")
        os.replace(scratch, final)
        return upload
