"""Nine real edges: tensors that cross a vendor boundary in models of the catalog.

Each :class:`RealEdge` names its model, where every dimension comes from (the model's
published ``config.json`` via :mod:`meshpact.core.catalog`, or a stated deployment
choice such as the tensor-parallel degree or batch), and whether it is a *result edge*
(the consumer observes a projection of the logits, so moving less than the tensor is
possible). :func:`get_edge` looks one up by its stable CLI name; :func:`miniature` keeps
an edge's structure (ranks, placements, requests, owners) with small dimensions, so the
numeric interpreter and the live executor can run it on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from .catalog import ModelConfig, get_model
from .contract import is_result_request
from .errors import FactError
from .facts import Consumer, Domain, DType, Edge, Mesh, ProducerTensor, Request, Vendor
from .placement import Partial, Replicate, Shard

__all__ = ["RealEdge", "EDGES", "get_edge", "get_real_edge", "miniature", "two_vendor_mesh"]


@dataclass(frozen=True)
class RealEdge:
    name: str
    edge: Edge
    model: str
    dims: str  # where each dimension comes from

    @property
    def result_edge(self) -> bool:
        """The consumer observes a projected result (log-prob, token), not raw values."""
        return is_result_request(self.edge.consumer.request)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "model": self.model,
            "result_edge": self.result_edge,
            "description": self.edge.description,
            "dims": self.dims,
        }


def two_vendor_mesh(cuda: int, cann: int, cpu: int = 0, same_host: bool = False) -> Mesh:
    """``cuda@hostA`` (NCCL) ranks first, then ``cann@hostB`` (HCCL), then an optional
    ``cpu@hostA`` (gloo) domain; hosts meet over Ethernet unless ``same_host``."""
    host_b = "hostA" if same_host else "hostB"
    domains = [
        Domain("cuda@hostA", Vendor.CUDA, "hostA", tuple(range(cuda))),
        Domain(f"cann@{host_b}", Vendor.CANN, host_b, tuple(range(cuda, cuda + cann))),
    ]
    if cpu:
        domains.append(Domain("cpu@hostA", Vendor.CPU, "hostA", tuple(range(cuda + cann, cuda + cann + cpu))))
    return Mesh(domains=tuple(domains))


def _owners(rows: int, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """Contiguous blocks of sequences per owner, as a decode scheduler assigns them."""
    per = -(-rows // len(ranks))
    return tuple(ranks[r // per] for r in range(rows))


def _build() -> dict[str, RealEdge]:
    q14: ModelConfig = get_model("qwen3-14b")
    q30 = get_model("qwen3-30b-a3b")
    llama = get_model("llama-3.1-8b")
    mistral = get_model("mistral-7b")
    mm2 = get_model("minimax-m2")
    out: list[RealEdge] = []

    def add(
        name: str,
        model: ModelConfig,
        dims: str,
        mesh: Mesh,
        producer: ProducerTensor,
        consumer: Consumer,
        description: str,
    ) -> None:
        edge = Edge(name, mesh, producer, consumer, description=description, source=model.source)
        out.append(RealEdge(name, edge, model.name, dims))

    m44 = two_vendor_mesh(4, 4)
    add(
        "qwen3-14b-lm-head-logprob",
        q14,
        f"vocab {q14.vocab_size} (config.json vocab_size); 4096 tokens per RL scoring micro-batch and "
        "tensor parallelism 4 (deployment choices)",
        two_vendor_mesh(4, 2),
        ProducerTensor("logits", "lm_head", (4096, q14.vocab_size), DType.BFLOAT16, "cuda@hostA", Shard(1)),
        Consumer("scorer", "cann@hostB", (4, 5), Request.LOGPROB),
        "RL scoring: a vocabulary-parallel LM head on CUDA, the trainer on Ascend reads the log-probability "
        "of each sampled token",
    )
    add(
        "qwen3-14b-lm-head-token",
        q14,
        f"vocab {q14.vocab_size} (config.json); 256 sequences per decode step, tensor parallelism 4",
        Mesh(
            domains=(
                Domain("cuda@hostA", Vendor.CUDA, "hostA", (0, 1, 2, 3)),
                Domain("cpu@hostA", Vendor.CPU, "hostA", (4,)),
            )
        ),
        ProducerTensor("logits", "lm_head", (256, q14.vocab_size), DType.BFLOAT16, "cuda@hostA", Shard(1)),
        Consumer("sampler", "cpu@hostA", (4,), Request.TOKEN),
        "greedy decoding: the scheduler on the host CPU needs only each sequence's next token id",
    )
    add(
        "minimax-m2-lm-head-owner-token",
        mm2,
        f"vocab {mm2.vocab_size} (config.json); 64 sequences per decode step owned by 4 decode workers, "
        "tensor parallelism 8",
        two_vendor_mesh(8, 4),
        ProducerTensor("logits", "lm_head", (64, mm2.vocab_size), DType.BFLOAT16, "cuda@hostA", Shard(1)),
        Consumer("decoders", "cann@hostB", (8, 9, 10, 11), Request.OWNER_TOKEN, owners=_owners(64, (8, 9, 10, 11))),
        "disaggregated decoding: each Ascend decode worker receives the next tokens of its own sequences only",
    )
    add(
        "qwen3-14b-mlp-down-reduced",
        q14,
        f"hidden {q14.hidden_size}, intermediate {q14.intermediate_size} split 4 ways "
        f"({q14.intermediate_size // 4} per rank, config.json); 2048 tokens per micro-batch",
        m44,
        ProducerTensor(
            "down_proj_out", "mlp.down_proj", (2048, q14.hidden_size), DType.BFLOAT16, "cuda@hostA", Partial("sum")
        ),
        Consumer("next_stage", "cann@hostB", (4, 5, 6, 7), Request.REDUCED),
        "pipeline boundary after a row-parallel down-projection: each CUDA rank holds a full-shaped addend; "
        "the next stage on Ascend must read the completed sum",
    )
    add(
        "llama-3.1-8b-column-activation-shard",
        llama,
        f"intermediate {llama.intermediate_size} (config.json) split over tensor parallelism 4 on both sides; "
        "2048 tokens per micro-batch",
        m44,
        ProducerTensor(
            "gate_up_act", "mlp.act_fn", (2048, llama.intermediate_size), DType.BFLOAT16, "cuda@hostA", Shard(1)
        ),
        Consumer("down_proj", "cann@hostB", (4, 5, 6, 7), Request.SHARD, shard_dim=1),
        "column-parallel activations handed to a row-parallel down-projection on the other vendor: rank i "
        "needs column shard i",
    )
    add(
        "qwen3-30b-a3b-moe-combine",
        q30,
        f"hidden {q30.hidden_size}, {q30.num_experts} experts, top-{q30.experts_per_token} (config.json), "
        "16 experts per rank over expert parallelism 8; 4096 tokens over 2 attention ranks",
        two_vendor_mesh(2, 8),
        ProducerTensor(
            "expert_out", "moe.experts", (4096, q30.hidden_size), DType.BFLOAT16, "cann@hostB", Partial("sum")
        ),
        Consumer("attention", "cuda@hostA", (0, 1), Request.REDUCED, shard_dim=0),
        "MoE combine: each Ascend expert rank holds its experts' gate-weighted outputs (zero for tokens not "
        "routed to them); each CUDA attention rank reads the combined output of its own tokens",
    )
    add(
        "llama-3.1-8b-kv-prefill-to-decode",
        llama,
        f"{llama.num_layers} layers x (K, V), {llama.num_kv_heads} KV heads, head dim {llama.head_dim} "
        "(config.json); a 4096-token prompt; prefill tensor parallelism 4, decode 2",
        two_vendor_mesh(4, 2),
        ProducerTensor(
            "kv_cache",
            "attention.prefill",
            (2 * llama.num_layers, llama.num_kv_heads, 4096, llama.head_dim),
            DType.BFLOAT16,
            "cuda@hostA",
            Shard(1),
        ),
        Consumer("decode", "cann@hostB", (4, 5), Request.SHARD, shard_dim=1),
        "prefill on CUDA, decode on Ascend: each decode rank needs the KV heads it serves",
    )
    add(
        "qwen3-14b-full-logits-distill",
        q14,
        f"vocab {q14.vocab_size} (config.json); 512 tokens per distillation micro-batch, tensor parallelism 4",
        two_vendor_mesh(4, 2),
        ProducerTensor("logits", "lm_head", (512, q14.vocab_size), DType.BFLOAT16, "cuda@hostA", Shard(1)),
        Consumer("student", "cann@hostB", (4, 5), Request.FULL),
        "logit distillation: the student on Ascend reads the teacher's full logits, bit for bit",
    )
    add(
        "mistral-7b-pipeline-hidden-handoff",
        mistral,
        f"hidden {mistral.hidden_size} (config.json); 4096 tokens (its sliding window) per micro-batch, "
        "tensor parallelism 4 on both stages",
        m44,
        ProducerTensor(
            "hidden", "decoder_layer.15", (4096, mistral.hidden_size), DType.BFLOAT16, "cuda@hostA", Replicate()
        ),
        Consumer("stage2", "cann@hostB", (4, 5, 6, 7), Request.FULL),
        "pipeline hand-off after layer 16 of 32: hidden states are replicated over the CUDA stage's ranks and "
        "the Ascend stage's ranks all read them",
    )
    return {e.name: e for e in out}


EDGES: Mapping[str, RealEdge] = _build()


def get_real_edge(name: str) -> RealEdge:
    try:
        return EDGES[name]
    except KeyError:
        raise FactError(f"unknown edge {name!r}; known edges: {', '.join(EDGES)}") from None


def get_edge(name: str) -> Edge:
    """The :class:`Edge` registered under ``name`` (the CLI name)."""
    return get_real_edge(name).edge


def miniature(edge: Edge, cap: int = 12) -> Edge:
    """``edge`` with every dimension cut to at most ``cap`` (owners scaled to match)."""
    p, c = edge.producer, edge.consumer
    shape = tuple(min(s, cap) for s in p.shape)
    owners = c.owners
    if owners is not None:
        rows = p.shape[0]
        owners = tuple(owners[(r * rows) // shape[0]] for r in range(shape[0]))
    return replace(edge, producer=replace(p, shape=shape), consumer=replace(c, owners=owners))
