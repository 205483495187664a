"""Checkpoints in ``torch.distributed.checkpoint`` (DCP) format: the baselines in-memory
recovery is measured against, the state an excision below ``min_ranks`` flushes, and what a
replacement falls back to.

:class:`Checkpointer` writes every rank's job state (:func:`~meshpact.live.recovery.state.job_state`:
parameter shards, optimizer state, generators, schedule, buffers) every K steps. A step's
directory is one DCP checkpoint:

====================================  ==================================================================
``step<N>/rank<r>/``                  rank ``r``'s *part*: its state as a DCP checkpoint of its own,
                                      ``chunks.json``, where its sharded tensors lie in the whole ones,
                                      and ``manifest.json``, every file's size and digest (written last)
``step<N>/groups.distcp``             each parameter's param-group settings (``lr``, ``betas``...)
``step<N>/.metadata``                 the merged metadata
``step<N>/manifest.json``             every file of the step, parts included, with its size and digest:
                                      written last, its presence makes the checkpoint complete
====================================  ==================================================================

The merged metadata names every tensor twice, over the same bytes:

- ``meshpact.rank<r>.<key>``: rank ``r``'s state exactly as it was (what a restore reads: bit
  for bit, generators and schedule included);
- the names torch's own loops use, so a plain FSDP2 or torchtitan loop of any world size loads
  the model and the optimizer with ``dcp.load`` (DCP re-shards by chunk): ``model.<fqn>`` for
  parameters (every rank's chunk) and buffers (rank 0's), ``optim.state.<fqn>.<k>`` and
  ``optim.param_groups.<fqn>.<k>`` for the optimizer, the layout of
  ``get_optimizer_state_dict(..., options=StateDictOptions(flatten_optimizer_state_dict=True))``.

Nothing here is a collective. Each rank writes its part into a temporary directory, fsyncs
its files and the directory, renames it into place and fsyncs the step's directory; whoever
then finds every part present merges the metadata (the last writer always does; two racing
write the same bytes, each by an atomic rename). So a survivor can write a lost rank's part
(an excision's flush) and no working process group is needed. A save killed before its part is
in place leaves the step as it was (without that part, or with the part's earlier whole copy)
and a temporary directory the next :class:`Checkpointer` on that host removes
(:mod:`.manifest`); killed after, its part is whole and the step is merged by whoever next
finds every part. Where a part
says nothing of its chunks (``save`` without ``chunks``), tensors are taken as a 1-D FSDP2
``Shard(0)`` cut (``torch.chunk`` rows in rank order), which the merge checks; a cut it cannot
confirm leaves those tensors under their ``meshpact.`` names only.

:meth:`Checkpointer.latest` picks the newest checkpoint whose every file matches the step's
manifest (size and digest): a torn, truncated or flipped one is passed over, named in one
logged line and in the answer (:class:`CheckpointStep`), for the newest older complete one.
:meth:`Checkpointer.load` checks this rank's part against its manifest before reading it, and
refuses a damaged one (:class:`~meshpact.live.recovery.manifest.CheckpointCorrupt`, which also
stands for DCP's ``CheckpointException``, a ``BaseException``). Given ``like`` (the state it
expects) it also reads a checkpoint a plain loop wrote with ``dcp.save({"model": ..., "optim": ...})``,
each tensor's chunk of this rank (``chunks``) or the whole of it.

:class:`AsyncCheckpointer` measures the alternative of checkpointing after *every* update
without stalling the step: the state is copied into host buffers on the training thread and
a background thread writes them as a DCP part. It reports the step-latency overhead, the host
memory the buffers take, and the storage written per hour at the measured step rate.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import os
import pickle
import queue
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .manifest import (
    MANIFEST,
    CheckpointCorrupt,
    FileDigest,
    clean_dead_temps,
    damage,
    digest_and_sync,
    digest_file,
    durable_write,
    fsync_dir,
    read_manifest,
    temp_path,
    write_manifest,
    write_synced,
)
from .state import SCHEDULE_KEY, Chunk, shard_rows

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = [
    "Checkpointer",
    "CheckpointStep",
    "CheckpointCorrupt",
    "AsyncCheckpointer",
    "AsyncCheckpointStats",
    "state_bytes",
    "global_name",
    "PRIVATE",
]

_log = logging.getLogger(__name__)

PRIVATE = "meshpact"  # the merged metadata's prefix for each rank's own state
_CHUNKS = "chunks.json"
_GROUPS = "groups.distcp"
_METADATA = ".metadata"


def state_bytes(state: Mapping[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


def _plain_fqn(name: str) -> str:
    """A parameter's name as torch's state-dict helpers give it (no compile or activation-checkpoint wrappers)."""
    return name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")


def global_name(key: str) -> str | None:
    """The name a plain loop's DCP state dict gives a job-state key (``param/w`` -> ``model.w``,
    ``optim/w/exp_avg`` -> ``optim.state.w.exp_avg``, ``buffer/b`` -> ``model.b``); None for
    what only Meshpact keeps (generators, schedule)."""
    kind, _, rest = key.partition("/")
    if kind in ("param", "buffer"):
        return f"model.{_plain_fqn(rest)}"
    if kind == "optim":
        fqn, _, slot = rest.rpartition("/")
        return f"optim.state.{_plain_fqn(fqn)}.{slot}"
    return None


def _dcp_quietly(fn: Any, *args: Any, **kw: Any) -> Any:
    """``dcp.save``/``dcp.load`` of one process (``no_dist``), without its warning that no group is used."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load) in a single process.*")
        return fn(*args, no_dist=True, **kw)


def write_part(directory: Path, state: Mapping[str, torch.Tensor], chunks: Mapping[str, Chunk] | None) -> int:
    """Write ``state`` as a DCP checkpoint of its own at ``directory`` (replaced whole, by a
    rename), with its chunks and its manifest, durably (module docstring); returns the bytes
    written."""
    import torch.distributed.checkpoint as dcp

    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(directory, "tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    # the tensors as they are: DCP serialises each to the file, no copy of the state is made first
    _dcp_quietly(
        dcp.save, {k: v.detach() for k, v in state.items()}, storage_writer=dcp.FileSystemWriter(tmp, sync_files=False)
    )
    files: dict[str, FileDigest] = {}
    if chunks is not None:
        body = json.dumps({k: [list(c.global_shape), list(c.offsets)] for k, c in chunks.items()}).encode()
        files[_CHUNKS] = write_synced(tmp / _CHUNKS, body)
    files.update(digest_and_sync([f for f in tmp.iterdir() if f.name not in files]))
    write_manifest(tmp, files)
    if directory.exists():
        old = temp_path(directory, "old")
        os.replace(directory, old)
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, directory)
        fsync_dir(directory.parent)
    fsync_dir(directory.parent.parent)  # the step's own entry, where this save made its directory
    return sum(f.stat().st_size for f in directory.iterdir())


def _unreadable(where: Path, exc: BaseException) -> CheckpointCorrupt:
    """DCP's refusal to read (``CheckpointException``, a ``BaseException``, or a torn pickle) as one line."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return CheckpointCorrupt(f"{where} cannot be read back: {first[:300]}")


def _tensor_entry(m: object) -> TensorStorageMetadata:
    """A state-dict entry of a checkpoint written here: a tensor's (DCP's format has bytes entries too)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if not isinstance(m, TensorStorageMetadata):
        raise TypeError(f"expected a tensor's entry, found {type(m).__name__}")
    return m


def _read_part(directory: Path, keys: set[str] | None = None) -> dict[str, torch.Tensor]:
    """The tensors of a part (``keys``: only those), each in a buffer of its own."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        meta = dcp.FileSystemReader(directory).read_metadata()
        entries = {k: _tensor_entry(m) for k, m in meta.state_dict_metadata.items() if keys is None or k in keys}
        out = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype) for k, m in entries.items()}
        _dcp_quietly(dcp.load, out, storage_reader=dcp.FileSystemReader(directory))
    except (CheckpointException, Exception) as exc:  # noqa: BLE001  (whatever storage hands back is refused)
        raise _unreadable(directory, exc) from exc
    return out


class CheckpointStep(int):
    """The step :meth:`Checkpointer.latest` found (an ``int``), with the newer checkpoints it
    passed over and why (``passed_over``: one entry per step, newest first)."""

    passed_over: tuple[str, ...]

    def __new__(cls, step: int, passed_over: tuple[str, ...] = ()) -> "CheckpointStep":
        found = super().__new__(cls, step)
        found.passed_over = passed_over
        return found

    def note(self) -> str:
        """One line for a log or a decision's reason; empty where nothing was passed over."""
        return f"passed over {'; '.join(self.passed_over)}; using step {int(self)}" if self.passed_over else ""


class Checkpointer:
    """One rank's side of the periodic DCP checkpoints (see the module docstring). Making one
    removes what saves that died on this host left in the directory's steps."""

    def __init__(self, directory: str | os.PathLike[str], rank: int, world_size: int, every: int) -> None:
        if every < 1:
            raise ValueError(f"checkpoint interval must be >= 1 step, got {every}")
        self.directory = Path(directory)
        self.rank = rank
        self.world_size = world_size
        self.every = every
        self.bytes_written = 0
        self.bytes_read = 0  # by load(): what restores cost in storage reads
        self.cleaned = clean_dead_temps(self._steps_dirs())  # what a killed save left: nobody will finish it

    def _steps_dirs(self) -> list[Path]:
        return [p for p in self.directory.glob("step*") if p.name[4:].isdigit() and p.is_dir()]

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def step_dir(self, step: int) -> Path:
        return self.directory / f"step{step:08d}"

    def path(self, step: int, rank: int | None = None) -> Path:
        """The directory of one rank's part of the checkpoint of ``step``."""
        return self.step_dir(step) / f"rank{self.rank if rank is None else rank}"

    def save(self, step: int, state: Mapping[str, torch.Tensor], chunks: Mapping[str, Chunk] | None = None) -> int:
        """Write this rank's ``state`` for ``step`` as its part (``chunks``: where its sharded
        tensors lie, :func:`~meshpact.live.recovery.state.global_chunks`), and the merged
        metadata if every part is there now; returns the bytes written."""
        top = self.step_dir(step)
        if top.exists():  # a part rewritten: the step is incomplete until merged again below
            (top / MANIFEST).unlink(missing_ok=True)
            (top / _METADATA).unlink(missing_ok=True)
            fsync_dir(top)
        size = write_part(self.path(step), state, chunks)
        self.bytes_written += size
        self.complete(step)
        return size

    def complete(self, step: int) -> bool:
        """Whether the checkpoint of ``step`` is complete: its manifest written (merging its
        metadata when every part is there and nobody has yet). Nothing is read or digested."""
        return self._incomplete(step) is None

    def _incomplete(self, step: int) -> str | None:
        """Why the checkpoint of ``step`` is not complete (one line), or None when it is."""
        top = self.step_dir(step)
        if (top / MANIFEST).exists():
            return None
        absent = [r for r in range(self.world_size) if not (self.path(step, r) / MANIFEST).exists()]
        if absent:
            return f"no finished part of rank(s) {absent[:8]}{' ...' if len(absent) > 8 else ''}"
        try:
            _merge(top, self.world_size)
        except CheckpointCorrupt as exc:
            return str(exc)
        return None

    def verify(self, step: int) -> str | None:
        """What is wrong with the complete checkpoint of ``step`` (one line: a file missing, torn,
        or not matching its digest), or None when every file matches the step's manifest."""
        top = self.step_dir(step)
        try:
            return damage(top, read_manifest(top))
        except CheckpointCorrupt as exc:
            return str(exc)

    def latest(self, limit: int, verify: bool = True) -> CheckpointStep:
        """The newest complete checkpoint at or before ``limit`` whose files all match their
        manifest (``verify`` off: complete only, nothing read; for bookkeeping, never for a
        restore). Newer ones passed over are named in the answer and in one logged line."""
        steps = sorted((int(p.name[4:]) for p in self._steps_dirs()), reverse=True)
        passed: list[str] = []
        for step in steps:
            if step > limit:
                continue
            why = self._incomplete(step)
            if why is None and verify:
                why = self.verify(step)
            if why is None:
                found = CheckpointStep(step, tuple(passed))
                if passed and verify:
                    _log.warning("checkpoints in %s: %s", self.directory, found.note())
                return found
            passed.append(f"step {step} ({why})")
        raise FileNotFoundError(
            f"no complete checkpoint at or before step {limit} in {self.directory}"
            + (f"; passed over {'; '.join(passed)}" if passed else "")
        )

    def load(
        self, step: int, like: Mapping[str, torch.Tensor] | None = None, chunks: Mapping[str, Chunk] | None = None
    ) -> dict[str, torch.Tensor]:
        """This rank's state at ``step``: its own part, bit for bit, once its files match their
        manifest (:class:`CheckpointCorrupt` names the file that does not). A checkpoint without
        parts (a plain loop's) is read by the names ``like``'s keys have there (:func:`global_name`),
        each key's chunk (``chunks``) or whole, with the optimizer state the checkpoint holds for
        each of ``like``'s parameters (cut as the parameter is: ``like`` may come from an optimizer
        that has not stepped); generators and schedule are left out. A plain loop's checkpoint
        has no manifest to check it against: DCP's own reading is all that stands behind it."""
        part = self.path(step)
        top = self.step_dir(step)
        if part.exists():
            try:
                why = damage(part, read_manifest(part))
            except CheckpointCorrupt as exc:
                why = str(exc)
            if why is not None:
                raise CheckpointCorrupt(
                    f"refusing rank {self.rank}'s part of the checkpoint of step {step} in "
                    f"{top}: {why}; restore an older step (Checkpointer.latest passes over "
                    "this one)"
                )
            self.bytes_read += sum(f.stat().st_size for f in part.iterdir())
            return _read_part(part)
        if like is None or not (top / _METADATA).exists():
            raise FileNotFoundError(
                f"no part of rank {self.rank} in {top}" + ("" if like is None else " and no DCP metadata there")
            )
        if (top / MANIFEST).exists():
            why = self.verify(step)
            if why is not None:
                raise CheckpointCorrupt(f"refusing the checkpoint of step {step} in {top}: {why}")
        state, read = _read_global(top, like, chunks or {})
        self.bytes_read += read
        return state


# -- the merge ---------------------------------------------------------------------------------
def _part_chunks(part: Path) -> dict[str, Chunk] | None:
    path = part / _CHUNKS
    if not path.exists():
        return None
    return {k: Chunk(tuple(g), tuple(o)) for k, (g, o) in json.loads(path.read_text()).items()}


def _inferred_chunks(metas: list[Any]) -> dict[int, dict[str, Chunk]]:
    """The 1-D FSDP2 ``Shard(0)`` reading of every part's parameters and optimizer state (rows in
    rank order, as ``torch.chunk`` cuts them); keys whose rows do not fit that cut are left out."""

    world = len(metas)
    out: dict[int, dict[str, Chunk]] = {r: {} for r in range(world)}
    for key, m in metas[0].state_dict_metadata.items():
        if not key.startswith(("param/", "optim/")) or len(m.size) == 0:
            continue
        sizes = [tuple(md.state_dict_metadata[key].size) if key in md.state_dict_metadata else None for md in metas]
        if any(s is None or len(s) != len(m.size) or s[1:] != tuple(m.size)[1:] for s in sizes):
            continue
        given = [s for s in sizes if s is not None]  # all of them
        rows = sum(s[0] for s in given)
        if any(s[0] != shard_rows(rows, world, r)[1] for r, s in enumerate(given)):
            continue
        for r in range(world):
            out[r][key] = Chunk((rows, *tuple(m.size)[1:]), (shard_rows(rows, world, r)[0],) + (0,) * (len(m.size) - 1))
    return out


def _part_manifests(top: Path, world: int) -> dict[str, FileDigest]:
    """Every part's files, named from ``top``, once each part's small files (its DCP metadata,
    its chunks, which the merge reads) match their digests and its large ones their sizes."""
    files: dict[str, FileDigest] = {}
    for r in range(world):
        part = top / f"rank{r}"
        own = read_manifest(part)
        small = {n: d for n, d in own.items() if n in (_METADATA, _CHUNKS)}
        why = damage(part, own, digests=False) or damage(part, small)
        if why is not None:
            raise CheckpointCorrupt(f"rank {r}'s part in {top}: {why}")
        files.update({f"rank{r}/{n}": d for n, d in own.items()})
        files[f"rank{r}/{MANIFEST}"] = digest_file(part / MANIFEST)
    return files


def _merge(top: Path, world: int) -> None:
    """Write ``top/.metadata``: every part's tensors under their ``meshpact.`` names and, where
    their chunks tile the whole tensor, under a plain loop's names (module docstring); then the
    step's manifest, which makes it complete."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    files = _part_manifests(top, world)
    try:
        metas = [dcp.FileSystemReader(top / f"rank{r}").read_metadata() for r in range(world)]
    except Exception as exc:  # noqa: BLE001  (a metadata file matching its digest that DCP cannot read)
        raise _unreadable(top, exc) from exc
    given = [_part_chunks(top / f"rank{r}") for r in range(world)]
    explicit = all(c is not None for c in given)
    chunks = {r: c for r, c in enumerate(given) if c is not None} if explicit else _inferred_chunks(metas)
    sd_meta: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    whole: dict[str, list[Any]] = {}  # a plain loop's name -> [metadata, elements covered]
    for r, meta in enumerate(metas):
        where = {idx.fqn: info for idx, info in meta.storage_data.items()}
        for key, entry_meta in meta.state_dict_metadata.items():
            m = _tensor_entry(entry_meta)
            info = dataclasses.replace(where[key], relative_path=f"rank{r}/{where[key].relative_path}")
            private = f"{PRIVATE}.rank{r}.{key}"
            sd_meta[private] = m
            storage[MetadataIndex(private, torch.Size([0] * len(m.size)))] = info
            name = global_name(key)
            chunk = chunks[r].get(key)
            if name is None or (chunk is None and r != 0):
                continue
            if chunk is None and not explicit and key.startswith(("param/", "optim/")) and len(m.size):
                continue  # a cut the 1-D reading could not confirm
            if chunk is None:
                chunk = Chunk(tuple(m.size), (0,) * len(m.size))
            offsets = torch.Size(chunk.offsets)
            entry = whole.setdefault(name, [TensorStorageMetadata(m.properties, torch.Size(chunk.global_shape), []), 0])
            if MetadataIndex(name, offsets) in storage or torch.Size(m.size).numel() == 0:
                continue  # a replica of a chunk already named (HSDP), or an empty shard
            entry[0].chunks.append(ChunkStorageMetadata(offsets, torch.Size(m.size)))
            entry[1] += torch.Size(m.size).numel()
            storage[MetadataIndex(name, offsets)] = info
    for name, (m, covered) in whole.items():
        if covered == m.size.numel():
            sd_meta[name] = m
        else:  # chunks that do not tile the tensor: no plain loop could read it right
            for idx in [i for i in storage if i.fqn == name]:
                del storage[idx]
    groups = _param_groups(top, sd_meta)
    if groups:
        buf = io.BytesIO()
        for name, value in groups.items():
            at = buf.tell()
            torch.save(value, buf)
            sd_meta[name] = BytesStorageMetadata()
            storage[MetadataIndex(name)] = dataclasses.replace(
                next(iter(storage.values())), relative_path=_GROUPS, offset=at, length=buf.tell() - at
            )
        files[_GROUPS] = durable_write(top / _GROUPS, buf.getvalue())
    merged = Metadata(sd_meta, planner_data={k: (k,) for k in sd_meta}, storage_data=storage, version=metas[0].version)
    files[_METADATA] = durable_write(top / _METADATA, pickle.dumps(merged))  # DCP's own format: a pickle
    write_manifest(top, files)


def _param_groups(top: Path, sd_meta: Mapping[str, Any]) -> dict[str, Any]:
    """``optim.param_groups.<fqn>.<setting>`` for every parameter of the model, from rank 0's
    committed schedule; empty where the optimizer has more than one param group (which
    parameter is in which is not part of the state)."""
    from .state import _schedule_from

    part = top / "rank0"
    if f"{PRIVATE}.rank0.{SCHEDULE_KEY}" not in sd_meta:
        return {}
    schedule = _schedule_from(_read_part(part, {SCHEDULE_KEY})[SCHEDULE_KEY])
    if len(schedule.groups) != 1:
        return {}
    fqns = sorted(
        {_plain_fqn(k[len(f"{PRIVATE}.rank0.param/") :]) for k in sd_meta if k.startswith(f"{PRIVATE}.rank0.param/")}
    )
    return {f"optim.param_groups.{fqn}.{k}": v for fqn in fqns for k, v in schedule.groups[0].items()}


# -- reading a plain loop's checkpoint ----------------------------------------------------------
def _read_global(
    top: Path, like: Mapping[str, torch.Tensor], chunks: Mapping[str, Chunk]
) -> tuple[dict[str, torch.Tensor], int]:
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return _read_global_unchecked(top, like, chunks)
    except (CheckpointException, EOFError, pickle.UnpicklingError, OSError) as exc:
        raise _unreadable(top, exc) from exc


def _read_global_unchecked(
    top: Path, like: Mapping[str, torch.Tensor], chunks: Mapping[str, Chunk]
) -> tuple[dict[str, torch.Tensor], int]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import LoadPlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    reader = dcp.FileSystemReader(top)
    meta = reader.read_metadata()
    names = {k: global_name(k) for k in like if not k.startswith("optim/")}
    shapes = {k: tuple(like[k].shape) for k in names}
    dtypes = {k: like[k].dtype for k in names}
    slots: dict[str, list[str]] = {}  # a parameter's plain name -> the optimizer slots the checkpoint has for it
    for name in meta.state_dict_metadata:
        if name.startswith("optim.state."):
            fqn, _, slot = name[len("optim.state.") :].rpartition(".")
            slots.setdefault(fqn, []).append(slot)
    chunks = dict(chunks)
    for key in [k for k in like if k.startswith("param/")]:
        fqn = _plain_fqn(key[len("param/") :])
        for slot in slots.get(fqn, ()):  # the optimizer's state, as the checkpoint has it (a fresh optimizer has none)
            okey, name = f"optim/{key[len('param/') :]}/{slot}", f"optim.state.{fqn}.{slot}"
            m = _tensor_entry(meta.state_dict_metadata[name])
            names[okey], dtypes[okey] = name, m.properties.dtype
            same = key in chunks and tuple(m.size) == chunks[key].global_shape
            shapes[okey] = shapes[key] if same else tuple(m.size)
            if same:
                chunks[okey] = chunks[key]
    missing = [n for k, n in names.items() if n is not None and n not in meta.state_dict_metadata]
    if missing:
        raise KeyError(
            f"the checkpoint in {top} has no {missing[:5]}{' ...' if len(missing) > 5 else ''}: "
            "it was written for another model"
        )
    out = {n: torch.empty(shapes[k], dtype=dtypes[k]) for k, n in names.items() if n is not None}

    class _ChunkPlanner(DefaultLoadPlanner):
        """Reads each tensor's chunk of this rank (offsets from ``chunks``; the whole tensor
        where none is given) into a plain tensor of the chunk's shape."""

        def create_local_plan(self) -> LoadPlan:
            assert self.metadata is not None  # set_up_planner gave it
            items = []
            for key, name in names.items():
                if name is None:
                    continue
                shape = out[name].shape
                offsets = chunks[key].offsets if key in chunks else (0,) * len(shape)
                items += create_read_items_for_chunk_list(
                    name,
                    _tensor_entry(self.metadata.state_dict_metadata[name]),
                    [ChunkStorageMetadata(torch.Size(offsets), torch.Size(shape))],
                )
            return LoadPlan(items)

        def resolve_tensor(self, read_item: Any) -> torch.Tensor:
            target = self.state_dict[read_item.dest_index.fqn]
            for dim, (at, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                target = target.narrow(dim, at, n)
            return target

    _dcp_quietly(dcp.load, out, storage_reader=reader, planner=_ChunkPlanner(flatten_state_dict=False))
    read = sum(t.numel() * t.element_size() for t in out.values())
    return {k: out[n] for k, n in names.items() if n is not None}, read


# -- checkpointing every update, in the background -----------------------------------------------
@dataclass(frozen=True)
class AsyncCheckpointStats:
    steps: int
    step_s_without: float  # median step latency, no checkpointing
    step_s_with: float  # median step latency, checkpoint after every update
    host_bytes: int  # host buffers held for the snapshot
    bytes_per_step: int
    write_s_mean: float

    @property
    def overhead(self) -> float:
        return self.step_s_with / self.step_s_without - 1.0 if self.step_s_without else 0.0

    @property
    def bytes_per_hour(self) -> float:
        return self.bytes_per_step * 3600.0 / self.step_s_with if self.step_s_with else 0.0

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "step_ms_without": self.step_s_without * 1e3,
            "step_ms_with": self.step_s_with * 1e3,
            "overhead": self.overhead,
            "host_bytes": self.host_bytes,
            "bytes_per_step": self.bytes_per_step,
            "storage_bytes_per_hour": self.bytes_per_hour,
            "write_ms_mean": self.write_s_mean * 1e3,
        }


class AsyncCheckpointer:
    """Snapshot to host buffers on the training thread, write them in the background as a DCP
    part (``<directory>/latest/rank<r>``, replaced by each write; one in flight)."""

    def __init__(self, directory: str | os.PathLike[str], rank: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        clean_dead_temps([self.directory / "latest"])  # a write that died with its process
        self.rank = rank
        self._buffers: dict[str, torch.Tensor] = {}
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._idle = threading.Event()
        self._idle.set()
        self.writes: list[float] = []
        self.bytes_written = 0
        self._thread = threading.Thread(target=self._writer, name="meshpact-async-ckpt", daemon=True)
        self._thread.start()

    @property
    def host_bytes(self) -> int:
        return state_bytes(self._buffers)

    @property
    def path(self) -> Path:
        """The part the newest write lies in."""
        return self.directory / "latest" / f"rank{self.rank}"

    def snapshot(self, step: int, state: Mapping[str, torch.Tensor]) -> None:
        self._idle.wait()  # one snapshot in flight: the buffers are reused
        self._idle.clear()
        for k, v in state.items():
            buf = self._buffers.get(k)
            if buf is None or buf.shape != v.shape or buf.dtype != v.dtype:
                self._buffers[k] = buf = torch.empty_like(v, device="cpu")
            buf.copy_(v.detach())
        self._queue.put(step)

    def _writer(self) -> None:
        while True:
            step = self._queue.get()
            if step is None:
                return
            t0 = time.perf_counter()
            try:
                self.bytes_written += write_part(self.path, self._buffers, None)
                self.writes.append(time.perf_counter() - t0)
            finally:
                self._idle.set()

    def close(self) -> None:
        self._idle.wait()
        self._queue.put(None)
        self._thread.join(timeout=30)
