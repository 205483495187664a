"""Edge facts from a file: a YAML or JSON document that describes one edge.

``meshpact plan --facts FILE`` reads it. Every mistake is reported as a
:class:`~meshpact.core.errors.FactError` naming the file, the field and what was
expected::

    name: my-edge
    mesh:
      domains:
        - {name: cuda@A, vendor: cuda, host: A, ranks: [0, 1, 2, 3]}
        - {name: cann@B, vendor: cann, host: B, ranks: [4, 5], bridge_rank: 4}
      links: {ethernet: {alpha_s: 5.0e-5, beta_s_per_byte: 8.0e-9}}   # optional
    producer: {name: logits, op: lm_head, shape: [256, 151936], dtype: bfloat16,
               domain: cuda@A, placement: Shard(1)}
    consumer: {name: sampler, domain: cann@B, ranks: [4, 5], request: token}
    # or consumers: [{...}, {...}], several consumers of the producer, each with its own request
    # consumer options: owners (owner_token only), shard_dim (shard, reduced only), exact (bool),
    # k (topk only), temperature and seed (sample only)
    # producer options: vocab_size, the real columns of logits padded to a multiple of TP x 128;
    # dp, a DP x TP grid (rows split over dp groups of consecutive ranks, the placement inside each)
    # a domain's backend, if given, must be its vendor's native one (nccl, hccl, gloo)
"""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path
from typing import Any, Mapping

import yaml

from .errors import FactError
from .facts import Backend, Consumer, Domain, DType, Edge, LinkClass, LinkParams, Mesh, ProducerTensor, Request, Vendor
from .group import EdgeGroup
from .placement import parse_placement

__all__ = ["load_edge_facts", "edge_from_dict"]


class _Where:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, expected: str, got: Any = None) -> FactError:
        tail = "" if got is None else f", got {got!r}"
        return FactError(f"{self.source}: {field}: expected {expected}{tail}")

    def mapping(self, data: Any, field: str) -> Mapping[str, Any]:
        if not isinstance(data, Mapping):
            raise self.fail(field, "a mapping", data)
        return data

    def need(self, data: Mapping[str, Any], key: str, field: str) -> Any:
        if key not in data or data[key] is None:
            raise self.fail(f"{field}.{key}" if field else key, "a value (required field is missing)")
        return data[key]

    def only(self, data: Mapping[str, Any], allowed: set[str], field: str) -> None:
        extra = sorted(set(data) - allowed)
        if extra:
            raise self.fail(f"{field}.{extra[0]}" if field else extra[0], f"one of the fields {sorted(allowed)}")

    def text(self, value: Any, field: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(field, "a non-empty string", value)
        return value

    def ints(self, value: Any, field: str, positive: bool = False) -> tuple[int, ...]:
        ok = isinstance(value, list) and value and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        if not ok or (positive and any(v <= 0 for v in value)) or any(v < 0 for v in value):
            what = "positive integers" if positive else "non-negative integers"
            raise self.fail(field, f"a non-empty list of {what}", value)
        return tuple(value)

    def choice(self, value: Any, field: str, enum: type[Enum]) -> Any:
        try:
            return enum(value)
        except ValueError:
            raise self.fail(field, f"one of {[e.value for e in enum]}", value) from None


def edge_from_dict(data: Any, source: str = "facts") -> Edge | EdgeGroup:
    """Build an :class:`Edge` (``consumer:``) or an :class:`EdgeGroup` (``consumers:``, a list)
    from parsed YAML/JSON, naming the field of any mistake."""
    w = _Where(source)
    top = w.mapping(data, "the document")
    w.only(top, {"name", "mesh", "producer", "consumer", "consumers", "description"}, "")
    mesh_d = w.mapping(w.need(top, "mesh", ""), "mesh")
    w.only(mesh_d, {"domains", "links"}, "mesh")
    doms_d = w.need(mesh_d, "domains", "mesh")
    if not isinstance(doms_d, list) or not doms_d:
        raise w.fail("mesh.domains", "a non-empty list of domains", doms_d)
    domains = []
    for i, d in enumerate(doms_d):
        f = f"mesh.domains.{i}"
        d = w.mapping(d, f)
        w.only(d, {"name", "vendor", "host", "ranks", "backend", "bridge_rank"}, f)
        bridge = d.get("bridge_rank")
        if bridge is not None and (not isinstance(bridge, int) or isinstance(bridge, bool)):
            raise w.fail(f"{f}.bridge_rank", "an integer rank", bridge)
        vendor = w.choice(w.need(d, "vendor", f), f"{f}.vendor", Vendor)
        backend = d.get("backend")
        if backend is not None and w.choice(backend, f"{f}.backend", Backend) is not vendor.native_backend:
            raise w.fail(
                f"{f}.backend",
                f"{vendor.native_backend.value}, the native backend of {vendor.value} (or leave it out)",
                backend,
            )
        try:
            domains.append(
                Domain(
                    w.text(w.need(d, "name", f), f"{f}.name"),
                    vendor,
                    w.text(w.need(d, "host", f), f"{f}.host"),
                    w.ints(w.need(d, "ranks", f), f"{f}.ranks"),
                    backend=vendor.native_backend,
                    bridge_rank=bridge,
                )
            )
        except FactError as exc:
            raise FactError(f"{source}: {f}: {exc}") from None
    links: dict[LinkClass, LinkParams] = {}
    for k, v in dict(w.mapping(mesh_d.get("links") or {}, "mesh.links")).items():
        f = f"mesh.links.{k}"
        cls = w.choice(k, "mesh.links", LinkClass)
        v = w.mapping(v, f)
        w.only(v, {"alpha_s", "beta_s_per_byte"}, f)
        numbers = []
        for key in ("alpha_s", "beta_s_per_byte"):
            value = w.need(v, key, f)
            try:  # YAML 1.1 reads 5e-5 (no dot) as a string
                number = float(value) if isinstance(value, (int, float, str)) and not isinstance(value, bool) else None
            except ValueError:
                number = None
            if number is None or not 0 <= number < float("inf"):
                raise w.fail(f"{f}.{key}", "a finite non-negative number of seconds", value)
            numbers.append(number)
        links[cls] = LinkParams(*numbers)
    try:
        mesh = Mesh(domains=tuple(domains), links=links)
    except FactError as exc:
        raise FactError(f"{source}: mesh: {exc}") from None
    pd = w.mapping(w.need(top, "producer", ""), "producer")
    w.only(pd, {"name", "op", "shape", "dtype", "domain", "placement", "vocab_size", "dp"}, "producer")
    try:
        placement = parse_placement(str(w.need(pd, "placement", "producer")))
    except FactError as exc:
        raise FactError(f"{source}: producer.placement: {exc}") from None
    try:
        producer = ProducerTensor(
            w.text(w.need(pd, "name", "producer"), "producer.name"),
            w.text(w.need(pd, "op", "producer"), "producer.op"),
            w.ints(w.need(pd, "shape", "producer"), "producer.shape", positive=True),
            w.choice(w.need(pd, "dtype", "producer"), "producer.dtype", DType),
            w.text(w.need(pd, "domain", "producer"), "producer.domain"),
            placement,
            vocab_size=pd.get("vocab_size"),
            dp=pd.get("dp", 1),
        )
        name = str(top.get("name") or Path(source).stem)
        if "consumers" in top:
            if "consumer" in top:
                raise w.fail("consumers", "either consumer or consumers, not both")
            listed = top["consumers"]
            if not isinstance(listed, list) or not listed:
                raise w.fail("consumers", "a non-empty list of consumers", listed)
            group = EdgeGroup(
                name, mesh, producer, tuple(_consumer(w, c, f"consumers.{i}") for i, c in enumerate(listed))
            )
            group.edges()  # each consumer must make an edge on its own (raises otherwise)
            return group
        consumer = _consumer(w, w.need(top, "consumer", ""), "consumer")
        return Edge(name, mesh, producer, consumer, description=str(top.get("description", "")), source=source)
    except FactError as exc:
        if str(exc).startswith(source):
            raise
        raise FactError(f"{source}: {exc}") from None


def _consumer(w: _Where, data: Any, field: str) -> Consumer:
    cd = w.mapping(data, field)
    w.only(
        cd, {"name", "domain", "ranks", "request", "owners", "shard_dim", "exact", "k", "temperature", "seed"}, field
    )
    owners = cd.get("owners")
    shard_dim = cd.get("shard_dim")
    if shard_dim is not None and (not isinstance(shard_dim, int) or isinstance(shard_dim, bool) or shard_dim < 0):
        raise w.fail(f"{field}.shard_dim", "a non-negative integer", shard_dim)
    exact = cd.get("exact", False)
    if not isinstance(exact, bool):
        raise w.fail(f"{field}.exact", "true or false", exact)
    return Consumer(
        w.text(w.need(cd, "name", field), f"{field}.name"),
        w.text(w.need(cd, "domain", field), f"{field}.domain"),
        w.ints(w.need(cd, "ranks", field), f"{field}.ranks"),
        w.choice(w.need(cd, "request", field), f"{field}.request", Request),
        owners=w.ints(owners, f"{field}.owners") if owners is not None else None,
        shard_dim=shard_dim,
        exact=exact,
        k=cd.get("k"),
        temperature=cd.get("temperature"),
        seed=cd.get("seed"),
    )


def load_edge_facts(path: str | os.PathLike[str]) -> Edge | EdgeGroup:
    """Read an edge (or an edge group) from a ``.yaml``/``.yml``/``.json`` file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise FactError(f"{p}: no such facts file; expected a YAML or JSON edge description") from None
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise FactError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}{where}: {exc}") from None
    return edge_from_dict(data, str(p))
