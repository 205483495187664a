"""What a live bridge run can be asked for: the request and the preset of sizes.

Torch-free, so that ``meshpact live bridge --help`` and the dashboard can offer the choices
without importing torch. :mod:`.workloads` builds the tensors these name.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from meshpact.core.errors import MeshpactError
from meshpact.core.facts import DType

__all__ = ["LiveRequest", "Preset", "PRESETS", "PresetName", "get_preset"]


class LiveRequest(str, Enum):
    """What ``meshpact live bridge --request`` runs."""

    FULL = "full"
    LOGPROB = "logprob"
    TOKEN = "token"
    OWNER_TOKEN = "owner_token"
    MLP = "mlp"

    @property
    def is_lm_head(self) -> bool:
        return self is not LiveRequest.MLP


@dataclass(frozen=True)
class Preset:
    """Sizes of one live run. ``source`` names where real dimensions come from."""

    name: str
    tokens: int
    hidden: int
    vocab: int
    intermediate: int
    dtype: DType
    seed: int
    source: str


# Qwen3-14B: hidden 5120, intermediate 17408, vocabulary 151936, bfloat16 (Qwen/Qwen3-14B
# config.json on Hugging Face: hidden_size, intermediate_size, vocab_size, torch_dtype).
PRESETS: dict[str, Preset] = {
    "tiny": Preset(
        "tiny",
        tokens=4,
        hidden=64,
        vocab=1000,
        intermediate=176,
        dtype=DType.BFLOAT16,
        seed=7,
        source="small sizes for tests",
    ),
    "qwen3-14b": Preset(
        "qwen3-14b",
        tokens=4,
        hidden=5120,
        vocab=151936,
        intermediate=17408,
        dtype=DType.BFLOAT16,
        seed=14,
        source="Qwen/Qwen3-14B config.json",
    ),
}


def get_preset(name: str) -> Preset:
    try:
        return PRESETS[name]
    except KeyError:
        raise MeshpactError(f"unknown preset {name!r}; expected one of {', '.join(PRESETS)}") from None


PresetName = Enum("PresetName", {name.upper().replace("-", "_").replace(".", "_"): name for name in PRESETS}, type=str)  # type: ignore[misc]  # members come from PRESETS, which mypy cannot read
PresetName.__doc__ = "The names of :data:`PRESETS`, as a choice for the command line."
