"""Model catalog: published configurations of real models.

Each entry carries the values of the model's published Hugging Face ``config.json`` and
names that file as its source. :func:`load_hf_config` reads any such file from a path, so
a user can plan edges for a model that is not in the catalog.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Mapping

from .errors import FactError

__all__ = ["ModelConfig", "CATALOG", "get_model", "load_hf_config", "model_from_hf_dict"]


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    source: str = ""
    notes: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def full_logits_bytes_per_token(self, itemsize: int = 2) -> int:
        return self.vocab_size * itemsize

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """Key and value bytes per token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _hf(repo: str) -> str:
    return f"https://huggingface.co/{repo}/blob/main/config.json"


CATALOG: Mapping[str, ModelConfig] = {
    m.name: m
    for m in (
        ModelConfig(
            name="Qwen/Qwen3-14B",
            hidden_size=5120,
            intermediate_size=17408,
            num_layers=40,
            num_heads=40,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=151936,
            source=_hf("Qwen/Qwen3-14B"),
            notes="dense",
        ),
        ModelConfig(
            name="Qwen/Qwen3-30B-A3B",
            hidden_size=2048,
            intermediate_size=6144,
            num_layers=48,
            num_heads=32,
            num_kv_heads=4,
            head_dim=128,
            vocab_size=151936,
            num_experts=128,
            experts_per_token=8,
            moe_intermediate_size=768,
            source=_hf("Qwen/Qwen3-30B-A3B"),
            notes="MoE",
        ),
        ModelConfig(
            name="meta-llama/Llama-3.1-8B",
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=128256,
            source=_hf("meta-llama/Llama-3.1-8B"),
            notes="dense",
        ),
        ModelConfig(
            name="mistralai/Mistral-7B-v0.1",
            hidden_size=4096,
            intermediate_size=14336,
            num_layers=32,
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=32000,
            source=_hf("mistralai/Mistral-7B-v0.1"),
            notes="dense, sliding window 4096",
        ),
        ModelConfig(
            name="MiniMaxAI/MiniMax-M2",
            hidden_size=3072,
            intermediate_size=1536,
            num_layers=62,
            num_heads=48,
            num_kv_heads=8,
            head_dim=128,
            vocab_size=200064,
            num_experts=256,
            experts_per_token=8,
            moe_intermediate_size=1536,
            source=_hf("MiniMaxAI/MiniMax-M2"),
            notes="MoE, sigmoid routing",
        ),
    )
}

_ALIASES = {
    "qwen3-14b": "Qwen/Qwen3-14B",
    "qwen3-30b-a3b": "Qwen/Qwen3-30B-A3B",
    "llama-3.1-8b": "meta-llama/Llama-3.1-8B",
    "mistral-7b": "mistralai/Mistral-7B-v0.1",
    "minimax-m2": "MiniMaxAI/MiniMax-M2",
}


def get_model(name: str) -> ModelConfig:
    """Look a model up by its Hugging Face name or a short alias (``qwen3-14b``)."""
    key = _ALIASES.get(name.lower(), name)
    if key in CATALOG:
        return CATALOG[key]
    known = ", ".join(list(CATALOG) + sorted(_ALIASES))
    raise FactError(f"unknown model {name!r}; known models: {known}; or load a config.json by path")


def model_from_hf_dict(cfg: Mapping[str, Any], name: str, source: str = "") -> ModelConfig:
    """Build a :class:`ModelConfig` from the fields of a Hugging Face ``config.json``."""

    def need(*keys: str) -> int:
        for k in keys:
            if k in cfg and cfg[k] is not None:
                return int(cfg[k])
        raise FactError(f"{source or name}: config.json has none of {list(keys)}")

    def opt(*keys: str) -> int:
        for k in keys:
            if k in cfg and cfg[k] is not None:
                return int(cfg[k])
        return 0

    hidden = need("hidden_size", "d_model", "n_embd")
    heads = need("num_attention_heads", "n_head")
    return ModelConfig(
        name=name,
        hidden_size=hidden,
        intermediate_size=need("intermediate_size", "ffn_dim", "n_inner"),
        num_layers=need("num_hidden_layers", "n_layer", "num_layers"),
        num_heads=heads,
        num_kv_heads=opt("num_key_value_heads") or heads,
        head_dim=opt("head_dim") or hidden // heads,
        vocab_size=need("vocab_size"),
        num_experts=opt("num_experts", "num_local_experts", "n_routed_experts"),
        experts_per_token=opt("num_experts_per_tok", "num_experts_per_token"),
        moe_intermediate_size=opt("moe_intermediate_size"),
        source=source,
    )


def load_hf_config(path: str | os.PathLike[str], name: str | None = None) -> ModelConfig:
    p = Path(path)
    try:
        cfg = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FactError(f"{p}: no such file; expected a Hugging Face config.json") from None
    except json.JSONDecodeError as exc:
        raise FactError(f"{p}: not valid JSON ({exc})") from None
    if not isinstance(cfg, dict):
        raise FactError(f"{p}: expected a JSON object")
    return model_from_hf_dict(cfg, name or str(cfg.get("_name_or_path") or p.parent.name), source=str(p))
