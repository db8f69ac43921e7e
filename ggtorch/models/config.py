"""ModelConfig: the hyperparameters of a model of any supported family, read from GGUF metadata.

Keys are read through gguf-py's ``Keys`` constants with the ``{arch}`` placeholder filled in,
with llama.cpp's defaults and fallbacks (``llama_model_base::load_hparams`` and each family's
``load_arch_hparams`` in src/llama-model.cpp and src/models/), so a file llama.cpp loads gets the
same numbers here. The family's row (models/families.py) supplies the switches and the defaults
for missing keys; the tensors present decide the optional parts (tied output, fused q/k/v,
biases, rope factors).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

from gguf import Keys

from ggtorch.errors import BadGGUF, Unsupported
from ggtorch.io.gguf import GGUFFile, require_kind
from ggtorch.models import names
from ggtorch.models.families import FAMILIES, Family

ARCH = "llama"
"""The architecture of new models (``ggtorch train --vocab-model``)."""

# gguf-py dropped the constant for the pre-2023 key; llama.cpp still reads it as a fallback
# for Keys.Rope.SCALING_FACTOR (LLM_KV_ROPE_SCALE_LINEAR).
ROPE_SCALE_LINEAR = "{arch}.rope.scale_linear"
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"
"""llama.cpp's LLM_KV_ATTENTION_RECURRENT_LAYERS (newer than the gguf release ggtorch requires)."""


@dataclass
class ModelConfig:
    """Shapes and constants of a model (ggml's hparams, named after llama.cpp's fields)."""

    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int = 2048
    """Context length the model was trained with (``{arch}.context_length``)."""
    rms_eps: float = 1e-5
    n_rot: int | None = None
    """Rotary dimensions per head (default: the whole head); the first n_rot of each head rotate."""
    rope_freq_base: float = 10000.0
    rope_freq_scale: float = 1.0
    """Linear rope scaling: 1 / ``rope.scaling.factor`` (positions are multiplied by it)."""
    tied_output: bool = False
    """No ``output.weight`` in the file: the output projection reuses ``token_embd``."""
    rope_freqs: bool = False
    """The file has ``rope_freqs.weight``: per-pair divisors of the rope frequencies (Llama 3.1+)."""
    arch: str = ARCH
    """``general.architecture``: the row of models/families.py the model follows."""
    head_dim_k: int | None = None
    """Width of a query/key head (``attention.key_length``; default n_embd / n_head)."""
    sliding_window: int = 0
    """Keys a sliding-window layer sees: the query's own position and the window - 1 before it."""
    swa_layers: tuple[bool, ...] = ()
    """Per layer, whether it is a sliding-window layer (empty: none is)."""
    rope_freq_base_swa: float = 10000.0
    rope_freq_scale_swa: float = 1.0
    """Rope of the sliding-window layers (gemma: their own base, no scaling)."""
    attn_softcap: float = 0.0
    """Attention scores become cap·tanh(scores / cap) before the softmax (0: off)."""
    final_softcap: float = 0.0
    """Logits become cap·tanh(logits / cap) (0: off)."""
    attention_scale: float | None = None
    """Scale of q·k (default 1/sqrt(head_dim_k))."""
    rope_long_short: bool = False
    """The file has LongRoPE's ``rope_factors_long``/``_short`` (phi3)."""
    n_ctx_orig: int | None = None
    """``rope.scaling.original_context_length`` (default n_ctx_train): above it LongRoPE uses the long
    factors; YaRN places its ramp by it."""
    rope_attn_factor: float = 1.0
    """``rope.scaling.attn_factor``: cos and sin are multiplied by it (LongRoPE's magnitude scale)."""
    rope_yarn: bool = False
    """``rope.scaling.type = yarn``: each pair's angle mixes the scaled and the unscaled one along
    ggml's YaRN ramp (between the pairs that turn ``yarn_beta_fast`` and ``yarn_beta_slow`` times in
    ``n_ctx_orig_yarn`` positions), and cos and sin grow by 1 + 0.1 ln(scaling factor)."""
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    """Where YaRN's ramp starts and ends, in turns over ``n_ctx_orig`` (llama.cpp's defaults; mistral3 reads
    ``rope.scaling.yarn_beta_fast``/``_slow``)."""
    yarn_log_mul: float = 0.0
    """``rope.scaling.yarn_log_multiplier`` (mistral3): YaRN's magnitude becomes
    (1 + 0.1 ln factor) / (1 + 0.1 yarn_log_mul ln factor)."""
    attn_temp_scale: float = 0.0
    """``attention.temperature_scale`` (mistral3, Llama 4's beta): queries at position p are multiplied by
    1 + beta ln(floor(p / n_ctx_orig) + 1) after rope (0: off)."""
    embedding_multiplier: float = 0.0
    """``embedding_scale`` (granite): token embeddings are multiplied by it (0: not)."""
    residual_multiplier: float = 0.0
    """``residual_scale`` (granite): attention and FFN outputs are multiplied by it before their residual add
    (0: not)."""
    logit_scale: float = 0.0
    """``logit_scale`` (granite): logits are multiplied by 1 / logit_scale (0: not)."""
    fused_qkv: bool = False
    """q, k and v come from one ``attn_qkv`` matrix."""
    biases: tuple[str, ...] = ()
    """Matrix kinds with a ``.bias`` in the file (``attn_q``, ``output``, ...)."""
    n_expert: int = 0
    """Routed experts per layer (``expert_count``; 0: a dense FFN)."""
    n_expert_used: int = 0
    """Experts each token is routed to (``expert_used_count``, the top k)."""
    n_ff_exp: int | None = None
    """Hidden width of one expert (``expert_feed_forward_length``; default as llama.cpp: n_ff for
    llama, n_ff / n_expert_used for the qwen MoE families)."""
    n_ff_shexp: int | None = None
    """Hidden width of qwen2moe's shared expert (``expert_shared_feed_forward_length``; default n_ff)."""
    recurrent_layers: tuple[bool, ...] = ()
    """Per layer, whether it is a Gated DeltaNet layer instead of attention (empty: none is; qwen35)."""
    ssm_conv_kernel: int = 0
    """Taps of a DeltaNet layer's short causal convolution over q, k and v (``ssm.conv_kernel``)."""
    ssm_inner: int = 0
    """Width of a DeltaNet layer's value heads together (``ssm.inner_size``)."""
    ssm_state: int = 0
    """Width of one DeltaNet key head, and of its value heads: the state is ssm_state x ssm_state per value head
    (``ssm.state_size``)."""
    ssm_v_heads: int = 0
    """Value heads of a DeltaNet layer (``ssm.time_step_rank``); each reads key head h mod ssm_k_heads."""
    ssm_k_heads: int = 0
    """Query/key heads of a DeltaNet layer (``ssm.group_count``)."""
    rope_sections: tuple[int, ...] = ()
    """``rope.dimension_sections`` of multi-section rope (qwen35): rotated pairs per position kind."""
    n_layer_nextn: int = 0
    """Next-token-prediction blocks stored after the trunk (``nextn_predict_layers``): never run, kept in exports."""
    head_dim_swa: int | None = None
    """Head size of the sliding-window layers (``attention.key_length_swa``; default head_dim; gemma4)."""
    n_rot_swa: int | None = None
    """Rotary dimensions of the sliding-window layers (``rope.dimension_count_swa``; default n_rot; gemma4)."""
    n_head_kv_layers: tuple[int, ...] = ()
    """Per layer, its KV heads when ``head_count_kv`` is an array (empty: n_head_kv everywhere; gemma4)."""
    n_ff_layers: tuple[int, ...] = ()
    """Per layer, its FFN width when ``feed_forward_length`` is an array (empty: n_ff everywhere; gemma4)."""
    n_layer_kv_shared: int = 0
    """The last this many layers compute no K/V and read an earlier layer's (``attention.shared_kv_layers``)."""
    n_embd_per_layer: int = 0
    """Width of each layer's own embedding input (``embedding_length_per_layer_input``; 0: none; gemma4 E2B/E4B)."""
    k_as_v_layers: tuple[bool, ...] = ()
    """Per layer, whether it has no ``attn_v`` and takes its K projection as V (gemma4's global layers of its larger
    models; empty: none)."""
    layer_output_scale: bool = False
    """Each block's output is multiplied by its ``layer_output_scale`` (gemma4)."""
    expert_scales: bool = False
    """Each expert's down projection is multiplied by its entry of ``ffn_down_exps.scale`` (gemma4)."""
    fused_gate_up_exps: bool = False
    """The experts' gate and up stacks are one ``ffn_gate_up_exps`` (gemma4's converter writes them so)."""

    def __post_init__(self) -> None:
        if self.arch not in FAMILIES:
            raise Unsupported(f"unsupported architecture '{self.arch}'; ggtorch supports {', '.join(FAMILIES)}")
        if self.n_rot is None:
            self.n_rot = self.head_dim
        for name in ("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "n_ctx_train", "n_rot"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise BadGGUF(f"{self.arch} hyperparameter {name} = {value!r} must be a positive integer")
        if self.head_dim_k is None and self.n_embd % self.n_head:
            raise BadGGUF(f"embedding length {self.n_embd} is not divisible by head count {self.n_head}")
        if self.n_head % self.n_head_kv:
            raise BadGGUF(f"head count {self.n_head} is not divisible by KV head count {self.n_head_kv}")
        if self.n_rot > self.head_dim or self.n_rot % 2:
            raise BadGGUF(f"rope dimension count {self.n_rot} must be even and at most the head size {self.head_dim}")
        if self.family.rope_whole_head and self.n_rot != self.head_dim:
            raise Unsupported(f"rope dimension count {self.n_rot} differs from the head size {self.head_dim}; "
                              f"llama.cpp's {self.arch} requires them equal")
        for name in ("rms_eps", "rope_freq_base", "rope_freq_scale", "rope_freq_base_swa", "rope_freq_scale_swa"):
            value = getattr(self, name)
            if not value > 0:
                raise BadGGUF(f"{self.arch} hyperparameter {name} = {value!r} must be positive")
        self._check_experts()
        if self.swa_layers and len(self.swa_layers) != self.n_layer:
            raise BadGGUF(f"the sliding-window pattern has {len(self.swa_layers)} layers, the model {self.n_layer}")
        if any(self.swa_layers) and self.sliding_window <= 0:
            raise BadGGUF(f"sliding-window layers need a positive window, got {self.sliding_window}")
        self._check_linear_attention()
        self._check_layer_widths()

    def _check_layer_widths(self) -> None:
        """Per-layer shapes (gemma4): one entry per layer, whole KV groups, K/V sharing from a layer of the same
        kind (llama.cpp takes layer n_kv - 2 for sliding layers and n_kv - 1 for global ones, and asserts n_kv >= 2)."""
        for name in ("n_head_kv_layers", "n_ff_layers", "k_as_v_layers"):
            value = getattr(self, name)
            if value and len(value) != self.n_layer:
                raise BadGGUF(f"{self.arch} per-layer {name.removesuffix('_layers')} has {len(value)} entries for "
                              f"{self.n_layer} layers")
        for layer in range(self.n_layer):
            n_kv, n_ff = self.n_head_kv_at(layer), self.n_ff_at(layer)
            if not isinstance(n_kv, int) or n_kv <= 0 or self.n_head % n_kv:
                raise BadGGUF(f"layer {layer}'s KV head count {n_kv} must be positive and divide the head count "
                              f"{self.n_head}")
            if not isinstance(n_ff, int) or n_ff <= 0:
                raise BadGGUF(f"layer {layer}'s feed-forward length {n_ff} must be a positive integer")
        for name in ("head_dim_swa", "n_rot_swa"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise BadGGUF(f"{self.arch} hyperparameter {name} = {value!r} must be a positive integer")
        if self.n_rot_swa is not None and (self.n_rot_swa > (self.head_dim_swa or self.head_dim) or self.n_rot_swa % 2):
            raise BadGGUF(f"sliding layers' rope dimension count {self.n_rot_swa} must be even and at most their head "
                          f"size {self.head_dim_swa or self.head_dim}")
        if not 0 <= self.n_layer_kv_shared <= self.n_layer:
            raise BadGGUF(f"{self.n_layer_kv_shared} layers sharing K/V, the model has {self.n_layer}")
        if self.n_layer_kv_shared:
            n_kv = self.n_layer - self.n_layer_kv_shared
            if n_kv < 2:
                raise BadGGUF(f"{self.n_layer_kv_shared} of {self.n_layer} layers share K/V: llama.cpp needs at least "
                              "two layers with their own")
            for layer in range(n_kv, self.n_layer):
                source = self.kv_source(layer)
                if self.is_swa(source) != self.is_swa(layer):
                    kind = "sliding" if self.is_swa(layer) else "global"
                    raise BadGGUF(f"layer {layer} ({kind}) would read the K/V of layer {source}, which is not {kind}: "
                                  "llama.cpp's K/V sharing needs the last two layers with their own K/V to be a "
                                  "sliding and a global one")

    def _check_linear_attention(self) -> None:
        """The DeltaNet shapes llama.cpp's qwen35 graph asserts (a square state per value head, whole key groups)."""
        if not self.family.linear_attention:
            return
        if len(self.recurrent_layers) != self.n_layer:
            raise BadGGUF(f"the recurrent-layer pattern has {len(self.recurrent_layers)} layers, the model "
                          f"{self.n_layer}")
        if not any(self.recurrent_layers):
            return
        for name in ("ssm_conv_kernel", "ssm_inner", "ssm_state", "ssm_v_heads", "ssm_k_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise BadGGUF(f"{self.arch} hyperparameter {name} = {value!r} must be a positive integer")
        if self.ssm_inner != self.ssm_v_heads * self.ssm_state:
            raise BadGGUF(f"ssm inner size {self.ssm_inner} must be ssm time-step rank {self.ssm_v_heads} x ssm "
                          f"state size {self.ssm_state} (a square state per value head)")
        if self.ssm_v_heads % self.ssm_k_heads:
            raise BadGGUF(f"ssm time-step rank {self.ssm_v_heads} (value heads) is not a multiple of ssm group "
                          f"count {self.ssm_k_heads} (key heads)")

    def _check_experts(self) -> None:
        """The expert counts llama.cpp asserts (GGML_ASSERT there; one message here)."""
        experts = self.family.experts
        count, used = Keys.LLM.EXPERT_COUNT.format(arch=self.arch), Keys.LLM.EXPERT_USED_COUNT.format(arch=self.arch)
        if experts == "none":
            if self.n_expert:
                raise Unsupported(f"'{count}' = {self.n_expert}: ggtorch's {self.arch} has no experts "
                                  f"(MoE families: {', '.join(a for a, f in FAMILIES.items() if f.experts != 'none')})")
            return
        if experts == "required" and self.n_expert <= 0:
            raise BadGGUF(f"a {self.arch} model needs '{count}' > 0, got {self.n_expert}")
        if self.n_expert < 0 or (self.n_expert and not 0 < self.n_expert_used <= self.n_expert):
            raise BadGGUF(f"'{used}' = {self.n_expert_used} must be between 1 and '{count}' = {self.n_expert}")
        if self.n_expert:
            if self.n_ff_exp is None:
                self.n_ff_exp = self.n_ff if self.family.expert_width == "n_ff" else self.n_ff // self.n_expert_used
            if self.n_ff_shexp is None and self.family.shared_expert:
                self.n_ff_shexp = self.n_ff
            for name in ("n_ff_exp", "n_ff_shexp"):
                value = getattr(self, name)
                if value is not None and (not isinstance(value, int) or value <= 0):
                    raise BadGGUF(f"{self.arch} hyperparameter {name} = {value!r} must be a positive integer")

    @property
    def family(self) -> Family:
        return FAMILIES[self.arch]

    @property
    def n_ctx_orig_yarn(self) -> int:
        """``n_ctx_orig`` or, when the file has none, n_ctx_train (llama.cpp's hparams.n_ctx_orig_yarn): where
        LongRoPE switches factors, YaRN's ramp and the attention temperature's step."""
        return self.n_ctx_orig or self.n_ctx_train

    @property
    def head_dim(self) -> int:
        return self.head_dim_k if self.head_dim_k is not None else self.n_embd // self.n_head

    @property
    def n_embd_q(self) -> int:
        """Width of all query heads together (not always n_embd: qwen3, gemma)."""
        return self.head_dim * self.n_head

    @property
    def n_embd_kv(self) -> int:
        """Width of K and V (grouped-query attention: fewer KV heads than query heads)."""
        return self.head_dim * self.n_head_kv

    @property
    def kq_scale(self) -> float:
        return self.attention_scale if self.attention_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def describe(self) -> dict[str, Any]:
        """The numbers worth showing (``ggtorch info``): the shape always, the other fields where they
        differ from their defaults, and the head size."""
        shape = ("arch", "n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff", "n_ctx_train", "rms_eps",
                 "n_rot", "rope_freq_base", "rope_freq_scale", "tied_output")
        out = {name: getattr(self, name) for name in shape}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in out and value != f.default and f.name != "head_dim_k":
                out[f.name] = value
        out["head_dim"] = self.head_dim
        return out

    def is_swa(self, layer: int) -> bool:
        return bool(self.swa_layers) and self.swa_layers[layer]

    def head_dim_at(self, layer: int) -> int:
        """Head size of ``layer`` (sliding layers may have their own)."""
        return self.head_dim_swa if self.head_dim_swa is not None and self.is_swa(layer) else self.head_dim

    def n_rot_at(self, layer: int) -> int:
        """Rotated dimensions per head of ``layer``."""
        if self.n_rot_swa is not None and self.is_swa(layer):
            return self.n_rot_swa
        assert self.n_rot is not None
        return self.n_rot

    def n_head_kv_at(self, layer: int) -> int:
        return self.n_head_kv_layers[layer] if self.n_head_kv_layers else self.n_head_kv

    def n_ff_at(self, layer: int) -> int:
        return self.n_ff_layers[layer] if self.n_ff_layers else self.n_ff

    def n_embd_q_at(self, layer: int) -> int:
        return self.head_dim_at(layer) * self.n_head

    def n_embd_kv_at(self, layer: int) -> int:
        return self.head_dim_at(layer) * self.n_head_kv_at(layer)

    def has_kv(self, layer: int) -> bool:
        """Whether ``layer`` computes its own K and V (llama.cpp's hparams.has_kv)."""
        return layer < self.n_layer - self.n_layer_kv_shared

    def kv_source(self, layer: int) -> int:
        """The layer whose K/V ``layer`` attends to: itself, or for a sharing layer the last one of its kind before
        the sharing ones (llama.cpp's layer_reuse_cb)."""
        if self.has_kv(layer):
            return layer
        n_kv = self.n_layer - self.n_layer_kv_shared
        return n_kv - (2 if self.is_swa(layer) else 1)

    def k_as_v(self, layer: int) -> bool:
        return bool(self.k_as_v_layers) and self.k_as_v_layers[layer]

    def is_recurrent(self, layer: int) -> bool:
        """Whether ``layer`` is a Gated DeltaNet layer (its mixer is no attention)."""
        return bool(self.recurrent_layers) and self.recurrent_layers[layer]

    @property
    def n_embd_q_proj(self) -> int:
        """Rows of the query projection: the query heads, and a gate per head where the family has one."""
        return self.n_embd_q * (2 if self.family.attn_output_gate else 1)

    @property
    def ssm_conv_channels(self) -> int:
        """Channels of a DeltaNet layer's fused q|k|v, which its convolution runs over."""
        return 2 * self.ssm_k_heads * self.ssm_state + self.ssm_inner

    @classmethod
    def from_gguf(cls, f: GGUFFile) -> ModelConfig:
        """Read the config from a GGUF's metadata; Unsupported for architectures without a family row."""
        require_kind(f, "model")
        arch = f.architecture
        if arch not in FAMILIES:
            raise Unsupported(f"{f.path}: unsupported architecture '{arch}'; ggtorch supports "
                              f"{', '.join(FAMILIES)}")
        family = FAMILIES[arch]

        def key(template: str) -> str:
            return template.format(arch=arch)

        def required(template: str) -> Any:
            return _scalar(f, key(template), f.require(key(template)))

        def optional(template: str, default: Any) -> Any:
            k = key(template)
            return _scalar(f, k, f.metadata[k]) if k in f.metadata else default

        def integer(template: str, value: Any) -> int:
            if isinstance(value, bool) or not isinstance(value, int):
                raise BadGGUF(f"{f.path}: '{key(template)}' = {value!r} must be an integer")
            return value

        n_head = integer(Keys.Attention.HEAD_COUNT, required(Keys.Attention.HEAD_COUNT))
        n_embd = integer(Keys.LLM.EMBEDDING_LENGTH, required(Keys.LLM.EMBEDDING_LENGTH))
        n_layer_all = integer(Keys.LLM.BLOCK_COUNT, required(Keys.LLM.BLOCK_COUNT))
        n_layer_nextn = integer(Keys.LLM.NEXTN_PREDICT_LAYERS, optional(Keys.LLM.NEXTN_PREDICT_LAYERS, 0))
        widths = _layer_widths(f, family, n_layer_all, n_layer_all - n_layer_nextn, integer)
        n_head_kv = integer(Keys.Attention.HEAD_COUNT_KV, widths.pop("n_head_kv", None)
                            or optional(Keys.Attention.HEAD_COUNT_KV, n_head))
        for template, value in ((Keys.Attention.HEAD_COUNT, n_head), (Keys.LLM.EMBEDDING_LENGTH, n_embd),
                                (Keys.LLM.BLOCK_COUNT, n_layer_all), (Keys.Attention.HEAD_COUNT_KV, n_head_kv)):
            if value < 1:
                raise BadGGUF(f"{f.path}: '{key(template)}' is {value}; a model has at least 1, so the file is "
                              "broken (re-download or re-convert it)")
        if not 0 <= n_layer_nextn < n_layer_all:
            raise BadGGUF(f"{f.path}: '{key(Keys.LLM.NEXTN_PREDICT_LAYERS)}' = {n_layer_nextn} must be below "
                          f"'{key(Keys.LLM.BLOCK_COUNT)}' = {n_layer_all}")
        n_layer = n_layer_all - n_layer_nextn
        n_vocab = optional(Keys.LLM.VOCAB_SIZE, None) if family.vocab_size_key else None
        if n_vocab is None:
            tokens = f.get(Keys.Tokenizer.LIST)
            if tokens is None:
                raise BadGGUF(f"{f.path}: neither '{key(Keys.LLM.VOCAB_SIZE)}' nor '{Keys.Tokenizer.LIST}' "
                              "is present, so the vocabulary size is unknown")
            n_vocab = len(tokens)
        head_dim = integer(Keys.Attention.KEY_LENGTH,
                           optional(Keys.Attention.KEY_LENGTH, n_embd // max(n_head, 1)))
        value_dim = integer(Keys.Attention.VALUE_LENGTH, optional(Keys.Attention.VALUE_LENGTH, head_dim))
        if value_dim != head_dim:
            raise Unsupported(f"{f.path}: value heads of {value_dim} differ from key heads of {head_dim}; "
                              "ggtorch supports equal ones")

        scaling_type = optional(Keys.Rope.SCALING_TYPE, "linear")
        longrope = family.rope_factors == "long_short"
        if scaling_type not in ("none", "linear", "yarn") and not (scaling_type == "longrope" and longrope):
            raise Unsupported(f"{f.path}: rope scaling type '{scaling_type}' is not supported (only none, linear, "
                              + ("yarn and longrope)" if longrope else "yarn; longrope for phi3)"))
        factor = optional(Keys.Rope.SCALING_FACTOR, None)
        if factor is None:
            factor = optional(ROPE_SCALE_LINEAR, 0.0)
        # llama.cpp: a factor of 0 (absent) means no scaling, and type none never scales.
        freq_scale = 1.0 if float(factor) == 0.0 or scaling_type == "none" else 1.0 / float(factor)
        freq_base = float(optional(Keys.Rope.FREQ_BASE, 10000.0))

        window, swa_layers = _sliding_window(f, family, n_layer, optional)
        base_swa, scale_swa = 10000.0, 1.0
        if family.swa_rope_base == "global":
            base_swa, scale_swa = freq_base, freq_scale
        if any(swa_layers):
            base_swa = float(optional(Keys.Rope.FREQ_BASE_SWA, base_swa))

        attention_scale = family.kq_scale
        if family.query_prescale:
            width = n_embd // n_head if n_layer in family.large_layer_counts else head_dim
            attention_scale = 1.0 / math.sqrt(width)
        if family.multipliers:  # granite: attention.scale, 0 or absent meaning 1/sqrt(head size)
            attention_scale = float(optional(Keys.Attention.SCALE, 0.0)) or attention_scale
        n_ctx_train = integer(Keys.LLM.CONTEXT_LENGTH, required(Keys.LLM.CONTEXT_LENGTH))
        tensors = f.tensors
        linear = _linear_attention(f, family, n_layer_all, n_layer, integer, optional)
        recurrent = linear.get("recurrent_layers", ())
        attention_layer = next((i for i in range(n_layer) if not (recurrent and recurrent[i])), 0)
        fused_qkv = names.gguf_name("attn_qkv", attention_layer) in tensors
        biases = tuple(kind for kind in names.MATRIX_KINDS if names.bias_of(kind) in names.TENSOR_KINDS
                       and any(name in tensors for name in _bias_names(kind, n_layer)))
        return cls(
            n_vocab=int(n_vocab),
            n_embd=n_embd,
            n_layer=n_layer,
            n_head=n_head,
            n_head_kv=n_head_kv,
            n_ff=widths.pop("n_ff", None) or _n_ff(f, family, integer, optional),
            n_ctx_train=n_ctx_train,
            rms_eps=float(required(Keys.Attention.LAYERNORM_RMS_EPS)),
            n_rot=integer(Keys.Rope.DIMENSION_COUNT, optional(Keys.Rope.DIMENSION_COUNT, head_dim)),
            rope_freq_base=freq_base,
            rope_freq_scale=freq_scale,
            tied_output=family.tied_always or names.gguf_name("output") not in tensors,
            rope_freqs=names.ROPE_FREQS in tensors,
            arch=arch,
            head_dim_k=head_dim if head_dim != n_embd // n_head else None,
            sliding_window=window,
            swa_layers=swa_layers,
            rope_freq_base_swa=base_swa,
            rope_freq_scale_swa=scale_swa,
            attn_softcap=float(optional(Keys.LLM.ATTN_LOGIT_SOFTCAPPING, family.attn_softcap)),
            final_softcap=float(optional(Keys.LLM.FINAL_LOGIT_SOFTCAPPING, family.final_softcap)),
            attention_scale=attention_scale,
            rope_long_short=family.rope_factors == "long_short" and names.ROPE_FACTORS_SHORT in tensors,
            n_ctx_orig=_optional_int(f, Keys.Rope.SCALING_ORIG_CTX_LEN, optional),
            rope_attn_factor=float(optional(Keys.Rope.SCALING_ATTN_FACTOR, 1.0)),
            rope_yarn=scaling_type == "yarn",
            **_mistral3_keys(family, optional),
            **_granite_keys(f, family, optional, required),
            fused_qkv=fused_qkv,
            biases=biases,
            **_experts(f, family, integer, optional),
            **linear,
            n_layer_nextn=n_layer_nextn,
            **widths,
            **_gemma4_tensors(family, tensors, n_layer),
        )


LlamaConfig = ModelConfig
"""The name the config had when ggtorch ran llama alone; kept for the public API."""


def _optional_int(f: GGUFFile, template: str, optional: Any) -> int | None:
    value = optional(template, None)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise BadGGUF(f"{f.path}: '{template.format(arch=f.architecture)}' = {value!r} must be an integer")
    return value


def _mistral3_keys(family: Family, optional: Any) -> dict[str, float]:
    """The YaRN and attention-temperature keys only some loaders read (the others keep the defaults)."""
    out = {}
    if family.yarn_keys:
        out = {"yarn_beta_fast": float(optional(Keys.Rope.SCALING_YARN_BETA_FAST, 32.0)),
               "yarn_beta_slow": float(optional(Keys.Rope.SCALING_YARN_BETA_SLOW, 1.0)),
               "yarn_log_mul": float(optional(Keys.Rope.SCALING_YARN_LOG_MUL, 0.0))}
    if family.attn_temperature:
        out["attn_temp_scale"] = float(optional(Keys.Attention.TEMPERATURE_SCALE, 0.0))
    return out


def _granite_keys(f: GGUFFile, family: Family, optional: Any, required: Any) -> dict[str, float]:
    """Granite's scales of the embeddings, residual branches and logits (llama_model_granite::load_arch_hparams:
    logit_scale required, the others optional, 0 meaning off)."""
    if not family.multipliers:
        return {}
    if optional(Keys.Rope.SCALING_FINETUNED, True) is False:  # llama.cpp's granite then applies no rope at all
        raise Unsupported(f"{f.path}: '{Keys.Rope.SCALING_FINETUNED.format(arch=f.architecture)}' is false (a "
                          "granite without rope); ggtorch supports granite models with rope")
    return {"embedding_multiplier": float(optional(Keys.LLM.EMBEDDING_SCALE, 0.0)),
            "residual_multiplier": float(optional(Keys.LLM.RESIDUAL_SCALE, 0.0)),
            "logit_scale": float(required(Keys.LLM.LOGIT_SCALE))}


def _layer_widths(f: GGUFFile, family: Family, n_layer_all: int, n_layer: int, integer: Any) -> dict[str, Any]:
    """A family with per-layer shapes (gemma4): ``head_count_kv`` and ``feed_forward_length`` as a number or an array
    (llama.cpp's get_key_or_arr), the sliding layers' head size and rope width, the K/V-sharing layers and the
    per-layer embedding width. Returns ModelConfig fields, with ``n_head_kv``/``n_ff`` the first layer's values."""
    if not family.layer_widths:
        return {}
    out: dict[str, Any] = {}

    def key(template: str) -> str:
        return template.format(arch=f.architecture)

    for field_name, template in (("n_head_kv", Keys.Attention.HEAD_COUNT_KV), ("n_ff", Keys.LLM.FEED_FORWARD_LENGTH)):
        value = f.metadata.get(key(template))
        if isinstance(value, list):
            if len(value) != n_layer_all:
                raise BadGGUF(f"{f.path}: '{key(template)}' has {len(value)} entries for {n_layer_all} layers")
            values = tuple(integer(template, v) for v in value[:n_layer])
            out[field_name], out[f"{field_name}_layers"] = values[0], values
    head_dim_swa = f.metadata.get(key(Keys.Attention.KEY_LENGTH_SWA))
    if head_dim_swa is not None:
        out["head_dim_swa"] = integer(Keys.Attention.KEY_LENGTH_SWA, head_dim_swa)
        value_swa = f.metadata.get(key(Keys.Attention.VALUE_LENGTH_SWA), head_dim_swa)
        if value_swa != head_dim_swa:
            raise Unsupported(f"{f.path}: sliding layers' value heads of {value_swa} differ from their key heads of "
                              f"{head_dim_swa}; llama.cpp's {f.architecture} requires them equal")
    n_rot_swa = f.metadata.get(key(Keys.Rope.DIMENSION_COUNT_SWA))
    if n_rot_swa is not None:
        out["n_rot_swa"] = integer(Keys.Rope.DIMENSION_COUNT_SWA, n_rot_swa)
    if family.shared_kv:
        out["n_layer_kv_shared"] = integer(Keys.Attention.SHARED_KV_LAYERS,
                                           f.metadata.get(key(Keys.Attention.SHARED_KV_LAYERS), 0))
    if family.per_layer_inputs:
        out["n_embd_per_layer"] = integer(Keys.LLM.EMBD_LENGTH_PER_LAYER_INP,
                                          f.require(key(Keys.LLM.EMBD_LENGTH_PER_LAYER_INP)))
    return out


def _gemma4_tensors(family: Family, tensors: dict[str, Any], n_layer: int) -> dict[str, Any]:
    """What gemma4's optional tensors switch on: a layer without ``attn_v`` takes K as V, layers with a
    ``layer_output_scale``, experts with an output scale."""
    if not family.layer_widths:
        return {}
    k_as_v = tuple(names.gguf_name("attn_v", i) not in tensors and names.gguf_name("attn_k", i) in tensors
                   for i in range(n_layer))
    return {"k_as_v_layers": k_as_v if any(k_as_v) else (),
            "layer_output_scale": names.gguf_name("layer_output_scale", 0) in tensors,
            "expert_scales": names.gguf_name("ffn_down_exps_scale", 0) in tensors,
            "fused_gate_up_exps": names.gguf_name("ffn_gate_up_exps", 0) in tensors}


def _n_ff(f: GGUFFile, family: Family, integer: Any, optional: Any) -> int:
    """``feed_forward_length``: required, except in a family whose every layer routes experts, where llama.cpp
    reads it as optional (the converter of qwen35moe writes only the experts' widths); then the experts' width."""
    key = Keys.LLM.FEED_FORWARD_LENGTH
    value = optional(key, None)
    if value is None and family.experts == "required":
        value = optional(Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, None)
    if value is None:
        f.require(key.format(arch=f.architecture))
    return integer(key, value)


def _experts(f: GGUFFile, family: Family, integer: Any, optional: Any) -> dict[str, int | None]:
    """The expert keys of a MoE family (a dense family's graph never reads them, nor does ggtorch)."""
    if family.experts == "none":
        return {}
    return {"n_expert": integer(Keys.LLM.EXPERT_COUNT, optional(Keys.LLM.EXPERT_COUNT, 0)),
            "n_expert_used": integer(Keys.LLM.EXPERT_USED_COUNT, optional(Keys.LLM.EXPERT_USED_COUNT, 0)),
            "n_ff_exp": _optional_int(f, Keys.LLM.EXPERT_FEED_FORWARD_LENGTH, optional),
            "n_ff_shexp": _optional_int(f, Keys.LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, optional)}


def _linear_attention(f: GGUFFile, family: Family, n_layer_all: int, n_layer: int, integer: Any,
                      optional: Any) -> dict[str, Any]:
    """A hybrid family's DeltaNet keys and layer pattern, as llama_model_qwen35::load_arch_hparams reads them:
    ``attention.recurrent_layers`` (a bool per block) if present, else every layer but each
    ``full_attention_interval``-th (default 4); the rope sections."""
    out: dict[str, Any] = {}
    if family.rope_sections:
        sections = f.metadata.get(Keys.Rope.DIMENSION_SECTIONS.format(arch=f.architecture))
        if sections is None:
            raise BadGGUF(f"{f.path}: required key '{Keys.Rope.DIMENSION_SECTIONS.format(arch=f.architecture)}' "
                          "is missing (re-convert the model with a current llama.cpp)")
        if not isinstance(sections, list) or not all(isinstance(x, int) and x >= 0 for x in sections):
            raise BadGGUF(f"{f.path}: '{Keys.Rope.DIMENSION_SECTIONS.format(arch=f.architecture)}' = {sections!r} "
                          "must be an array of non-negative integers")
        out["rope_sections"] = tuple((list(sections) + [0] * 4)[:4])
    if not family.linear_attention:
        return out
    pattern_key = RECURRENT_LAYERS.format(arch=f.architecture)
    if pattern_key in f.metadata:
        pattern = f.metadata[pattern_key]
        if not isinstance(pattern, list) or len(pattern) < n_layer:
            raise BadGGUF(f"{f.path}: '{pattern_key}' must be a bool per block ({n_layer_all}), got {pattern!r:.80}")
        recurrent = tuple(bool(x) for x in pattern[:n_layer])
    else:
        interval = integer(Keys.LLM.FULL_ATTENTION_INTERVAL, optional(Keys.LLM.FULL_ATTENTION_INTERVAL, 4))
        if interval < 1:
            raise BadGGUF(f"{f.path}: '{Keys.LLM.FULL_ATTENTION_INTERVAL.format(arch=f.architecture)}' = {interval} "
                          "must be at least 1")
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_layer))
    out["recurrent_layers"] = recurrent
    if any(recurrent):
        for field_name, template in (("ssm_conv_kernel", Keys.SSM.CONV_KERNEL), ("ssm_inner", Keys.SSM.INNER_SIZE),
                                     ("ssm_state", Keys.SSM.STATE_SIZE), ("ssm_v_heads", Keys.SSM.TIME_STEP_RANK),
                                     ("ssm_k_heads", Keys.SSM.GROUP_COUNT)):
            name = template.format(arch=f.architecture)
            if name not in f.metadata:
                raise BadGGUF(f"{f.path}: required key '{name}' is missing (a {f.architecture} model's linear "
                              "attention needs it)")
            out[field_name] = integer(template, _scalar(f, name, f.metadata[name]))
    return out


def _bias_names(kind: str, n_layer: int) -> list[str]:
    template = names.TENSOR_KINDS[names.bias_of(kind)][0]
    return [template.format(bid=bid) for bid in range(n_layer)] if "{bid}" in template else [template]


def _sliding_window(f: GGUFFile, family: Family, n_layer: int, optional: Any) -> tuple[int, tuple[bool, ...]]:
    """(window, per-layer flags) as llama.cpp's load_swa_pattern sets them for the family.

    ``sliding_window_pattern`` is either a per-layer bool array or a period n (layer i slides when
    i % n < n - 1); without it the family's period applies. gemma3 slides only when the file names
    a positive window; families without a period ignore any window key (llama.cpp's llama and phi3).
    """
    if not family.swa_period:
        return 0, ()
    pattern_key = Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch=f.architecture)
    if family.swa_pattern_array:  # gemma4: both keys required, the pattern a bool per layer
        f.require(Keys.Attention.SLIDING_WINDOW.format(arch=f.architecture))
        if not isinstance(f.require(pattern_key), list):
            raise BadGGUF(f"{f.path}: '{pattern_key}' must be a bool per layer, got {f.metadata[pattern_key]!r:.80}")
    window = optional(Keys.Attention.SLIDING_WINDOW, family.swa_window or 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise BadGGUF(f"{f.path}: '{Keys.Attention.SLIDING_WINDOW.format(arch=f.architecture)}' = {window!r} "
                      "must be a non-negative integer")
    if window == 0:
        return 0, ()
    pattern = f.metadata.get(pattern_key, family.swa_period)
    if isinstance(pattern, list):
        if len(pattern) < n_layer:
            raise BadGGUF(f"{f.path}: '{pattern_key}' has {len(pattern)} entries for {n_layer} layers")
        return window, tuple(bool(x) for x in pattern[:n_layer])
    if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 0:
        raise BadGGUF(f"{f.path}: '{pattern_key}' = {pattern!r} must be a non-negative integer or a bool array")
    return window, tuple(pattern == 0 or i % pattern < pattern - 1 for i in range(n_layer))


def _scalar(f: GGUFFile, key: str, value: Any) -> Any:
    """A per-layer array (allowed by GGUF for some keys) must be uniform: ggtorch's layers share one shape."""
    if isinstance(value, list):
        if not value or any(v != value[0] for v in value):
            raise Unsupported(f"{f.path}: '{key}' varies per layer ({value[:4]}...); ggtorch supports uniform layers")
        return value[0]
    return value
