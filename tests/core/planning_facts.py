"""Hypothesis strategies for random planning facts, and small fixed edges for the core tests."""

from __future__ import annotations

from hypothesis import strategies as st

from meshpact.core.facts import Consumer, Domain, DType, Edge, Mesh, ProducerTensor, Request, Vendor
from meshpact.core.placement import Partial, Replicate, Shard


def two_domain_mesh(n: int = 3, m: int = 2, same_host: bool = False, bridges: tuple[int, int] = (0, 0)) -> Mesh:
    host = "A" if same_host else "B"
    return Mesh(
        domains=(
            Domain("cuda@A", Vendor.CUDA, "A", tuple(range(n)), bridge_rank=bridges[0]),
            Domain(f"cann@{host}", Vendor.CANN, host, tuple(range(n, n + m)), bridge_rank=n + bridges[1]),
        )
    )


def edge(
    placement,
    request,
    *,
    cross=True,
    consumers=None,
    shape=(6, 10),
    n=3,
    m=2,
    exact=False,
    owners=None,
    shard_dim=None,
    dtype=DType.FLOAT32,
    **request_args,
) -> Edge:
    mesh = two_domain_mesh(n, m)
    dom = mesh.domains[1] if cross else mesh.domains[0]
    ranks = tuple(consumers) if consumers is not None else dom.ranks
    if request is Request.OWNER_TOKEN and owners is None:
        owners = tuple(ranks[r % len(ranks)] for r in range(shape[0]))
    if request is Request.SHARD and shard_dim is None:
        shard_dim = len(shape) - 1
    return Edge(
        "e",
        mesh,
        ProducerTensor("x", "op", shape, dtype, "cuda@A", placement),
        Consumer("c", dom.name, ranks, request, owners=owners, shard_dim=shard_dim, exact=exact, **request_args),
    )


DTYPES = (DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16, DType.INT64, DType.INT32)


@st.composite
def random_edges(draw) -> Edge:
    """Any well-formed edge over two small domains."""
    n = draw(st.integers(1, 4))
    m = draw(st.integers(1, 3))
    same_host = draw(st.booleans())
    mesh = two_domain_mesh(n, m, same_host, (draw(st.integers(0, n - 1)), draw(st.integers(0, m - 1))))
    request = draw(st.sampled_from(list(Request)))
    two_d = request.reads_logits or draw(st.booleans())
    if two_d:
        rows = draw(st.integers(1, 7))
        shape: tuple[int, ...] = (rows, draw(st.integers(rows if request is Request.OWNER_TOKEN else 1, 11)))
    else:
        shape = (draw(st.integers(1, 5)), draw(st.integers(1, 4)), draw(st.integers(1, 5)))
    if request is Request.REDUCED:
        placement = Partial(draw(st.sampled_from(["sum", "max", "min", "avg"])))
    else:
        placement = draw(
            st.sampled_from(
                [Replicate(), Shard(0), Shard(len(shape) - 1), Partial("sum"), Partial("max"), Partial("avg")]
            )
        )
    cross = draw(st.booleans())
    dom = mesh.domains[1] if cross else mesh.domains[0]
    ranks = tuple(draw(st.permutations(dom.ranks))[: draw(st.integers(1, dom.size))])
    owners = (
        tuple(draw(st.lists(st.sampled_from(ranks), min_size=shape[0], max_size=shape[0])))
        if request is Request.OWNER_TOKEN
        else None
    )
    shard_dim = None
    if request is Request.SHARD or (request is Request.REDUCED and draw(st.booleans())):
        shard_dim = draw(st.integers(0, len(shape) - 1))
    dtype = draw(st.sampled_from(DTYPES))
    vocab = draw(st.integers(1, shape[1])) if request.reads_logits and draw(st.booleans()) else None  # padded
    extra = {}
    if request is Request.TOPK:
        extra["k"] = draw(st.integers(1, vocab or shape[1]))
    if request is Request.SAMPLE:
        extra = {"seed": draw(st.integers(0, 2**40)), "temperature": draw(st.sampled_from([0.5, 1.0, 2.0]))}
    dp = 1
    if not isinstance(placement, Partial) and n > 1:  # sometimes a DP x TP grid
        dp = draw(st.sampled_from([d for d in range(1, n + 1) if n % d == 0]))
    return Edge(
        "random",
        mesh,
        ProducerTensor("x", "op", shape, dtype, "cuda@A", placement, vocab_size=vocab, dp=dp),
        Consumer("c", dom.name, ranks, request, owners=owners, shard_dim=shard_dim, exact=draw(st.booleans()), **extra),
    )
