"""Model shapes for the planner: a decoder-only transformer's dimensions, and the published ones.

``ModelShape`` holds enough of a model to count its parameters, FLOPs and bytes, spelt ``layers, hidden, heads,
kv_heads, ffn, vocab`` as everywhere in the course; ``MODEL_SHAPES`` holds the published models chapter 00 plans for
(Llama 2 7B, Llama 3 8B and 70B, Llama 3.1 405B, GPT-3 175B), each with its source; ``model_shape`` looks one up by
key (``"llama-3-70b"``) or size alias (``"70B"``).

``LayoutError`` lives here, at the bottom of the planner's modules, because all of them raise it: an unknown model,
cluster or degree is as much a layout that cannot run as degrees whose product is not the GPU count.
``_check_degree`` and ``_divisors`` are the two checks they share. ``course_utils.planner`` re-exports every public
name, so ``from course_utils.planner import ModelShape`` works as before.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


class LayoutError(ValueError):
    """A parallel layout that cannot run; the message says what to change."""


def _check_degree(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name} must be a whole number of at least 1, got {value!r}; set it to 1 or more.")
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class ModelShape:
    """A decoder-only transformer, enough of it to count parameters, FLOPs and bytes."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    mlp: str = "swiglu"  # "swiglu": 3 matrices h x ffn (Llama); "gelu": 2 matrices (GPT)
    tied_embeddings: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise LayoutError(
                f"{self.name}: hidden ({self.hidden}) must be a multiple of heads ({self.heads}) and heads "
                f"a multiple of kv_heads ({self.kv_heads}); fix the shape."
            )
        if self.mlp not in ("swiglu", "gelu"):
            raise LayoutError(f"{self.name}: mlp must be 'swiglu' or 'gelu', got {self.mlp!r}.")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        h = self.hidden
        attention = 2 * h * h + 2 * h * self.kv_dim  # W_q and W_o, plus W_k and W_v (GQA: kv_dim wide)
        mlp = (3 if self.mlp == "swiglu" else 2) * h * self.ffn
        return attention + mlp + 2 * h  # two norms

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def n_params(self) -> int:
        return self.layers * self.params_per_layer + self.embedding_params + self.hidden  # + final norm

    def held_by_tp(self, tp: int) -> "ModelShape":
        """The shape a TP group holds between its ranks: a KV head is never split, so when tp is a multiple of the
        KV heads each one is copied onto tp / kv_heads ranks (chapter 05), which is kv_heads = tp heads' worth of
        W_k and W_v over the group. Divide its counts by tp for one rank."""
        return replace(self, kv_heads=max(self.kv_heads, tp))


MODEL_SHAPES: dict[str, ModelShape] = {
    # Touvron et al. 2023, "Llama 2": Table 1 (7B has no GQA), sec 2.2 "Tokenizer" (32k vocabulary);
    # shape from the Llama 1 paper's Table 2 (dimension 4096, 32 heads, 32 layers); ffn 11008 is the
    # released params.json / HF config. n_params = 6.74e9.
    "llama-2-7b": ModelShape("Llama 2 7B", layers=32, hidden=4096, heads=32, kv_heads=32, ffn=11008,
                             vocab=32_000, source="Touvron et al. 2023 (Llama 1 Table 2, Llama 2 Table 1)"),
    # Llama Team 2024, "The Llama 3 Herd of Models", Table 3; vocabulary 128,256 is the released
    # tokenizer (the paper rounds to "128K": 128,000 + 256 special tokens). n_params = 8.03e9.
    "llama-3-8b": ModelShape("Llama 3 8B", layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336,
                             vocab=128_256, source="Llama 3 paper, Table 3"),
    # Same Table 3. n_params = 70.6e9.
    "llama-3-70b": ModelShape("Llama 3 70B", layers=80, hidden=8192, heads=64, kv_heads=8, ffn=28672,
                              vocab=128_256, source="Llama 3 paper, Table 3"),
    # Same Table 3 (126 layers, model dimension 16,384, FFN 53,248, 128 heads, 8 KV heads). n_params = 405.9e9.
    "llama-3.1-405b": ModelShape("Llama 3.1 405B", layers=126, hidden=16384, heads=128, kv_heads=8,
                                 ffn=53248, vocab=128_256, source="Llama 3 paper, Table 3"),
    # Brown et al. 2020, Table 2.1 (96 layers, d_model 12288, 96 heads, ffn = 4 d_model); vocabulary
    # padded to 51,200 as in Narayanan et al. 2021 (sec 5.1) and Korthikanti et al. 2022 (sec 6),
    # embeddings tied (Korthikanti sec 3). n_params = 174.6e9 (GPT-3 Table D.1: 174,600M).
    "gpt-3-175b": ModelShape("GPT-3 175B", layers=96, hidden=12288, heads=96, kv_heads=96, ffn=49152,
                             vocab=51_200, mlp="gelu", tied_embeddings=True,
                             source="Brown et al. 2020, Table 2.1"),
}
_MODEL_ALIASES = {"7b": "llama-2-7b", "8b": "llama-3-8b", "70b": "llama-3-70b", "405b": "llama-3.1-405b",
                  "175b": "gpt-3-175b"}


def model_shape(name: str | ModelShape) -> ModelShape:
    """Look up a model by key (``"llama-3-70b"``) or size alias (``"70B"``)."""
    if isinstance(name, ModelShape):
        return name
    key = str(name).lower()
    key = _MODEL_ALIASES.get(key, key)
    if key not in MODEL_SHAPES:
        raise LayoutError(f"unknown model {name!r}; use one of {', '.join(MODEL_SHAPES)} or a ModelShape.")
    return MODEL_SHAPES[key]
