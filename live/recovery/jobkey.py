"""The job key: one secret per job that authenticates Meshpact's own out-of-band paths.

Meshpact's peer-copy servers and the values it writes on the control channel carry model state
and recovery decisions; anyone on the network who can reach a port could otherwise read, poison
or steer them. Every rank of a job holds the same 32-byte key and proves it with an HMAC
(SHA-256) over what it sends. The key never travels through a store or a socket:

| where the key comes from | when |
|---|---|
| ``MESHPACT_JOB_KEY`` (64 hex digits) | set by the user, or by ``meshpact launch`` for its workers |
| ``MESHPACT_JOB_KEY_FILE`` (a file of 64 hex digits, mode 0600) | set by the user (a cluster's secret store mounts one) |
| a key file made for the job in a 0700 folder of the user's | one host, neither of the above set: every rank of the job on that host finds the same file |
| none: refused | several hosts and neither set, unless ``MESHPACT_UNAUTHENTICATED=1`` names the opt-out |

A key is split by purpose (:meth:`JobKey.derive`) so a tag made for one path is never accepted
on another.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

__all__ = [
    "JobKey",
    "JobKeyError",
    "KEY_ENV",
    "KEY_FILE_ENV",
    "UNAUTHENTICATED_ENV",
    "draw",
    "load",
    "job_key_folder",
    "write_key_file",
]

KEY_ENV = "MESHPACT_JOB_KEY"
KEY_FILE_ENV = "MESHPACT_JOB_KEY_FILE"
UNAUTHENTICATED_ENV = "MESHPACT_UNAUTHENTICATED"
KEY_BYTES = 32
TAG_BYTES = 32  # an HMAC-SHA256 tag


class JobKeyError(ValueError):
    """The job key could not be had: the message says which setting to fix."""


@dataclass(frozen=True)
class JobKey:
    """A job's secret and where it came from (the secret is never printed)."""

    secret: bytes = field(repr=False)
    source: str

    def __post_init__(self) -> None:
        if len(self.secret) != KEY_BYTES:
            raise JobKeyError(f"a job key is {KEY_BYTES} bytes, this one {len(self.secret)}")

    def derive(self, purpose: str) -> "JobKey":
        """The key for one path (``"peer"``, ``"control"``): a tag made with one is refused by another."""
        sub = hmac.new(self.secret, b"meshpact/" + purpose.encode(), hashlib.sha256).digest()
        return JobKey(sub, f"{self.source}, for {purpose}")

    def mac(self, *parts: bytes | str) -> bytes:
        """The HMAC of ``parts``, each length-prefixed (no two splits of the same bytes share a tag)."""
        h = hmac.new(self.secret, digestmod=hashlib.sha256)
        for part in parts:
            raw = part.encode() if isinstance(part, str) else bytes(part)
            h.update(len(raw).to_bytes(8, "big"))
            h.update(raw)
        return h.digest()

    def verify(self, tag: bytes, *parts: bytes | str) -> bool:
        """Whether ``tag`` is this key's :meth:`mac` of ``parts`` (compared in constant time)."""
        return len(tag) == TAG_BYTES and hmac.compare_digest(tag, self.mac(*parts))


def draw(source: str = "drawn for this job") -> JobKey:
    """A fresh key from the operating system's random source."""
    return JobKey(secrets.token_bytes(KEY_BYTES), source)


def _parse(text: str, where: str) -> bytes:
    text = text.strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != KEY_BYTES:
        raise JobKeyError(
            f"{where}: expected {2 * KEY_BYTES} hex digits (a {KEY_BYTES}-byte key), "
            f"found {len(text)} characters; make one with `python -c 'import secrets; "
            "print(secrets.token_hex(32))'`"
        )
    return raw


def write_key_file(key: JobKey, path: Path) -> Path:
    """Write ``key`` to ``path`` readable by its owner only (0600), atomically: a reader finds the
    whole key or no file. Raises FileExistsError where ``path`` exists (its key wins)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".key-")  # mkstemp makes it 0600
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(key.secret.hex())
            fh.flush()
            os.fsync(fh.fileno())
        os.link(tmp, path)  # fails where another rank linked its key first
    finally:
        os.unlink(tmp)
    return path


def _read_key_file(path: Path, what: str) -> JobKey:
    try:
        st = path.stat()
        text = path.read_text()
    except OSError as exc:
        raise JobKeyError(f"{what} {path}: cannot be read ({exc.strerror})") from None
    if st.st_mode & 0o077:
        raise JobKeyError(
            f"{what} {path}: mode {oct(st.st_mode & 0o777)} lets others read it; expected 0600 (chmod 600 {path})"
        )
    return JobKey(_parse(text, f"{what} {path}"), f"{what} {path}")


def job_key_folder(identity: str, env: Mapping[str, str]) -> Path:
    """The 0700 folder where one host's ranks of the job named ``identity`` find their key."""
    base = Path(env.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()) / f"meshpact-{os.getuid()}"
    return base / hashlib.sha256(identity.encode()).hexdigest()[:24]


def load(env: Mapping[str, str], identity: str, multi_host: bool) -> JobKey | None:
    """This rank's job key, from the table in the module docstring; None only where the user opted
    out by name (``MESHPACT_UNAUTHENTICATED=1``). ``identity`` names the job on one host (its run id
    and rendezvous address); ``multi_host`` whether the job spans hosts. Raises JobKeyError with
    the setting to fix."""
    if env.get(KEY_ENV):
        return JobKey(_parse(env[KEY_ENV], KEY_ENV), KEY_ENV)
    if env.get(KEY_FILE_ENV):
        return _read_key_file(Path(env[KEY_FILE_ENV]), KEY_FILE_ENV)
    if env.get(UNAUTHENTICATED_ENV, "") == "1":
        return None
    if multi_host:
        raise JobKeyError(
            f"this job spans hosts and has no job key: set {KEY_ENV} (64 hex digits, the same on "
            f"every host) or {KEY_FILE_ENV} (a 0600 file holding them); `meshpact launch` sets it "
            f"for its workers; {UNAUTHENTICATED_ENV}=1 runs without authentication on a trusted network"
        )
    folder = job_key_folder(identity, env)
    for f in (folder.parent, folder):
        f.mkdir(mode=0o700, exist_ok=True)
    for f in (folder.parent, folder):  # another user's folder on the way could swap the key
        st = f.lstat()
        if st.st_uid != os.getuid() or st.st_mode & 0o077 or not f.is_dir() or f.is_symlink():
            raise JobKeyError(
                f"key folder {f}: expected a folder of this user's with mode 0700 "
                f"(found mode {oct(st.st_mode & 0o777)}, owner uid {st.st_uid}); remove it or set {KEY_ENV}"
            )
    path = folder / "key"
    if not path.exists():
        try:
            write_key_file(draw(), path)
        except FileExistsError:
            pass  # another rank of the job on this host made it first
    return _read_key_file(path, "per-job key file")
