"""Local-disk primitives of the commit protocol: durable temp files, atomic replace, no-clobber create, and a
hashing read straight into Arrow memory."""

from __future__ import annotations

import os
import uuid

import pyarrow as pa

from ..digests import new_hasher


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def write_local_temp(path: str, data: bytes) -> str:
    """Write `data` durably to a unique hidden sibling of `path` and return its name."""
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{name}.tmp-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        unlink_quiet(tmp)
        raise
    return tmp


def write_local_atomic(path: str, data: bytes) -> None:
    tmp = write_local_temp(path, data)
    try:
        os.replace(tmp, path)
    except BaseException:
        unlink_quiet(tmp)
        raise


def create_local_exclusive(path: str, data: bytes) -> bool:
    """Create `path` with `data` unless it exists; False if it did. Readers never see a partial file.

    A hard link of a complete temp file is both atomic and no-clobber. Filesystems without hard
    links fall back to O_EXCL, which is still exclusive but may expose a half-written file briefly.
    """
    tmp = write_local_temp(path, data)
    try:
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError:
            pass
    finally:
        unlink_quiet(tmp)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return True


_READ_CHUNK = 8 << 20


def read_local_hashed(path: str, algorithm: str) -> tuple[pa.Buffer, str]:
    """A local file read straight into Arrow memory, hashed chunk by chunk while each is still in cache."""
    digest = new_hasher(algorithm)
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        buf = pa.allocate_buffer(size, memory_pool=pa.system_memory_pool())  # see codec.arrow_owned
        view = memoryview(buf).cast("B") if size else memoryview(b"")
        done = 0
        while done < size:
            got = fh.readinto(view[done : min(size, done + _READ_CHUNK)])
            if not got:
                break  # the file shrank under us: the size check reports it
            digest.update(view[done : done + got])
            done += got
    return (buf if done == size else buf.slice(0, done)), digest.hexdigest()


def hash_local_file(path: str, algorithm: str) -> str:
    """The digest of a local file, read chunk by chunk into one reused buffer."""
    hasher = new_hasher(algorithm)
    chunk = bytearray(_READ_CHUNK)
    view = memoryview(chunk)
    with open(path, "rb", buffering=0) as fh:
        while got := fh.readinto(chunk):
            hasher.update(view[:got])
    return hasher.hexdigest()
