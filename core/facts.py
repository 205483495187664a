"""Facts: the mesh of ranks, its native domains and links, producer tensors and consumers.

A *native domain* is a set of ranks that can share one native communicator (``cuda`` ranks
with ``nccl``, ``cann`` ranks with ``hccl``, ``cpu`` ranks with ``gloo``). Ranks in different
domains never share a collective: their traffic crosses a *bridge*, one host-staged
point-to-point message between two designated bridge ranks. The class of link between two
ranks follows from where they live (:meth:`Mesh.link_class`), and each class has α-β
parameters (:class:`LinkParams`). An :class:`Edge` bundles one producer tensor and one
consumer on a mesh: it is everything the contract compiler reads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from functools import cached_property
from typing import Mapping

from .errors import FactError
from .placement import Partial, Placement, Replicate, Shard

__all__ = [
    "Vendor",
    "Backend",
    "DType",
    "LinkClass",
    "LinkParams",
    "DEFAULT_LINKS",
    "Domain",
    "Mesh",
    "Request",
    "ProducerTensor",
    "Consumer",
    "Edge",
]


class Vendor(str, Enum):
    CUDA = "cuda"
    CANN = "cann"
    CPU = "cpu"

    @property
    def native_backend(self) -> "Backend":
        return {Vendor.CUDA: Backend.NCCL, Vendor.CANN: Backend.HCCL, Vendor.CPU: Backend.GLOO}[self]


class Backend(str, Enum):
    NCCL = "nccl"
    HCCL = "hccl"
    GLOO = "gloo"


class DType(str, Enum):
    FLOAT32 = "float32"
    FLOAT64 = "float64"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT64 = "int64"
    INT32 = "int32"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_floating(self) -> bool:
        return self in _FLOATING


# Bytes per element and the floating dtypes, by value (a member looks up as its value).
_ITEMSIZE: dict[str, int] = {"float32": 4, "float64": 8, "bfloat16": 2, "float16": 2, "int64": 8, "int32": 4}
_FLOATING = frozenset({"float32", "float64", "bfloat16", "float16"})


class LinkClass(str, Enum):
    """How two ranks are connected; decides the α-β parameters of traffic between them."""

    FABRIC = "fabric"  # inside one native domain (NVLink, HCCS, or shared memory for gloo)
    HOST_BRIDGE = "host_bridge"  # across domains on one host: device -> host memory -> device
    ETHERNET = "ethernet"  # across hosts


@dataclass(frozen=True)
class LinkParams:
    """α (seconds per message) and β (seconds per byte) of one link class."""

    alpha_s: float
    beta_s_per_byte: float

    def __post_init__(self) -> None:
        for name in ("alpha_s", "beta_s_per_byte"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise FactError(f"{name}: expected a finite non-negative number of seconds, got {value!r}")

    def time_s(self, messages: int, payload_bytes: int) -> float:
        return messages * self.alpha_s + payload_bytes * self.beta_s_per_byte

    @property
    def gbit_per_s(self) -> float:
        return 8e-9 / self.beta_s_per_byte if self.beta_s_per_byte else float("inf")


# Assumed defaults, overridable per scenario: an intra-domain fabric at 100 GB/s with 5 µs
# launch cost, PCIe-class host staging at 20 GB/s with 20 µs, and 1 GbE (125 MB/s) with 50 µs.
DEFAULT_LINKS: Mapping[LinkClass, LinkParams] = {
    LinkClass.FABRIC: LinkParams(alpha_s=5e-6, beta_s_per_byte=1 / 100e9),
    LinkClass.HOST_BRIDGE: LinkParams(alpha_s=20e-6, beta_s_per_byte=1 / 20e9),
    LinkClass.ETHERNET: LinkParams(alpha_s=50e-6, beta_s_per_byte=1 / 125e6),
}


@dataclass(frozen=True)
class Domain:
    """A native domain: ranks on one host that can share one native communicator."""

    name: str
    vendor: Vendor
    host: str
    ranks: tuple[int, ...]
    backend: Backend | None = None
    bridge_rank: int | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise FactError("domain.name: expected a non-empty name such as 'cuda@hostA'")
        object.__setattr__(self, "vendor", Vendor(self.vendor))
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        if not self.ranks:
            raise FactError(f"domain {self.name!r}.ranks: expected at least one rank")
        if len(set(self.ranks)) != len(self.ranks):
            raise FactError(f"domain {self.name!r}.ranks: rank listed twice in {list(self.ranks)}")
        backend = self.vendor.native_backend if self.backend is None else Backend(self.backend)
        object.__setattr__(self, "backend", backend)
        bridge = self.ranks[0] if self.bridge_rank is None else int(self.bridge_rank)
        if bridge not in self.ranks:
            raise FactError(f"domain {self.name!r}.bridge_rank: {bridge} is not one of its ranks {list(self.ranks)}")
        object.__setattr__(self, "bridge_rank", bridge)

    @property
    def size(self) -> int:
        return len(self.ranks)


@dataclass(frozen=True)
class Mesh:
    """Ranks grouped into native domains, with α-β parameters per link class."""

    domains: tuple[Domain, ...]
    links: Mapping[LinkClass, LinkParams] = field(default_factory=lambda: dict(DEFAULT_LINKS))

    def __post_init__(self) -> None:
        object.__setattr__(self, "domains", tuple(self.domains))
        if not self.domains:
            raise FactError("mesh.domains: expected at least one native domain")
        names = [d.name for d in self.domains]
        if len(set(names)) != len(names):
            raise FactError(f"mesh.domains: duplicate domain names in {names}")
        seen: dict[int, str] = {}
        for d in self.domains:
            for r in d.ranks:
                if r in seen:
                    raise FactError(f"mesh: rank {r} is in both {seen[r]!r} and {d.name!r}")
                seen[r] = d.name
        links = {LinkClass(k): v for k, v in dict(self.links).items()}
        object.__setattr__(self, "links", {**DEFAULT_LINKS, **links})

    def __hash__(self) -> int:
        return hash(self.domains)

    @cached_property
    def _domain_of(self) -> dict[int, Domain]:
        return {r: d for d in self.domains for r in d.ranks}

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self._domain_of))

    @property
    def world_size(self) -> int:
        return len(self._domain_of)

    @property
    def hosts(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(d.host for d in self.domains))

    def domain(self, name: str) -> Domain:
        for d in self.domains:
            if d.name == name:
                return d
        raise FactError(f"unknown domain {name!r}; the mesh has {[d.name for d in self.domains]}")

    def domain_of(self, rank: int) -> Domain:
        try:
            return self._domain_of[rank]
        except KeyError:
            raise FactError(f"rank {rank} is not in the mesh (ranks {self.ranks[0]}..{self.ranks[-1]})") from None

    def link_class(self, a: int, b: int) -> LinkClass:
        da, db = self.domain_of(a), self.domain_of(b)
        if da.name == db.name:
            return LinkClass.FABRIC
        if da.host == db.host:
            return LinkClass.HOST_BRIDGE
        return LinkClass.ETHERNET

    def link(self, a: int, b: int) -> LinkParams:
        return self.links[self.link_class(a, b)]


class Request(str, Enum):
    """What the consumer observes (see the design's request table)."""

    FULL = "full"
    LOGPROB = "logprob"
    TOKEN = "token"
    OWNER_TOKEN = "owner_token"
    SHARD = "shard"
    REDUCED = "reduced"
    TOPK = "topk"  # the k largest logits' ids and their log-probabilities (vLLM / SGLang logprobs=k)
    TOKEN_LOGPROB = "token_logprob"  # the argmax id and its log-probability together
    SAMPLE = "sample"  # a token sampled from softmax(logits / temperature) with a seeded generator

    @property
    def reads_logits(self) -> bool:
        """Whether the request reads ``[tokens, vocab]`` logits and observes a projection of them."""
        return self in (
            Request.LOGPROB,
            Request.TOKEN,
            Request.OWNER_TOKEN,
            Request.TOPK,
            Request.TOKEN_LOGPROB,
            Request.SAMPLE,
        )


@dataclass(frozen=True)
class ProducerTensor:
    """A tensor produced by ``op`` in ``domain``, laid out over the domain's ranks."""

    name: str
    op: str
    shape: tuple[int, ...]
    dtype: DType
    domain: str
    placement: Placement
    vocab_size: int | None = None  # logits padded past the vocabulary: the real columns (the rest is masked)
    dp: int = 1  # a 2-D (DP x TP) layout: rows split over dp groups of consecutive ranks, placement inside each

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        object.__setattr__(self, "dtype", DType(self.dtype))
        if isinstance(self.dp, bool) or not isinstance(self.dp, int) or self.dp < 1:
            raise FactError(f"producer {self.name!r}.dp: expected a positive integer, got {self.dp!r}")
        if self.dp > 1 and isinstance(self.placement, Partial):
            raise FactError(
                f"producer {self.name!r}.dp: a 2-D layout takes Shard or Replicate inside each group, "
                f"not {self.placement!r}"
            )
        if self.vocab_size is not None:
            v = self.vocab_size
            if isinstance(v, bool) or not isinstance(v, int) or len(self.shape) != 2 or not 1 <= v <= self.shape[-1]:
                raise FactError(
                    f"producer {self.name!r}.vocab_size: expected an integer in 1..{self.shape[-1]} "
                    f"(the padded logits' columns) on [tokens, vocab] logits, got {v!r}"
                )
        if not self.shape or any(s <= 0 for s in self.shape):
            raise FactError(f"producer {self.name!r}.shape: expected positive sizes, got {list(self.shape)}")
        if not isinstance(self.placement, (Replicate, Shard, Partial)):
            raise FactError(f"producer {self.name!r}.placement: expected Replicate(), Shard(d) or Partial(op)")
        if isinstance(self.placement, Shard) and self.placement.dim >= len(self.shape):
            raise FactError(
                f"producer {self.name!r}.placement: Shard({self.placement.dim}) but the tensor has "
                f"{len(self.shape)} dims"
            )

    @property
    def columns(self) -> int:
        """The real columns of logits: ``vocab_size`` when padded, else the last dim."""
        return self.vocab_size if self.vocab_size is not None else self.shape[-1]

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class Consumer:
    """Ranks of one domain that read a producer tensor through ``request``.

    ``owners`` (``owner_token``): the consumer rank that owns each row (sequence) of the
    producer tensor. ``shard_dim`` (``shard``, optionally ``reduced``): the dimension along
    which consumer rank *i* of *n* reads chunk *i*. ``exact``: the consumer accepts only
    observations bitwise equal to a single-device computation (no reassociated sums, no
    distributed log-softmax).
    """

    name: str
    domain: str
    ranks: tuple[int, ...]
    request: Request
    owners: tuple[int, ...] | None = None
    shard_dim: int | None = None
    exact: bool = False
    k: int | None = None  # topk: how many ids per row
    temperature: float | None = None  # sample: softmax temperature (default 1)
    seed: int | None = None  # sample: the generator's seed (default 0)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ranks", tuple(int(r) for r in self.ranks))
        object.__setattr__(self, "request", Request(self.request))
        if self.k is not None and self.request is not Request.TOPK:
            raise FactError(f"consumer {self.name!r}.k: applies to topk requests only, not {self.request.value}")
        if self.request is Request.TOPK and (isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1):
            raise FactError(f"consumer {self.name!r}.k: a topk request needs a positive integer k, got {self.k!r}")
        for name in ("temperature", "seed"):
            if getattr(self, name) is not None and self.request is not Request.SAMPLE:
                raise FactError(
                    f"consumer {self.name!r}.{name}: applies to sample requests only, not {self.request.value}"
                )
        if self.request is Request.SAMPLE:
            t = 1.0 if self.temperature is None else self.temperature
            if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
                raise FactError(f"consumer {self.name!r}.temperature: expected a positive finite number, got {t!r}")
            seed = 0 if self.seed is None else self.seed
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
                raise FactError(f"consumer {self.name!r}.seed: expected an integer in 0..2**63-1, got {seed!r}")
            object.__setattr__(self, "temperature", float(t))
            object.__setattr__(self, "seed", seed)
        if not self.ranks:
            raise FactError(f"consumer {self.name!r}.ranks: expected at least one rank")
        if len(set(self.ranks)) != len(self.ranks):
            dup = sorted({r for r in self.ranks if self.ranks.count(r) > 1})
            raise FactError(
                f"consumer {self.name!r}.ranks: rank(s) {dup} listed twice in {list(self.ranks)}; "
                "expected distinct ranks"
            )
        if self.shard_dim is not None and self.request not in (Request.SHARD, Request.REDUCED):
            raise FactError(
                f"consumer {self.name!r}.shard_dim: applies to shard and reduced requests only, "
                f"not {self.request.value}"
            )
        if self.owners is not None and self.request is not Request.OWNER_TOKEN:
            raise FactError(
                f"consumer {self.name!r}.owners: applies to owner_token requests only, not {self.request.value}"
            )
        if self.owners is not None:
            object.__setattr__(self, "owners", tuple(int(o) for o in self.owners))
            stray = sorted(set(self.owners) - set(self.ranks))
            if stray:
                raise FactError(
                    f"consumer {self.name!r}.owners: ranks {stray} are not consumer ranks {list(self.ranks)}"
                )
        if self.request is Request.OWNER_TOKEN and not self.owners:
            raise FactError(f"consumer {self.name!r}.owners: an owner_token request needs the owner rank of every row")
        if self.request is Request.SHARD and self.shard_dim is None:
            raise FactError(f"consumer {self.name!r}.shard_dim: a shard request needs the dimension to split")


@dataclass(frozen=True)
class Edge:
    """One producer tensor consumed across (or inside) native domains: the facts of a contract."""

    name: str
    mesh: Mesh
    producer: ProducerTensor
    consumer: Consumer
    description: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        pdom = self.mesh.domain(self.producer.domain)  # raises for an unknown domain
        if pdom.size % self.producer.dp:
            raise FactError(
                f"edge {self.name!r}: producer.dp = {self.producer.dp} does not divide the "
                f"{pdom.size} ranks of {pdom.name}"
            )
        cons = self.mesh.domain(self.consumer.domain)
        stray = sorted(set(self.consumer.ranks) - set(cons.ranks))
        if stray:
            raise FactError(f"edge {self.name!r}: consumer ranks {stray} are not in domain {cons.name!r}")
        if (
            self.consumer.request is Request.TOPK
            and len(self.producer.shape) == 2
            and (self.consumer.k or 0) > self.producer.columns
        ):
            raise FactError(
                f"edge {self.name!r}: consumer.k = {self.consumer.k} exceeds the vocabulary "
                f"({self.producer.columns} columns)"
            )
        if self.producer.vocab_size is not None and not self.consumer.request.reads_logits:
            raise FactError(
                f"edge {self.name!r}: producer.vocab_size (padded logits) applies to logits requests, "
                f"not {self.consumer.request.value}"
            )
        if self.consumer.request.reads_logits:
            if len(self.producer.shape) != 2:
                raise FactError(
                    f"edge {self.name!r}: a {self.consumer.request.value} request reads logits of shape "
                    f"[tokens, vocab], got {list(self.producer.shape)}"
                )
        if self.consumer.owners is not None and len(self.consumer.owners) != self.producer.shape[0]:
            raise FactError(
                f"edge {self.name!r}: consumer.owners lists {len(self.consumer.owners)} rows, "
                f"the producer has {self.producer.shape[0]}"
            )
        if self.consumer.request is Request.REDUCED and not isinstance(self.producer.placement, Partial):
            raise FactError(
                f"edge {self.name!r}: a reduced request reads a Partial producer, got {self.producer.placement!r}"
            )

    @property
    def cross_domain(self) -> bool:
        return self.producer.domain != self.consumer.domain
