"""The loader: every GGUF tensor lands once in the right module; bad files fail naming the culprit."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES

from ggtorch.errors import BadGGUF, Unsupported
from ggtorch.io.gguf import read_gguf
from ggtorch.lora import LoraConfig, attach_lora, merge_lora
from ggtorch.models import names
from ggtorch.models.config import ModelConfig
from ggtorch.models.families import FAMILIES
from ggtorch.models.loader import build_model, load_model_file
from ggtorch.models.model import Transformer
from ggtorch.quant import dequantize
from tests.llama_models import RandomLlamaShape, rewrite_gguf


def test_tensor_kinds_follow_gguf_py_names() -> None:
    T = MODEL_TENSOR
    gguf_py = {
        "token_embd": T.TOKEN_EMBD, "output_norm": T.OUTPUT_NORM, "output": T.OUTPUT, "attn_norm": T.ATTN_NORM,
        "attn_q": T.ATTN_Q, "attn_k": T.ATTN_K, "attn_v": T.ATTN_V, "attn_output": T.ATTN_OUT,
        "ffn_norm": T.FFN_NORM, "ffn_gate": T.FFN_GATE, "ffn_down": T.FFN_DOWN, "ffn_up": T.FFN_UP,
        "attn_qkv": T.ATTN_QKV, "attn_q_norm": T.ATTN_Q_NORM, "attn_k_norm": T.ATTN_K_NORM,
        "attn_post_norm": T.ATTN_POST_NORM, "ffn_post_norm": T.FFN_POST_NORM,
        "ffn_gate_inp": T.FFN_GATE_INP, "ffn_gate_exps": T.FFN_GATE_EXP, "ffn_up_exps": T.FFN_UP_EXP,
        "ffn_down_exps": T.FFN_DOWN_EXP, "ffn_gate_inp_shexp": T.FFN_GATE_INP_SHEXP,
        "ffn_gate_shexp": T.FFN_GATE_SHEXP, "ffn_up_shexp": T.FFN_UP_SHEXP, "ffn_down_shexp": T.FFN_DOWN_SHEXP,
        "attn_sinks": T.ATTN_SINKS, "attn_gate": T.ATTN_GATE, "ssm_beta": T.SSM_BETA, "ssm_alpha": T.SSM_ALPHA,
        "ssm_out": T.SSM_OUT, "ssm_norm": T.SSM_NORM, "ssm_conv1d": T.SSM_CONV1D,
        "per_layer_token_embd": T.PER_LAYER_TOKEN_EMBD, "per_layer_model_proj": T.PER_LAYER_MODEL_PROJ,
        "per_layer_proj_norm": T.PER_LAYER_PROJ_NORM, "per_layer_inp_gate": T.PER_LAYER_INP_GATE,
        "per_layer_proj": T.PER_LAYER_PROJ, "per_layer_post_norm": T.PER_LAYER_POST_NORM,
        "ffn_pre_norm_2": T.FFN_PRE_NORM_2, "ffn_post_norm_1": T.FFN_POST_NORM_1, "ffn_post_norm_2": T.FFN_POST_NORM_2,
        "ffn_gate_up_exps": T.FFN_GATE_UP_EXP, "layer_output_scale": T.LAYER_OUT_SCALE,
    }
    biases = {f"{kind}_bias": gguf_py[kind] for kind in
              ("output", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down",
               "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")}
    # a DeltaNet's dt bias has no weight beside it, and its decay rates no suffix at all (llama.cpp's SSM_A_NOSCAN)
    unsuffixed = {"ssm_dt": (T.SSM_DT, ".bias"), "ssm_a": (T.SSM_A, ""),
                  # gemma4's router input scale and per-expert scales sit beside their matrices as ".scale"
                  "ffn_gate_inp_scale": (T.FFN_GATE_INP, ".scale"), "ffn_down_exps_scale": (T.FFN_DOWN_EXP, ".scale")}
    assert set(names.TENSOR_KINDS) == set(gguf_py) | set(biases) | set(unsuffixed)
    for kind, (tensor, suffix) in unsuffixed.items():
        assert names.TENSOR_KINDS[kind][0] == TENSOR_NAMES[tensor] + suffix
    family_tensors = set().union(*(MODEL_TENSORS[getattr(MODEL_ARCH, arch.upper().replace("-", "_"))]
                                   for arch in FAMILIES))
    for kind, tensor in gguf_py.items():
        assert names.TENSOR_KINDS[kind][0] == TENSOR_NAMES[tensor] + ".weight"
        assert tensor in family_tensors
    for kind, tensor in biases.items():
        assert names.TENSOR_KINDS[kind][0] == TENSOR_NAMES[tensor] + ".bias"


def test_every_model_weight_has_one_gguf_name() -> None:
    model = Transformer(ModelConfig(n_vocab=10, n_embd=8, n_layer=3, n_head=2, n_head_kv=1, n_ff=16, n_ctx_train=8))
    paths = [n.removesuffix(".weight") for n, _ in model.named_parameters()]
    gguf = [names.module_to_gguf(p) for p in paths]
    assert len(set(gguf)) == len(paths) == 2 + 3 * 9 + 1
    assert [names.gguf_to_module(g) for g in gguf] == paths
    assert names.parse_gguf_name("blk.12.ffn_up.weight") == ("ffn_up", 12)
    assert names.parse_gguf_name("rope_freqs.weight") is None


def test_stories260k_every_tensor_loaded_once(stories260k: Path) -> None:
    loaded = load_model_file(stories260k)
    model, f = loaded.model, loaded.gguf
    assert loaded.config.tied_output and model.output.weight is model.tok_embd.weight
    params = dict(model.named_parameters())  # shared parameters appear once
    assert len(params) == len(f.tensors)
    for name, info in f.tensors.items():
        expected = dequantize(info.raw(), info.ggml_type, info.shape)
        got = params[names.gguf_to_module(name) + ".weight"]
        assert torch.equal(got, expected), name
        assert not got.requires_grad  # a loaded base model is frozen; trainers opt in explicitly


def test_untied_output_is_its_own_weight(random_llama: Callable[..., Path]) -> None:
    loaded = load_model_file(random_llama("F32"))
    assert not loaded.config.tied_output
    assert loaded.model.output.weight.data_ptr() != loaded.model.tok_embd.weight.data_ptr()
    assert loaded.config.n_head_kv < loaded.config.n_head  # the fixture exercises GQA


def test_f32_matrices_are_views_of_the_file_mapping_and_merges_leave_them_alone(random_llama: Callable[..., Path]
                                                                                  ) -> None:
    """An F32 file costs its size once in RSS: the weights are the mapping's pages, not a copy of them.
    Merging an adapter into one model must not show up in another model built from the same file."""
    f = read_gguf(random_llama("F32"))
    config = ModelConfig.from_gguf(f)
    a, b = build_model(f, config), build_model(f, config)
    info = f.tensors["blk.0.attn_q.weight"]
    mapped = info.raw()
    start, end = mapped.data_ptr(), mapped.data_ptr() + mapped.numel()
    weight = a.layers[0].attn.q.weight
    assert start <= weight.data_ptr() < end  # a view, not a copy
    assert weight.data_ptr() == b.layers[0].attn.q.weight.data_ptr()  # both models read the same pages
    before = b.layers[0].attn.q.weight.clone()

    attach_lora(a, LoraConfig(rank=2), seed=3)
    with torch.no_grad():
        for p in a.parameters():
            if p.requires_grad:
                p.normal_()
    merge_lora(a)
    assert not torch.equal(a.layers[0].attn.q.base.weight, before)  # the merge did change a
    assert torch.equal(b.layers[0].attn.q.weight, before)  # but not b, nor the mapping
    assert torch.equal(dequantize(info.raw(), info.ggml_type, info.shape), before)


def test_bf16_weights(stories260k: Path) -> None:
    f32, bf16 = load_model_file(stories260k), load_model_file(stories260k, dtype=torch.bfloat16)
    assert {p.dtype for p in bf16.model.parameters()} == {torch.bfloat16}
    tokens = torch.tensor([[1, 403, 407, 261, 378]])
    with torch.no_grad():
        a, b = f32.model(tokens), bf16.model(tokens)
    assert b.dtype == torch.float32
    assert (a - b).abs().max() < 0.5 and (a.argmax(-1) == b.argmax(-1)).all()


def test_keep_quantized_matches_dequantized(random_llama: Callable[..., Path]) -> None:
    from ggtorch.quant.modules import QuantEmbedding, QuantLinear

    path = random_llama("Q4_K_M")
    quant, dense = load_model_file(path, keep_quantized=True), load_model_file(path)
    m = quant.model
    assert isinstance(m.layers[0].attn.q, QuantLinear) and isinstance(m.tok_embd, QuantEmbedding)
    assert m.layers[0].attn_norm.weight.dtype == torch.float32
    tokens = torch.tensor([[1, 15043, 29892, 3186, 29991, 306]])
    with torch.no_grad():
        torch.testing.assert_close(m(tokens), dense.model(tokens), rtol=0, atol=1e-4)


def test_tied_quantized_output_shares_blocks_after_a_move(random_llama: Callable[..., Path]) -> None:
    path = random_llama("Q4_0", RandomLlamaShape(tied_output=True))
    model = load_model_file(path, keep_quantized=True).model
    assert model.config.tied_output and model.output.raw.data_ptr() == model.tok_embd.raw.data_ptr()
    model._apply(lambda t: t.clone())  # what .to(other_device) does to every tensor
    assert model.output.raw.data_ptr() == model.tok_embd.raw.data_ptr()


@pytest.fixture(scope="module")
def broken(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    root = tmp_path_factory.mktemp("broken")

    def make(label: str, **changes) -> Path:
        return rewrite_gguf(stories260k, root / f"{label}.gguf", **changes)

    return make


def test_missing_tensor_is_named(broken: Callable[..., Path]) -> None:
    with pytest.raises(BadGGUF, match=r"'blk\.2\.ffn_up\.weight' is missing"):
        load_model_file(broken("missing", drop_tensors=("blk.2.ffn_up.weight",)))


def test_unexpected_tensor_is_named(broken: Callable[..., Path]) -> None:
    with pytest.raises(Unsupported, match=r"'blk\.0\.attn_q_norm\.weight'"):  # a qwen3/gemma3 tensor
        load_model_file(broken("extra", add_tensors={"blk.0.attn_q_norm.weight": np.ones(8, np.float32)}))
    with pytest.raises(Unsupported, match=r"'output\.bias' is not part of a llama model"):  # qwen2's only
        load_model_file(broken("bias", add_tensors={"output.bias": np.ones(512, np.float32)}))


def test_wrong_shape_is_named(broken: Callable[..., Path]) -> None:
    path = broken("shape", add_tensors={"blk.1.attn_k.weight": np.zeros((64, 64), np.float32)})
    with pytest.raises(BadGGUF, match=r"'blk\.1\.attn_k\.weight' has shape \(64, 64\), expected \(32, 64\)"):
        load_model_file(path)


@pytest.mark.parametrize("arch", ["gpt2", "qwen3next", "lfm2", "lfm2moe", "granitehybrid"])
def test_other_architecture_is_unsupported(broken: Callable[..., Path], arch: str) -> None:
    """Refused by name, the 2026 hybrids ggtorch does not run yet among them."""
    with pytest.raises(Unsupported, match=f"unsupported architecture '{arch}'; ggtorch supports .*qwen35"):
        load_model_file(broken(arch, arch=arch))


@pytest.mark.parametrize("key", ["llama.embedding_length", "llama.block_count", "llama.attention.head_count",
                                 "llama.feed_forward_length", "llama.attention.layer_norm_rms_epsilon"])
def test_missing_required_key_is_named(broken: Callable[..., Path], key: str) -> None:
    with pytest.raises(BadGGUF, match=f"'{key}' is missing"):
        load_model_file(broken(key, drop_keys=(key,)))


def test_config_defaults_and_scaling(broken: Callable[..., Path], stories260k: Path) -> None:
    base = ModelConfig.from_gguf(read_gguf(stories260k))
    assert (base.n_vocab, base.n_embd, base.n_layer, base.n_head, base.n_head_kv, base.n_ff) == (512, 64, 5, 8, 4, 172)
    assert base.head_dim == base.n_rot == 8 and base.n_ctx_train == 512 and base.rope_freq_scale == 1.0
    no_vocab_key = broken("novocab", drop_keys=("llama.vocab_size", "llama.attention.head_count_kv"))
    cfg = ModelConfig.from_gguf(read_gguf(no_vocab_key))
    assert cfg.n_vocab == 512 and cfg.n_head_kv == cfg.n_head  # len(tokens); MHA when head_count_kv is absent
    scaled = ModelConfig.from_gguf(read_gguf(broken("scaled", set_keys={"llama.rope.scaling.factor": 4.0})))
    assert scaled.rope_freq_scale == 0.25
    old = ModelConfig.from_gguf(read_gguf(broken("oldscale", set_keys={"llama.rope.scale_linear": 2.0})))
    assert old.rope_freq_scale == 0.5
    unscaled = ModelConfig.from_gguf(read_gguf(broken("none", set_keys={"llama.rope.scaling.type": "none",
                                                                          "llama.rope.scaling.factor": 4.0})))
    assert unscaled.rope_freq_scale == 1.0  # as llama.cpp: type none never scales
    with pytest.raises(Unsupported, match="'longrope' is not supported"):
        ModelConfig.from_gguf(read_gguf(broken("longrope", set_keys={"llama.rope.scaling.type": "longrope"})))


def test_inconsistent_hyperparameters_are_rejected(broken: Callable[..., Path]) -> None:
    with pytest.raises(BadGGUF, match="divisible"):
        ModelConfig.from_gguf(read_gguf(broken("heads", set_keys={"llama.attention.head_count": 7})))
    with pytest.raises(BadGGUF, match="'llama.block_count' is 0; a model has at least 1"):
        ModelConfig.from_gguf(read_gguf(broken("zero", set_keys={"llama.block_count": 0})))


def test_loading_runs_no_random_init(stories260k: Path) -> None:
    """The loader assigns every weight, so it must not initialize any: the first normal_ on a
    meta tensor imports torch._dynamo, 1.3 s of a 0.06 s stories260K load. In a fresh process,
    since the suite may have imported it already."""
    import subprocess
    import sys

    code = (f"import sys; from ggtorch.models.loader import load_model_file; load_model_file({str(stories260k)!r}); "
            "print('torch._dynamo' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
