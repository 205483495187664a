"""Plan building: emit steps with their participants, link class, payload bytes and dtype.

Every planner (the lowerer and both baselines) writes its steps through a
:class:`PlanBuilder`, so payload bytes follow the conventions of :mod:`meshpact.core.plan`
in one place: a collective counts what each participant contributes (the root's data
for ``broadcast``/``scatter``), a ``send`` what it carries. Sizes of projected forms come
from :func:`form_bytes`.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from .contract import Contract, Form
from .facts import DType, LinkClass
from .plan import MASKED_PROJECTIONS, Plan, Step, StepKind, projection_of
from .region import Region, region_numel

__all__ = ["PlanBuilder", "form_bytes", "form_dtype", "row_bytes", "chunking", "STAT_BYTES", "CHUNK_BYTES"]

# A bridge message larger than this is pipelined in chunks through a host staging buffer of at
# most this size (the buffer a host-staged transfer pins), so no transfer needs its whole
# payload in host memory at once.
CHUNK_BYTES = 64 * 2**20

# Bytes per row of each projected form: (max, index) as two 8-byte words (the value widened to
# float64, or int64 for integer logits, and the int64 index); (max, sum exp, target)
# as three float32; a token id as int64; a log-probability as float32.
STAT_BYTES: Mapping[Form, int] = {
    Form.MAX_ARG: 16,
    Form.LSE_STATS: 12,
    Form.TOKEN: 8,
    Form.LOGPROB: 4,
    Form.TOPK: 16,
    Form.TOKEN_LOGPROB: 16,
    Form.SAMPLE: 8,
    Form.SAMPLE_ARG: 16,
}
# (Form.TOPK: 16 bytes per kept entry: its id and its log-probability as float64.)


# The dtype each projected form travels in whatever the producer's dtype (raw data keeps its own;
# (max, index) pairs widen to float64 or int64 by the producer's).
_FORM_DTYPE: Mapping[Form, DType] = {
    **{form: DType.FLOAT32 for form in Form if form not in (Form.RAW, Form.MAX_ARG)},
    Form.SAMPLE_ARG: DType.FLOAT64,
    Form.TOKEN: DType.INT64,
    Form.SAMPLE: DType.INT64,
    Form.TOPK: DType.FLOAT64,
    Form.TOKEN_LOGPROB: DType.FLOAT64,
}


def form_dtype(form: Form, raw: DType) -> DType:
    """The dtype a buffer of ``form`` travels in, for a producer tensor of dtype ``raw``."""
    fixed = _FORM_DTYPE.get(form)
    if fixed is not None:
        return fixed
    if form is Form.MAX_ARG:
        return DType.FLOAT64 if raw.is_floating else DType.INT64
    return raw if form is Form.RAW else DType.FLOAT32


def chunking(nbytes: int, limit: int = CHUNK_BYTES) -> dict[str, int]:
    """Step args of a bridge message of ``nbytes``: ``{}`` up to ``limit``, else its chunk count
    and the staging buffer each chunk passes through."""
    if nbytes <= limit:
        return {}
    return {"chunks": -(-nbytes // limit), "staging_bytes": limit}


def row_bytes(form: Form, rows: int) -> int:
    """Payload bytes of ``rows`` rows of a projected ``form``."""
    return rows * STAT_BYTES[form]


def form_bytes(form: Form, region: Region, raw: DType, entries: int = 1) -> int:
    """Payload bytes of data in ``form`` covering ``region`` (rows only, for projected forms;
    ``entries`` per row for top-k)."""
    if form is Form.RAW:
        return region_numel(region) * raw.itemsize
    rows = sum(b - a for a, b in region[0])
    return rows * STAT_BYTES[form] * entries


class PlanBuilder:
    """Accumulates the steps of one plan for one contract."""

    def __init__(self, contract: Contract, planner: str) -> None:
        self.contract = contract
        self.mesh = contract.edge.mesh
        self.planner = planner
        self.steps: list[Step] = []
        self._names = 0

    def name(self, label: str) -> str:
        self._names += 1
        return f"{self.contract.provenance.tensor}.{self._names}.{label}"

    def collective(
        self,
        op: str,
        ranks: Iterable[int],
        inp: str,
        out: str,
        nbytes: int,
        dtype: DType,
        args: Mapping[str, Any] | None = None,
        note: str = "",
    ) -> str:
        ranks = tuple(ranks)
        self.steps.append(
            Step(
                StepKind.COLLECTIVE,
                op,
                ranks,
                (inp,),
                out,
                nbytes,
                dtype,
                self.mesh.domain_of(ranks[0]).name,
                LinkClass.FABRIC,
                dict(args or {}),
                note,
            )
        )
        return out

    def send(self, src: int, dst: int, inp: str, out: str, nbytes: int, dtype: DType, note: str = "") -> str:
        self.steps.append(
            Step(
                StepKind.SEND,
                "send",
                (src, dst),
                (inp,),
                out,
                nbytes,
                dtype,
                None,
                self.mesh.link_class(src, dst),
                chunking(nbytes),
                note,
            )
        )
        return out

    def project(
        self,
        op: str,
        ranks: Iterable[int],
        inputs: Iterable[str] | str,
        out: str,
        dtype: DType,
        args: Mapping[str, Any] | None = None,
        note: str = "",
    ) -> str:
        ranks = tuple(ranks)
        inputs = (inputs,) if isinstance(inputs, str) else tuple(inputs)
        vocab = self.contract.edge.producer.vocab_size
        if vocab is not None and projection_of(op) in MASKED_PROJECTIONS:
            args = {**dict(args or {}), "valid": vocab}  # padded vocabulary: mask the padding columns
        self.steps.append(
            Step(
                StepKind.PROJECT,
                op,
                ranks,
                inputs,
                out,
                0,
                dtype,
                self.mesh.domain_of(ranks[0]).name,
                None,
                dict(args or {}),
                note,
            )
        )
        return out

    def deliver(self, ranks: Iterable[int], buf: str, dtype: DType, note: str = "") -> None:
        ranks = tuple(ranks)
        self.steps.append(
            Step(
                StepKind.DELIVER,
                "deliver",
                ranks,
                (buf,),
                buf,
                0,
                dtype,
                self.mesh.domain_of(ranks[0]).name,
                None,
                {},
                note,
            )
        )

    def plan(self) -> Plan:
        return Plan(edge=self.contract.edge.name, planner=self.planner, steps=tuple(self.steps))
