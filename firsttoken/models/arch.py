"""ModelArch: the hyperparameters of a Llama-family model, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.ops.rotary import RopeScaling

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "phi3", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelArch:
    """Shapes and constants of one Llama-family model (Llama 2/3, SmolLM, Mistral, Phi-3, Qwen2,
    Qwen3): one decoder, and the few ways these differ from Llama as fields."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: RopeScaling | None = None
    sliding_window: int | None = None
    # The layers the window applies to (Qwen2/3 window only their upper layers); None: all.
    sliding_window_layers: tuple[int, ...] | None = None
    # Qwen3: each query and key head RMS-normalized (its own weight over head_dim) before rotary.
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"num_kv_heads: {self.num_kv_heads} must divide num_heads {self.num_heads}"
            )

    @property
    def windowed_everywhere(self) -> bool:
        """Whether every layer has the sliding window (the one kind served past the window)."""
        return self.sliding_window_layers is None or len(set(self.sliding_window_layers)) == self.num_layers

    def window_within(self, max_model_len: int) -> int | None:
        """The sliding window attention must apply for sequences up to `max_model_len` tokens:
        None when the model has none or every sequence fits within it (full attention is exact)."""
        if self.sliding_window is None or self.sliding_window >= max_model_len:
            return None
        return self.sliding_window

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def num_non_embedding_params(self) -> int:
        """Weights of the transformer blocks (the FLOP count of a token is twice this)."""
        attention = self.hidden_size * (self.q_size + 2 * self.kv_size) + self.q_size * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attention + mlp)
