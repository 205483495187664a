"""Checkpoint manifests: per-file digests, durable writes, and what a killed save leaves behind.

A checkpoint counts only once its bytes are known to be on storage and known to be the bytes
that were written. Every folder a :class:`~meshpact.live.recovery.checkpoint.Checkpointer`
writes (a rank's part, a step's merged checkpoint) ends with a ``manifest.json`` naming each of
its files with its size and SHA-256 digest; the manifest is written last, after every file and
the folder itself are fsynced, and its own rename into place is fsynced through the parent
folder. A reader compares sizes (a torn or truncated file) and digests (a flipped bit, a file
rewritten) against it before trusting a byte.

Temporary names carry the writer's host and process id (``.<name>~<host>~<pid>~<thread>~tmp``),
so a later start on the same host removes exactly what a dead writer left (a save killed with
``kill -9`` mid-write) and never a live writer's folder.

The digests detect corruption, not forgery: the manifest lies beside the files it names, so
whoever can write the checkpoint folder can write both. The folder must be writable by the
job's user only (the docs' trusted-folder assumption).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Mapping

from meshpact.core.errors import MeshpactError

__all__ = [
    "MANIFEST",
    "DIGEST",
    "FileDigest",
    "CheckpointCorrupt",
    "digest_file",
    "digest_bytes",
    "digest_and_sync",
    "read_manifest",
    "write_manifest",
    "damage",
    "write_synced",
    "durable_write",
    "fsync_dir",
    "fsync_file",
    "temp_path",
    "clean_dead_temps",
]

MANIFEST = "manifest.json"
DIGEST = "sha256"
_FORMAT = "meshpact-checkpoint-manifest/1"
_MANIFEST_MAX_BYTES = 16 << 20  # a manifest names files, not data: anything larger is not one
_SEP = "~"  # in temporary names: no hostname, pid or file name of ours contains it


class CheckpointCorrupt(MeshpactError):
    """A checkpoint whose files do not match their manifest, or that storage cannot read back."""


@dataclass(frozen=True)
class FileDigest:
    """One file of a checkpoint as it was written: its size and its SHA-256 digest (hex)."""

    size: int
    sha256: str


def digest_bytes(data: bytes | memoryview) -> FileDigest:
    return FileDigest(len(data), hashlib.sha256(data).hexdigest())


def digest_file(path: Path) -> FileDigest:
    with open(path, "rb") as f:
        h = hashlib.file_digest(f, DIGEST)
        return FileDigest(f.tell(), h.hexdigest())


def write_manifest(folder: Path, files: Mapping[str, FileDigest]) -> None:
    """Write ``folder/manifest.json`` durably (see :func:`durable_write`)."""
    body = {
        "format": _FORMAT,
        "digest": DIGEST,
        "files": {name: [d.size, d.sha256] for name, d in sorted(files.items())},
    }
    durable_write(folder / MANIFEST, json.dumps(body, indent=0).encode())


def read_manifest(folder: Path) -> dict[str, FileDigest]:
    """The files ``folder/manifest.json`` names; :class:`CheckpointCorrupt` in one line when it is
    missing, too large, or not a manifest of this format."""
    path = folder / MANIFEST
    try:
        size = path.stat().st_size
        if size > _MANIFEST_MAX_BYTES:
            raise CheckpointCorrupt(f"{path} is {size} bytes, more than a manifest's {_MANIFEST_MAX_BYTES}")
        body = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointCorrupt(
            f"{path} is missing (a save that did not finish, or not a Meshpact checkpoint)"
        ) from None
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointCorrupt(f"{path} cannot be read as a manifest ({str(exc)[:200]})") from None
    files = body.get("files") if isinstance(body, dict) and body.get("format") == _FORMAT else None
    if not isinstance(files, dict):
        raise CheckpointCorrupt(f"{path} is not a {_FORMAT} manifest")
    out: dict[str, FileDigest] = {}
    for name, entry in files.items():
        ok = (
            isinstance(entry, list)
            and len(entry) == 2
            and type(entry[0]) is int
            and entry[0] >= 0
            and isinstance(entry[1], str)
            and len(entry[1]) == 64
            and _safe_name(name)
        )
        if not ok:
            raise CheckpointCorrupt(
                f"{path} names {name!r} with {entry!r}: expected a relative file name, [size, sha256 hex]"
            )
        out[name] = FileDigest(entry[0], entry[1])
    return out


def _safe_name(name: str) -> bool:
    """A name inside the folder: relative, no ``..``, no empty part."""
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def damage(folder: Path, files: Mapping[str, FileDigest], digests: bool = True) -> str | None:
    """What is wrong with ``folder``'s files against ``files`` (one line), or None when every file
    is there at its size and (``digests``) matches its digest. Sizes are checked first, so a torn
    checkpoint is named without reading it."""
    for name, want in files.items():
        try:
            size = (folder / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing"
        if size != want.size:
            return f"{name} is {size} bytes, the manifest says {want.size} (a torn or truncated file)"
    if digests:
        for name, want in files.items():
            got = digest_file(folder / name)
            if got != want:
                return f"{name} does not match its {DIGEST} digest (a flipped bit or a rewritten file)"
    return None


def fsync_dir(path: Path) -> None:
    """Make ``path``'s entries (files created, renamed or removed in it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def digest_and_sync(paths: list[Path]) -> dict[str, FileDigest]:
    """Each file's digest, by name, and each file fsynced. The digests are read from the page
    cache while another thread waits on storage for the same files, so this costs about the
    longer of the two rather than their sum; a failed fsync is raised here."""
    failed: list[OSError] = []

    def sync() -> None:
        try:
            for p in paths:
                fsync_file(p)
        except OSError as exc:
            failed.append(exc)

    syncing = threading.Thread(target=sync, name="meshpact-ckpt-fsync", daemon=True)
    syncing.start()
    try:
        digests = {p.name: digest_file(p) for p in paths}
    finally:
        syncing.join()
    if failed:
        raise failed[0]
    return digests


def write_synced(path: Path, data: bytes) -> FileDigest:
    """Write ``data`` to ``path`` and fsync it (a file inside a folder not yet renamed into
    place); returns the digest of what was written."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return digest_bytes(data)


def durable_write(path: Path, data: bytes) -> FileDigest:
    """Write ``data`` to ``path`` atomically and durably: a temporary file fsynced, renamed into
    place, the folder fsynced. Returns the digest of what was written."""
    tmp = temp_path(path, "tmp")
    digest = write_synced(tmp, data)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return digest


def temp_path(path: Path, kind: str) -> Path:
    """A sibling of ``path`` for a write in progress (``kind`` ``tmp``) or a folder being replaced
    (``old``), named for this host, process and thread."""
    return path.with_name(
        _SEP.join((f".{path.name}", socket.gethostname(), str(os.getpid()), str(threading.get_ident()), kind))
    )


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a running process on this host (a zombie, killed and not yet reaped, is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]


def clean_dead_temps(folders: Iterable[Path]) -> list[Path]:
    """Remove, in each of ``folders``, the temporary files and folders a writer on this host left
    when it died; returns what was removed. A live writer's, or another host's, are left alone."""
    host = socket.gethostname()
    removed: list[Path] = []
    for folder in folders:
        try:
            entries = list(folder.iterdir())
        except (FileNotFoundError, NotADirectoryError):
            continue
        before = len(removed)
        for entry in entries:
            parts = entry.name.split(_SEP)
            if (
                len(parts) != 5
                or not parts[0].startswith(".")
                or parts[1] != host
                or not parts[2].isdigit()
                or parts[4] not in ("tmp", "old")
                or _pid_alive(int(parts[2]))
            ):
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
        if len(removed) > before:
            fsync_dir(folder)
    return removed
