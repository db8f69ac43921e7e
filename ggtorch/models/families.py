r"""What each GGUF architecture changes in the one transformer of models/model.py: a row per family.

Each row is read from llama.cpp's own graph and loader for that architecture
(``src/models/<family>.cpp``, ``src/llama-model.cpp``): which rope layout it uses, which optional
parts its blocks have, and the defaults llama.cpp takes when a key is missing. ModelConfig.from_gguf
turns a row plus the file's metadata and tensors into the numbers the model runs with.

| family   | rope | qk norm | post norm | embd x  | FFN     | experts        | caps attn/final | sliding window       |
|----------|------|---------|-----------|---------|---------|----------------|-----------------|----------------------|
| llama    | norm | -       | -         | -       | SwiGLU  | if keyed, norm | -               | - (key ignored)      |
| qwen2    | neox | -       | -         | -       | SwiGLU  | -              | -               | -                    |
| qwen2moe | neox | -       | -         | -       | SwiGLU  | yes, + shared  | -               | -                    |
| qwen3    | neox | yes     | -         | -       | SwiGLU  | -              | -               | -                    |
| qwen3moe | neox | yes     | -         | -       | SwiGLU  | yes, norm      | -               | -                    |
| gemma2   | neox | -       | yes       | √n_embd | GeGLU   | -              | 50 / 30         | 1 in 2 global, 4096  |
| gemma3   | neox | yes     | yes       | √n_embd | GeGLU   | -              | - / if keyed    | 1 in 6 global, base  |
| phi3     | neox | -       | -         | -       | SwiGLU* | -              | -               | - (key ignored)      |
| mistral3 | norm | -       | -         | -       | SwiGLU  | -              | -               | -                    |
| smollm3  | norm | -       | -         | -       | SwiGLU  | -              | -               | -                    |
| gpt-oss  | neox | -       | -         | -       | SwiGLU† | yes, softmax_w | -               | 1 in 2 global        |
| granite  | norm | -       | -         | × key   | SwiGLU  | -              | -               | -                    |
| qwen35   | neox | yes     | -         | -       | SwiGLU  | -              | -               | -                    |
| qwen35moe| neox | yes     | -         | -       | SwiGLU  | yes, norm, + shared | -          | -                    |
| gemma4   | neox | yes     | yes       | √n_embd | GeGLU   | if keyed, + dense | - / if keyed  | per layer (array)    |

\* over one fused ``ffn_up``. Defaults apply when the file has no key for them. gemma3's sliding layers have
their own rope base. mistral3 (Ministral 3, Mistral Small 3.x as converted since late 2025) is llama's block
whose loader also reads YaRN's ``yarn_beta_fast``/``_slow`` and ``yarn_log_multiplier`` and Llama 4's
attention temperature (``attention.temperature_scale``). smollm3 (SmolLM3) is llama's block without rope in
every fourth layer (llama.cpp's ``n_no_rope_layer_step``, fixed at 4).

† gpt-oss (OpenAI's gpt-oss-20b/120b): OpenAI's clamped SwiGLU in every expert, biases on every matrix
(experts and router included), a learned sink logit per attention head, YaRN, and the norm before the FFN
stored as ``post_attention_norm``. Its sliding layers use the global rope. granite (IBM Granite 3.x) is llama's
block scaled by four keys: ``embedding_scale`` (× key above), ``residual_scale`` on the attention and FFN
outputs before each residual add, ``attention.scale`` as the q·k scale, and ``logit_scale`` dividing the logits.

qwen35 (Qwen3.5 and 3.6) is a hybrid: three layers of four are Gated DeltaNet (a linear attention whose state runs
over the tokens, ``models/delta_net.py``), the fourth full attention with a sigmoid gate on its output; rope turns
the first quarter of each head (``rope.dimension_count``) in ggml's multi-section layout, and the norm before the FFN
is stored as ``post_attention_norm``. Files may carry next-token-prediction (MTP) blocks after the trunk
(``nextn_predict_layers``): llama.cpp's main graph never runs them, nor does ggtorch, and they are kept as they are.
qwen35moe (Qwen3.5/3.6-35B-A3B and larger) is qwen35 with routed experts and a shared expert gated as qwen2moe's.

gemma4 (Gemma 4: E2B, E4B, 31B, 26B-A4B) is gemma3's block with per-layer shapes: sliding and global layers have
their own head sizes (``attention.key_length_swa`` / ``key_length``), rope widths and KV head counts
(``head_count_kv`` may be an array), and the FFN width may vary per layer (``feed_forward_length`` as an array).
Values get an RMS norm without a gain, q·k is scaled by 1 (the q/k norms set the scale), and global layers turn
their whole head with ``rope_freqs`` as divisors (the converter's "proportional" rope: divisors of 1e30 stop the
pairs past the rotated share). The last ``attention.shared_kv_layers`` layers compute no K/V of their own: each
reads the last earlier layer of its kind that does (llama.cpp: n_kv - 2 for sliding, n_kv - 1 for global layers);
a global layer without ``attn_v`` uses its K projection as V. E2B/E4B add per-layer embeddings
(``embedding_length_per_layer_input``): a second token table, mixed with a projection of the scaled embeddings,
gives each block an input it gates into its output (``models/model.py``'s PerLayerInput). Blocks may end with a
``layer_output_scale``. The MoE variant (26B-A4B) keeps the dense MLP and adds routed experts beside it, each
with its own norms; its router reads the un-normed residual stream, RMS-normed and scaled by 1/√n_embd and
``ffn_gate_inp.scale``, and each expert's output is scaled by ``ffn_down_exps.scale``.

Experts (llama.cpp's ``build_moe_ffn``): each token's FFN is the sum of its top ``expert_used_count``
experts of ``expert_count``, weighted by their softmax probabilities, renormalized to sum 1 where the row
says "norm" (llama.cpp hard-codes this per family; no key changes it); "softmax_w" picks the top experts by
their router logits and weights them by a softmax over those logits alone.
qwen2moe adds a dense shared expert scaled by sigmoid(``ffn_gate_inp_shexp`` · x).

Every family takes q, k and v as separate tensors or as one fused ``attn_qkv`` (llama.cpp's
``create_tensor_qkv``), each with optional biases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class Family:
    """One architecture's switches and llama.cpp's defaults for it."""

    rope: Literal["norm", "neox"]
    """ggml's rope layout: ``norm`` rotates adjacent pairs, ``neox`` the two halves of each head."""
    qk_norm: bool = False
    """Per-head RMS norms ``attn_q_norm``/``attn_k_norm`` on q and k before rope."""
    post_norms: bool = False
    """RMS norms on the attention and FFN outputs before each residual add (``post_attention_norm``,
    ``post_ffw_norm``)."""
    embedding_scale: bool = False
    """Token embeddings multiplied by sqrt(n_embd)."""
    activation: Literal["silu", "gelu", "swiglu_oai"] = "silu"
    """The gated FFN's activation: SwiGLU, GeGLU (GELU's tanh approximation) or OpenAI's SwiGLU
    (ggml_swiglu_oai: the gate clamped to 7 above, up to [-7, 7], gate·sigmoid(1.702·gate)·(up + 1))."""
    fused_up: bool = False
    """One ``ffn_up`` of 2·n_ff rows: the gate is its first half, the up projection its second."""
    attn_softcap: float = 0.0
    """Default of ``attn_logit_softcapping`` (0: no attention soft-capping)."""
    final_softcap: float = 0.0
    """Default of ``final_logit_softcapping`` (0: none)."""
    swa_period: int = 0
    """Default ``sliding_window_pattern``: every period-th layer is global, the others slide (0: no
    sliding-window layers)."""
    swa_window: int = 0
    """Default ``sliding_window`` when the file has none (0: no sliding window without the key)."""
    swa_rope_base: Literal["global", "default"] | None = None
    """Rope base of sliding layers when ``rope.freq_base_swa`` is missing: the global one (gemma2) or
    llama.cpp's 10000 (gemma3)."""
    query_prescale: bool = False
    """Queries multiplied by the attention scale after rope, then a product with scale 1, as llama.cpp
    computes gemma and phi3 (the others scale the product)."""
    tied_always: bool = False
    """The output projection is always token_embd, even if the file had ``output.weight`` (gemma2)."""
    rope_factors: Literal["freqs", "long_short"] = "freqs"
    """Per-pair rope divisors: ``rope_freqs`` (Llama 3.1) or LongRoPE's ``rope_factors_long/short``."""
    layer_biases: tuple[str, ...] = ("attn_q", "attn_k", "attn_v", "attn_qkv")
    """Per-layer matrices whose ``.bias`` the loader accepts (llama.cpp's optional biases)."""
    output_bias: bool = False
    """An optional ``output.bias`` (qwen2)."""
    experts: Literal["none", "optional", "required"] = "none"
    """Routed experts: never, when the file has ``expert_count`` > 0 (llama, Mixtral-style), or always."""
    normalize_expert_weights: bool = True
    """The top-k softmax weights are divided by their sum (``norm_w`` of build_moe_ffn)."""
    expert_gating: Literal["softmax", "softmax_weight"] = "softmax"
    """How experts are chosen and weighted: top k of the softmax over all router logits, or top k of the
    logits with a softmax over those k (LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX_WEIGHT, gpt-oss)."""
    attn_sinks: bool = False
    """A learned logit per query head (``attn_sinks``) joins every softmax's denominator, so a head may
    attend to nothing (gpt-oss)."""
    ffn_norm: Literal["ffn_norm", "attn_post_norm"] = "ffn_norm"
    """The tensor kind of the norm before the FFN: gpt-oss's converter stores it as ``post_attention_norm``
    (transformers' name for it in every family), the others as ``ffn_norm``."""
    yarn_keys: bool = False
    """The loader reads YaRN's ``rope.scaling.yarn_beta_fast``/``_slow`` and ``yarn_log_multiplier``
    (the other families keep llama.cpp's defaults 32, 1 and 0 whatever the file says)."""
    no_rope_step: int = 0
    """Layers il with (il + 1) % no_rope_step == 0 apply no rope at all (SmolLM3's NoPE layers; 0: none)."""
    attn_temperature: bool = False
    """Llama 4's attention temperature: with ``attention.temperature_scale`` = beta, queries at position p
    are multiplied by 1 + beta ln(floor(p / n_ctx_orig) + 1) after rope."""
    shared_expert: bool = False
    """A dense SwiGLU expert beside the routed ones, scaled by a sigmoid gate (qwen2moe)."""
    multipliers: bool = False
    """Granite's scales: the loader reads ``embedding_scale``, ``residual_scale``, ``attention.scale`` and (required)
    ``logit_scale``."""
    large_layer_counts: tuple[int, ...] = ()
    """Layer counts of gemma's 27B models, whose attention scale llama.cpp takes as 1/sqrt(n_embd/n_head)
    instead of 1/sqrt(head_dim) (gemma_pytorch's ``query_pre_attn_scalar``)."""
    rope_whole_head: bool = False
    """llama.cpp's loader requires ``rope.dimension_count`` equal to the head size (it rotates every dim)."""
    expert_width: Literal["n_ff", "n_ff_per_used"] = "n_ff_per_used"
    """Default of ``expert_feed_forward_length`` when the file has none: n_ff (llama's Mixtral-style experts) or
    n_ff / expert_used_count (the qwen MoE families)."""
    vocab_size_key: bool = False
    """The vocabulary size may come from ``vocab_size`` (llama's loader reads it); else from the token list."""
    linear_attention: bool = False
    """Gated DeltaNet layers (``models/delta_net.py``) wherever the file marks a layer recurrent
    (``attention.recurrent_layers``, else every layer but each ``full_attention_interval``-th, 4 by default); full
    attention in the others (qwen35)."""
    attn_output_gate: bool = False
    """Each query head carries a gate of its width (``attn_q`` is twice as wide, query and gate interleaved per
    head): the attention's output is multiplied by sigmoid(gate) before ``attn_output`` (qwen35)."""
    swa_pattern_array: bool = False
    """``attention.sliding_window_pattern`` is a required bool per layer and ``attention.sliding_window`` is
    required (gemma4's loader reads both without defaults)."""
    kq_scale: float | None = None
    """A fixed q·k scale in place of 1/sqrt(head size) (gemma4: 1)."""
    v_norm: bool = False
    """Values get an RMS norm without a gain before attention (gemma4)."""
    swa_rope_factors: bool = True
    """Sliding layers divide their rope frequencies by ``rope_freqs`` too (gemma4's divisors are the global layers'
    alone)."""
    layer_widths: bool = False
    """Per-layer shapes: ``head_count_kv`` and ``feed_forward_length`` may be arrays, sliding layers have their own
    head size (``attention.key_length_swa``) and rope width (``rope.dimension_count_swa``) (gemma4)."""
    shared_kv: bool = False
    """The last ``attention.shared_kv_layers`` layers reuse the K/V of an earlier layer of their kind (gemma4)."""
    per_layer_inputs: bool = False
    """Per-layer embeddings when ``embedding_length_per_layer_input`` > 0 (gemma4 E2B/E4B)."""
    dense_beside_experts: bool = False
    """A MoE layer keeps its dense MLP and adds the routed experts' output, each branch with its own norms (gemma4)."""
    rope_sections: bool = False
    """Multi-section rope (ggml's IMROPE): ``rope.dimension_sections`` assigns each rotated pair a position kind;
    text tokens sit at the same position in the first three and at 0 in the fourth, whose pairs do not turn."""


FAMILIES: dict[str, Family] = {
    "llama": Family(rope="norm", layer_biases=("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output",
                                               "ffn_gate", "ffn_up", "ffn_down"), experts="optional",
                    rope_whole_head=True, expert_width="n_ff", vocab_size_key=True),
    "qwen2": Family(rope="neox", output_bias=True, rope_whole_head=True),
    "qwen2moe": Family(rope="neox", experts="required", normalize_expert_weights=False, shared_expert=True),
    "qwen3": Family(rope="neox", qk_norm=True, rope_whole_head=True),
    "qwen3moe": Family(rope="neox", qk_norm=True, experts="required"),
    "gemma2": Family(rope="neox", post_norms=True, embedding_scale=True, activation="gelu", attn_softcap=50.0,
                     final_softcap=30.0, swa_period=2, swa_window=4096, swa_rope_base="global",
                     query_prescale=True, tied_always=True, large_layer_counts=(46,)),
    "gemma3": Family(rope="neox", qk_norm=True, post_norms=True, embedding_scale=True, activation="gelu",
                     swa_period=6, swa_rope_base="default", query_prescale=True, large_layer_counts=(62,)),
    "phi3": Family(rope="neox", fused_up=True, query_prescale=True, rope_factors="long_short"),
    "mistral3": Family(rope="norm", layer_biases=("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output",
                                                  "ffn_gate", "ffn_up", "ffn_down"), yarn_keys=True,
                       attn_temperature=True, rope_whole_head=True),
    "smollm3": Family(rope="norm", no_rope_step=4, rope_whole_head=True),
    "granite": Family(rope="norm", layer_biases=("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output",
                                                 "ffn_gate", "ffn_up", "ffn_down"), multipliers=True,
                      rope_whole_head=True),
    "gpt-oss": Family(rope="neox", activation="swiglu_oai", swa_period=2, swa_rope_base="global", experts="required",
                      layer_biases=("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate_inp",
                                    "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"),
                      normalize_expert_weights=False, expert_gating="softmax_weight", attn_sinks=True,
                      ffn_norm="attn_post_norm", rope_whole_head=True),
    "qwen35": Family(rope="neox", qk_norm=True, ffn_norm="attn_post_norm", linear_attention=True,
                     attn_output_gate=True, rope_sections=True),
    "qwen35moe": Family(rope="neox", qk_norm=True, ffn_norm="attn_post_norm", linear_attention=True,
                        attn_output_gate=True, rope_sections=True, experts="required", shared_expert=True),
    "gemma4": Family(rope="neox", qk_norm=True, post_norms=True, embedding_scale=True, activation="gelu",
                     swa_period=1, swa_pattern_array=True, swa_rope_base="default", kq_scale=1.0, v_norm=True,
                     swa_rope_factors=False, layer_widths=True, shared_kv=True, per_layer_inputs=True,
                     experts="optional", dense_beside_experts=True, expert_width="n_ff"),
}
"""``general.architecture`` -> its row. Architectures not listed are refused by name."""
