"""ModelArch: the hyperparameters of a Llama-family model, whatever file they came from."""

from __future__ import annotations

from dataclasses import dataclass

from firsttoken.ops.rotary import RopeScaling

SUPPORTED_ARCHITECTURES = ("gemma2", "gemma3_text", "llama", "mistral", "phi3", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelArch:
    """Shapes and constants of one Llama-family model (Llama 2/3, SmolLM, Mistral, Phi-3, Qwen2,
    Qwen3, Gemma 2/3): one decoder, and the few ways these differ from Llama as fields."""

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
    # Biases of the q/k/v projections; of o_proj (Llama's, Qwen3's, Gemma's attention_bias
    # sets both, Qwen2 has only the first); of gate/up/down (Llama's mlp_bias).
    attention_bias: bool
    attention_output_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: RopeScaling | None = None
    # Partial rotary (Phi-3's partial_rotary_factor): only the first rotary_dim dims of each
    # query and key head rotate; None: all head_dim.
    rotary_dim: int | None = None
    sliding_window: int | None = None
    # The layers the window applies to (Qwen2/3 window only their upper layers); None: all.
    sliding_window_layers: tuple[int, ...] | None = None
    # Qwen3, Gemma 3: each query and key head RMS-normalized (its own weight over head_dim)
    # before rotary.
    qk_norm: bool = False
    # Gemma 3: the rotary base of the windowed layers (None: rope_theta in every layer).
    local_rope_theta: float | None = None
    # Gemma: embeddings scaled (by sqrt(hidden_size)); every norm weighs by offset + weight (the
    # offset folded into the weights at load); a norm on the attention's and the MLP's output
    # too (sandwich); GeGLU (gelu_tanh) in place of SwiGLU; scores scaled by attention_scale in
    # place of head_dim ** -0.5; logits soft-capped: cap * tanh(logits / cap), and (Gemma 2)
    # attention scores likewise.
    embedding_multiplier: float = 1.0
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    hidden_activation: str = "silu"
    attention_scale: float | None = None
    final_logit_softcap: float | None = None
    attention_logit_softcap: float | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture: {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.hidden_activation not in ("silu", "gelu_tanh"):
            raise ValueError(
                f"hidden_activation: {self.hidden_activation!r} is not supported (silu, gelu_tanh)"
            )
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_kv_heads: {self.num_kv_heads} must divide num_heads {self.num_heads}")
        if self.rotary_dim is not None and not (
            0 < self.rotary_dim <= self.head_dim and self.rotary_dim % 2 == 0 == self.head_dim % 2
        ):
            raise ValueError(
                f"rotary_dim: {self.rotary_dim} must be even and within 2..head_dim {self.head_dim} "
                "(an even head_dim)"
            )

    @property
    def rotated_dims(self) -> int:
        """How many dims of each query and key head rotate."""
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def is_windowed(self, layer_index: int) -> bool:
        """Whether the layer has the sliding window (and, with Gemma 3, the local rotary base)."""
        if self.sliding_window is None:
            return False
        return self.sliding_window_layers is None or layer_index in self.sliding_window_layers

    def layer_window(self, layer_index: int, max_model_len: int) -> int | None:
        """The window the layer's attention must apply for sequences up to `max_model_len` tokens:
        None without one, or when every sequence fits within it (full attention is exact)."""
        if not self.is_windowed(layer_index) or self.sliding_window >= max_model_len:
            return None
        return self.sliding_window

    @property
    def plain_llama_layers(self) -> bool:
        """Whether every layer is Llama's: no query/key norms, no Gemma differences."""
        return not (
            self.qk_norm
            or self.sandwich_norms
            or self.hidden_activation != "silu"
            or self.attention_scale is not None
            or self.local_rope_theta is not None
            or self.attention_logit_softcap is not None
        )

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
