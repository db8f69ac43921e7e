"""LoRA wrappers on real GGUF llamas: quantized path == dequantized path, fresh adapters are
no-ops, merge/unmerge, what requires grad, the tied-output policy and the old finetune's init."""

from __future__ import annotations

import copy
import logging
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from torch import nn

from ggtorch.errors import BadFlag, Unsupported
from ggtorch.lora import (
    LoraConfig,
    LoRAEmbedding,
    LoRALinear,
    LoRANorm,
    attach_lora,
    count_trainable_parameters,
    load_lora_tensors,
    lora_state_dict,
    lora_tensors_by_gguf_name,
    merge_lora,
    trainable_parameters,
    unmerge_lora,
)
from ggtorch.models.loader import load_model_file
from ggtorch.models.model import RMSNorm, shared_input
from ggtorch.quant.modules import QuantEmbedding, QuantLinear
from ggtorch.rng import MT19937, libstdcpp_normal
from tests.llama_models import RandomLlamaShape

SHAPE = RandomLlamaShape()  # the fixture's default (n_embd 256, n_ff 768, 2 layers): files shared with other tests
# A representative set of llama.cpp mixes (legacy, K-quant with a Q6_K output, i-quant); every
# single ggml type is compared on small matrices in tests/quant/test_autograd.py.
QUANT_FTYPES = ["Q4_0", "Q4_K_M", "IQ4_XS"]


def _randomize_b(model: nn.Module, seed: int = 1) -> None:
    """Give every B (and the zero half of token_embd's pair) values, so all grads are non-zero."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p, _ in trainable_parameters(model):
            if not p.any():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


@pytest.mark.parametrize("ftype", QUANT_FTYPES)
def test_quantized_path_equals_dequantized_model(ftype: str, random_llama) -> None:
    path = random_llama(ftype, SHAPE)
    quant = load_model_file(path, keep_quantized=True).model
    ref = load_model_file(path, keep_quantized=False, dtype=torch.float32).model
    assert isinstance(quant.layers[0].attn.q, QuantLinear) and isinstance(quant.tok_embd, QuantEmbedding)
    config = LoraConfig(rank=3, alpha=5.0, ranks={"attn_norm": 2, "output_norm": 1})
    for m in (quant, ref):
        attach_lora(m, config, seed=7)
        _randomize_b(m)
    tokens = torch.randint(0, 32000, (2, 9), generator=torch.Generator().manual_seed(0))
    loss_q, loss_r = _loss(quant, tokens), _loss(ref, tokens)
    loss_q.backward()
    loss_r.backward()
    torch.testing.assert_close(loss_q, loss_r, rtol=1e-5, atol=1e-5)
    grads_q = {n: p.grad for n, p, _ in trainable_parameters(quant)}
    grads_r = {n: p.grad for n, p, _ in trainable_parameters(ref)}
    assert grads_q.keys() == grads_r.keys() and len(grads_q) == 2 * (3 + 2 * (7 + 1))
    for name in grads_q:
        assert grads_q[name].abs().sum() > 0, name
        torch.testing.assert_close(grads_q[name], grads_r[name], rtol=1e-3, atol=1e-6, msg=name)


@pytest.fixture(scope="module")
def q4_loaded(random_llama) -> nn.Module:
    return load_model_file(random_llama("Q4_0", SHAPE), keep_quantized=True).model


@pytest.fixture
def q4_model(q4_loaded) -> nn.Module:
    """A fresh copy of the Q4_0 llama (its own raw buffers) per test: loading once is cheaper."""
    return copy.deepcopy(q4_loaded)


def test_fresh_adapter_changes_nothing_and_only_lora_trains(q4_model) -> None:
    model = q4_model
    tokens = torch.randint(0, 32000, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(tokens)
    attach_lora(model, LoraConfig(ranks={"ffn_norm": 1}), seed=123)
    with torch.no_grad():
        after = model(tokens)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _, _ in trainable_parameters(model)}
    assert all(n.endswith((".lora_a", ".lora_b")) for n in trainable)
    assert not any(b.requires_grad for b in model.buffers())
    n_embd, n_ff, n_kv, r = 256, 768, 128, 4
    per_layer = r * n_embd * 2 + r * n_embd + n_kv * r + r * n_embd + n_kv * r  # q, k, v
    per_layer += r * n_embd * 2  # o
    per_layer += 2 * (r * n_embd + n_ff * r) + (r * n_ff + n_embd * r)  # gate, up, down
    per_layer += 1 * n_embd + 1  # ffn_norm rank 1
    expected = (32000 * r + n_embd * r) + (r * n_embd + 32000 * r) + 2 * per_layer  # + token_embd, output
    assert count_trainable_parameters(model) == expected


def test_trainable_parameters_order_and_ndims(q4_model) -> None:
    model = q4_model
    attach_lora(model, LoraConfig(ranks={"attn_norm": 1, "output_norm": 2}), seed=0)
    listed = [(n, d) for n, _, d in trainable_parameters(model)]
    kinds = [n.rsplit(".", 1)[0] for n, _ in listed[::2]]
    assert kinds[:11] == ["tok_embd", "output_norm", "output", "layers.0.attn_norm", "layers.0.attn.q",
                          "layers.0.attn.k", "layers.0.attn.v", "layers.0.attn.o", "layers.0.ffn.gate",
                          "layers.0.ffn.down", "layers.0.ffn.up"]
    ndims = dict(listed)
    assert ndims["output_norm.lora_b"] == 1 and ndims["layers.0.attn_norm.lora_b"] == 1
    assert all(d == 2 for n, d in listed if "norm" not in n)
    assert ndims["output_norm.lora_a"] == 2


def test_shapes_follow_gguf_lora_layout(q4_model) -> None:
    model = q4_model
    attach_lora(model, LoraConfig(rank=4, ranks={"attn_k": 2, "ffn_up": 0}), seed=0)
    t = lora_tensors_by_gguf_name(model)
    assert t["token_embd.weight.lora_a"].shape == (32000, 4) and t["token_embd.weight.lora_b"].shape == (256, 4)
    assert t["output.weight.lora_a"].shape == (4, 256) and t["output.weight.lora_b"].shape == (32000, 4)
    assert t["blk.0.attn_k.weight.lora_a"].shape == (2, 256) and t["blk.0.attn_k.weight.lora_b"].shape == (128, 2)
    assert t["blk.0.ffn_down.weight.lora_a"].shape == (4, 768)
    assert "blk.0.ffn_up.weight.lora_a" not in t
    assert isinstance(model.layers[0].ffn.up, QuantLinear)


def test_merge_unmerge_idempotent(q4_model) -> None:
    model = q4_model
    attach_lora(model, LoraConfig(ranks={"attn_norm": 1}), seed=5)
    _randomize_b(model)
    tokens = torch.randint(0, 32000, (1, 10), generator=torch.Generator().manual_seed(4))
    q_raw = model.layers[0].attn.q.base.raw
    with torch.no_grad():
        y = model(tokens)
        merge_lora(model)
        merge_lora(model)
        assert isinstance(model.layers[0].attn.q.base, nn.Linear)  # merged into f32 weights
        y_merged = model(tokens)
        unmerge_lora(model)
        unmerge_lora(model)
        y_back = model(tokens)
    torch.testing.assert_close(y_merged, y, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(y_back, y, rtol=0, atol=0)  # the original blocks are back
    assert model.layers[0].attn.q.base.raw is q_raw


def test_merge_into_float_weights() -> None:
    torch.manual_seed(0)
    base = nn.Linear(16, 8, bias=False)
    w0 = base.weight.detach().clone()
    m = LoRALinear(base, rank=2, alpha=3.0)
    nn.init.normal_(m.lora_a)
    nn.init.normal_(m.lora_b)
    x = torch.randn(5, 16)
    y = m(x)
    torch.testing.assert_close(y, x @ (w0 + 1.5 * m.lora_b @ m.lora_a).T)
    m.merge()
    m.merge()
    torch.testing.assert_close(base.weight, w0 + 1.5 * m.lora_b.detach() @ m.lora_a.detach())
    torch.testing.assert_close(m(x), y)
    m.unmerge()
    m.unmerge()
    torch.testing.assert_close(base.weight, w0, rtol=0, atol=1e-6)


def test_embedding_and_norm_formulas() -> None:
    torch.manual_seed(0)
    emb = nn.Embedding(10, 6)
    m = LoRAEmbedding(emb, rank=3, alpha=6.0)
    nn.init.normal_(m.lora_a)
    nn.init.normal_(m.lora_b)
    ids = torch.tensor([[1, 4, 4, 9]])
    expected = emb.weight[ids] + 2.0 * torch.stack([m.lora_b @ m.lora_a[t] for t in ids[0]])[None]
    torch.testing.assert_close(m(ids), expected)

    norm = RMSNorm(6, 1e-5)
    nn.init.normal_(norm.weight)
    n = LoRANorm(norm, rank=2)
    nn.init.normal_(n.lora_a)
    nn.init.normal_(n.lora_b)
    x = torch.randn(2, 6)
    gain = norm.weight + (n.lora_b @ n.lora_a)[0]
    torch.testing.assert_close(n(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gain)


def test_unsupported_base_lists_the_supported_ones() -> None:
    with pytest.raises(Unsupported, match="Linear, QuantLinear"):
        LoRALinear(nn.Conv1d(2, 2, 1), rank=2)


def test_dropout_only_touches_the_lora_branch() -> None:
    torch.manual_seed(0)
    m = LoRALinear(nn.Linear(32, 8, bias=False), rank=2, dropout=0.5)
    nn.init.normal_(m.lora_a)
    x = torch.randn(4, 32)
    y_eval = m.eval()(x)
    m.train()
    torch.testing.assert_close(m(x), y_eval)  # B = 0: the dropped branch adds nothing
    nn.init.normal_(m.lora_b)
    y_eval = m.eval()(x)
    assert not torch.allclose(m.train()(x), y_eval)


def test_tied_model_skips_embedding_and_output(stories260k, caplog) -> None:
    model = load_model_file(stories260k).model
    with caplog.at_level(logging.INFO, logger="ggtorch.lora"):
        attach_lora(model, LoraConfig(), seed=1)
    assert "tied output" in caplog.text
    assert not isinstance(model.tok_embd, LoRAEmbedding) and not isinstance(model.output, LoRALinear)
    assert model.output.weight is model.tok_embd.weight
    assert "token_embd.weight.lora_a" not in lora_tensors_by_gguf_name(model)
    assert isinstance(model.layers[0].attn.q, LoRALinear)
    for kind in ("token_embd", "output"):
        with pytest.raises(Unsupported, match="ties its output"):
            attach_lora(load_model_file(stories260k).model, LoraConfig(ranks={kind: 4}), seed=1)


@pytest.mark.parametrize("ranks, message", [
    ({"attn_qkv": 8}, "--rank-qkv 8 sets the LoRA rank of attn_qkv, which this llama model does not have"),
    ({"ffn_gate_exps": 4, "ffn_down_exps": 4, "ffn_up_exps": 4, "ffn_gate_up_exps": 4},
     "--rank-exps 4 sets the LoRA rank of ffn_gate_exps, ffn_down_exps, ffn_up_exps, ffn_gate_up_exps, which"),
    ({"attn_gate": 2, "ssm_beta": 2, "ssm_alpha": 2, "ssm_out": 2}, "--rank-linear-attn 2 sets the LoRA rank of"),
    ({"per_layer_inp_gate": 2, "per_layer_proj": 2}, "--rank-per-layer 2 sets the LoRA rank of"),
])
def test_a_rank_for_tensors_the_model_lacks_is_refused(stories260k, ranks: dict, message: str) -> None:
    """A llama has no fused qkv, experts, DeltaNet or per-layer embeddings: a rank for them would adapt nothing and
    leave the tensors meant at the default rank. Refused before the model is touched, naming the ranks that apply."""
    model = load_model_file(stories260k).model
    trainable = [p.requires_grad for p in model.parameters()]
    with pytest.raises(BadFlag) as refused:
        attach_lora(model, LoraConfig(ranks=ranks))
    assert str(refused.value).startswith(message)
    assert "--rank-wq" in str(refused.value) and "--rank-qkv" not in str(refused.value).split("(")[-1]
    assert [p.requires_grad for p in model.parameters()] == trainable and not lora_state_dict(model)
    zero = {kind: 0 for kind in ranks}  # switching off what the model lacks asks for nothing
    attach_lora(model, LoraConfig(ranks=zero))


def test_lora_tensors_round_trip(q4_loaded) -> None:
    a = copy.deepcopy(q4_loaded)
    b = copy.deepcopy(q4_loaded)
    attach_lora(a, LoraConfig(), seed=1)
    attach_lora(b, LoraConfig(), seed=2)
    _randomize_b(a)
    load_lora_tensors(b, lora_tensors_by_gguf_name(a))
    for (na, ta), (nb, tb) in zip(lora_state_dict(a).items(), lora_state_dict(b).items(), strict=True):
        assert na == nb
        torch.testing.assert_close(ta, tb, rtol=0, atol=0)
    with pytest.raises(Exception, match="do not fit"):
        load_lora_tensors(b, {"blk.0.attn_q.weight.lora_a": torch.zeros(1)})


def test_config_from_finetune_flags() -> None:
    from ggtorch.training.config import FinetuneConfig

    c = FinetuneConfig(model_base="m.gguf", train_data="t.txt", lora_r=8, rank_wq=2, rank_att_norm=1)
    lc = LoraConfig.from_finetune(c)
    assert lc.rank_of("attn_q") == 2 and lc.rank_of("attn_k") == 8 and lc.rank_of("attn_norm") == 1
    assert lc.rank_of("ffn_norm") == 0 and lc.lora_alpha == 8.0
    meta = lc.metadata()
    assert meta["training.lora.rank.attn_q"] == 2 and meta["training.lora.rank.output_norm"] == 0
    assert len([k for k in meta if k.startswith("training.lora.rank.")]) == 12


@pytest.fixture(scope="module")
def gcc_normals(tmp_path_factory) -> np.ndarray:
    """200000 draws of std::normal_distribution<float> on std::mt19937(1234), built with g++."""
    if shutil.which("g++") is None:
        pytest.skip("g++ (libstdc++) is needed for the reference stream")
    d = tmp_path_factory.mktemp("normal")
    (d / "n.cpp").write_text(
        "#include <random>\n#include <cstdio>\n#include <cstring>\n"
        "int main() { std::mt19937 g(1234); std::normal_distribution<float> nd(0.0f, 1.0f);\n"
        "  for (int i = 0; i < 200000; i++) { float v = nd(g); unsigned u; std::memcpy(&u, &v, 4);"
        " std::printf(\"%u\\n\", u); } }\n")
    subprocess.run(["g++", "-O2", "-o", str(d / "n"), str(d / "n.cpp")], check=True)
    out = subprocess.run([str(d / "n")], check=True, capture_output=True, text=True).stdout
    return np.array(out.split(), dtype=np.uint64).astype(np.uint32).view(np.float32)


def test_normal_distribution_is_libstdcpp_bit_exact(gcc_normals) -> None:
    mine = libstdcpp_normal(MT19937(1234), gcc_normals.size)
    np.testing.assert_array_equal(mine.view(np.uint32), gcc_normals.view(np.uint32))


def test_init_follows_the_old_finetune(q4_model, gcc_normals) -> None:
    model = q4_model
    attach_lora(model, LoraConfig(rank=4), seed=1234)  # norms off: their draws are still consumed
    n_embd, r = 256, 4
    stream = np.clip(gcc_normals, -1, 1)

    def old_a(offset: int, n_in: int) -> np.ndarray:  # old layout ne=[r, n_in]: torch (n_in, r)
        scale = np.float32(1) / np.sqrt(np.float32(r + n_in), dtype=np.float32)
        return (stream[offset:offset + r * n_in] * scale).reshape(n_in, r)

    off_embd = 0
    off_output = r * n_embd + 1 * n_embd  # after token_embd_a and output_norm_a (rank 1)
    off_q = off_output + r * n_embd + 1 * n_embd  # after output_a and attn_norm_a
    np.testing.assert_array_equal(model.tok_embd.lora_b.detach().numpy(), old_a(off_embd, n_embd))
    np.testing.assert_array_equal(model.output.lora_a.detach().numpy(), old_a(off_output, n_embd).T)
    np.testing.assert_array_equal(model.layers[0].attn.q.lora_a.detach().numpy(), old_a(off_q, n_embd).T)
    assert not model.tok_embd.lora_a.any() and not model.layers[0].attn.q.lora_b.any()


def test_torch_init_is_seeded_and_same_distribution(q4_loaded) -> None:
    runs = []
    for _ in range(2):
        model = copy.deepcopy(q4_loaded)
        attach_lora(model, LoraConfig(init="torch"), seed=9)
        runs.append(model.layers[0].ffn.down.lora_a.detach().clone())
    torch.testing.assert_close(runs[0], runs[1], rtol=0, atol=0)
    assert runs[0].abs().max() <= 1 / np.sqrt(4 + 768) + 1e-7


def test_bf16_autocast_training_step(q4_model) -> None:
    """Under bf16 autocast the quantized model trains: loss near the f32 loss, f32 LoRA grads."""
    model = q4_model
    attach_lora(model, LoraConfig(), seed=3)
    _randomize_b(model)
    tokens = torch.randint(0, 32000, (1, 9), generator=torch.Generator().manual_seed(5))
    loss_f32 = _loss(model, tokens)
    loss_f32.backward()
    grads_f32 = {n: p.grad.clone() for n, p, _ in trainable_parameters(model)}
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss_bf16 = _loss(model, tokens)
    loss_bf16.backward()
    torch.testing.assert_close(loss_bf16.float(), loss_f32, rtol=2e-2, atol=0)
    for name, p, _ in trainable_parameters(model):
        assert p.grad.dtype == torch.float32, name
        cos = F.cosine_similarity(p.grad.flatten(), grads_f32[name].flatten(), dim=0)
        assert cos > 0.95, (name, float(cos))


def _lora_bases(n_out: int, n_in: int) -> dict[str, nn.Module]:
    """Frozen bases of one weight: ggtorch's oneDNN Linear, torch's nn.Linear, Q4_0 blocks (whole
    and in row chunks). Q4_0 by gguf-py's quantizer, which tests/export checks against llama.cpp."""
    from ggtorch.io.encode import quantize
    from ggtorch.ops.matmul import Linear

    w = torch.randn(n_out, n_in, generator=torch.Generator().manual_seed(2)) / n_in ** 0.5
    raw = torch.from_numpy(quantize(w, GGMLQuantizationType.Q4_0))
    chunked = QuantLinear(raw, GGMLQuantizationType.Q4_0, (n_out, n_in))
    chunked.chunk_bytes = n_in * 4 * 100  # 100 rows per dequantized chunk: several chunks each way
    bases: dict[str, nn.Module] = {
        "Linear": Linear(n_in, n_out, bias=False), "nn.Linear": nn.Linear(n_in, n_out, bias=False),
        "Q4_0": QuantLinear(raw, GGMLQuantizationType.Q4_0, (n_out, n_in)), "Q4_0 chunked": chunked}
    for base in bases.values():
        if not isinstance(base, QuantLinear):
            base.weight = nn.Parameter(chunked.dequantized_weight(), requires_grad=False)
    return bases


PRODUCT_SHAPE = (640, 576)
"""(out, in) of the one-node tests: above ggtorch.ops.matmul's size rule, so a Linear's products run on oneDNN."""


def _lora_product_module(base_kind: str, seed: int) -> tuple[LoRALinear, torch.Generator]:
    """A rank-4 LoRA (s = 2) with random A and B over a base of ``base_kind``, and the generator."""
    m = LoRALinear(_lora_bases(*PRODUCT_SHAPE)[base_kind], rank=4, alpha=8)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        m.lora_a.copy_(torch.randn(m.lora_a.shape, generator=gen) / PRODUCT_SHAPE[1] ** 0.5)
        m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=gen))
    return m, gen


def _rank_r_products(kernel: str, monkeypatch, cpu_policy) -> list[str]:
    """Route the one-node LoRA's rank-r products: ``lowrank`` through ggtorch.ops.lowrank's C loops (the
    calls are recorded in the returned list), ``torch`` through ggtorch.ops.matmul as sized, ``onednn``
    through oneDNN whatever the size (transposed operands too)."""
    from ggtorch.ops import lowrank, matmul

    calls: list[str] = []
    if kernel == "lowrank":
        if not lowrank.available():
            pytest.skip("no C compiler to build ggtorch/ops/lowrank.c")
        for name in ("project", "expand_", "reduce"):
            fn = getattr(lowrank, name)
            monkeypatch.setattr(lowrank, name, lambda *a, _fn=fn, _name=name, **k: calls.append(_name) or _fn(*a, **k))
        return calls
    cpu_policy(c_lowrank=False)
    if kernel == "onednn":
        if not matmul.onednn_available():
            pytest.skip("this torch build has no oneDNN")
        cpu_policy(onednn_f32=True)
        monkeypatch.setattr(matmul, "ONEDNN_MIN_MACS", 0)
        monkeypatch.setattr(matmul, "ONEDNN_MIN_DIM", 0)
    return calls


@pytest.mark.parametrize("base_kind", ["Linear", "nn.Linear", "Q4_0", "Q4_0 chunked"])
@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("rank_r_kernel", ["lowrank", "torch", "onednn"])
def test_lora_product_against_the_formula_in_float64(base_kind: str, x_grad: bool, rank_r_kernel: str,
                                                     monkeypatch, cpu_policy) -> None:
    """One-node LoRA (delta added into the base's product, input gradients summed in place) vs
    y = x W^T + s (x A^T) B^T differentiated by autograd in float64, on 3-D input with s = 2, with the
    rank-r products in each of their kernels (:func:`_rank_r_products`)."""
    calls = _rank_r_products(rank_r_kernel, monkeypatch, cpu_policy)
    m, gen = _lora_product_module(base_kind, seed=4)
    base, (n_out, n_in) = m.base, PRODUCT_SHAPE
    x = torch.randn(3, 50, n_in, generator=gen).requires_grad_(x_grad)
    grad_y = torch.randn(3, 50, n_out, generator=gen)
    y = m(x)
    assert type(y.grad_fn).__name__ == "_LoRAProductsBackward"
    y.backward(grad_y)
    if rank_r_kernel == "lowrank":  # forward: project, expand; backward: project, [expand], reduce twice
        assert sorted(calls) == sorted(["project", "expand_", "project", "reduce", "reduce"]
                                       + ["expand_"] * x_grad), calls

    w = (base.dequantized_weight() if isinstance(base, QuantLinear) else base.weight).double()
    a, b = (p.detach().double().requires_grad_() for p in (m.lora_a, m.lora_b))
    x64 = x.detach().double().requires_grad_()
    y64 = x64 @ w.T + 2.0 * (x64 @ a.T) @ b.T
    y64.backward(grad_y.double())

    def close(got: torch.Tensor, want: torch.Tensor) -> None:  # f32 sums of up to 150 terms
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))

    close(y.detach(), y64.detach())
    close(m.lora_a.grad, a.grad)
    close(m.lora_b.grad, b.grad)
    assert m.lora_b.grad.is_contiguous()
    if x_grad:
        close(x.grad, x64.grad)
    else:
        assert x.grad is None


def test_ranks_past_the_c_loops_take_torch_s_products(monkeypatch, cpu_policy) -> None:
    """Up to the policy's lowrank_max_rank the one-node LoRA's rank-r products run in ggtorch.ops.lowrank, past it
    in torch's."""
    from ggtorch.ops import policy

    calls = _rank_r_products("lowrank", monkeypatch, cpu_policy)
    widest = policy.current("cpu").lowrank_max_rank
    for rank, expected in ((widest, 6), (widest + 1, 0)):
        calls.clear()
        m = LoRALinear(_lora_bases(*PRODUCT_SHAPE)["Linear"], rank=rank)
        m(torch.randn(2, 8, PRODUCT_SHAPE[1], requires_grad=True)).sum().backward()
        assert len(calls) == expected, (rank, calls)


@pytest.mark.parametrize("base_kind", ["Linear", "Q4_0"])
@pytest.mark.parametrize("rank_r_kernel", ["lowrank", "torch"])
def test_lora_product_under_bf16_autocast_computes_as_autocast_does(base_kind: str, rank_r_kernel: str,
                                                                    monkeypatch, cpu_policy) -> None:
    """Under autocast the one-node LoRA returns bf16, as F.linear would, with f32 gradients for
    f32 parameters and input, close to the two F.linear calls autocast runs."""
    calls = _rank_r_products(rank_r_kernel, monkeypatch, cpu_policy)
    m, gen = _lora_product_module(base_kind, seed=5)
    base, (n_out, n_in) = m.base, PRODUCT_SHAPE
    x = torch.randn(2, 40, n_in, generator=gen, requires_grad=True)
    grad_y = torch.randn(2, 40, n_out, generator=gen)
    w = (base.dequantized_weight() if isinstance(base, QuantLinear) else base.weight).detach()
    results = []
    for fused in (True, False):
        x.grad = m.lora_a.grad = m.lora_b.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if fused:
                y = m(x)
                assert type(y.grad_fn).__name__ == "_LoRAProductsBackward"
            else:
                y = F.linear(x, w) + F.linear(F.linear(x, m.lora_a), m.lora_b) * m.scale
        assert y.dtype == torch.bfloat16
        y.backward(grad_y.bfloat16())
        results.append((y.detach().float(), x.grad, m.lora_a.grad, m.lora_b.grad))
    assert len(calls) == 6 * (rank_r_kernel == "lowrank"), calls
    for got, want in zip(*results, strict=True):
        assert got.dtype == torch.float32
        assert F.cosine_similarity(got.flatten(), want.flatten(), dim=0) > 0.999
        torch.testing.assert_close(got, want, rtol=0.05, atol=0.05 * float(want.detach().abs().max()))


SHARED_WIDTHS = (640, 320, 160)
"""Output widths of a shared-input group's layers (q, k and v of grouped-query attention), each over (out, 576)."""


def _shared_group(base_kind: str, seed: int) -> tuple[tuple[LoRALinear, ...], torch.Generator]:
    """Three LoRALinear over one input width, ranks 4, 2 and 8, scales 2, 1.5 and 0.5, random A and B."""
    gen = torch.Generator().manual_seed(seed)
    layers = []
    for width, rank, alpha in zip(SHARED_WIDTHS, (4, 2, 8), (8.0, 3.0, 4.0), strict=True):
        m = LoRALinear(_lora_bases(width, PRODUCT_SHAPE[1])[base_kind], rank=rank, alpha=alpha)
        with torch.no_grad():
            m.lora_a.copy_(torch.randn(m.lora_a.shape, generator=gen) / PRODUCT_SHAPE[1] ** 0.5)
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=gen))
        layers.append(m)
    return tuple(layers), gen


OWNER = SimpleNamespace(group_forward=LoRALinear.forward_group)
"""An Attention or MLP as attach_lora leaves it: LoRA's one-node product as its ``group_forward`` hook."""


def _nodes(outputs: tuple[torch.Tensor, ...]) -> int:
    """How many autograd nodes made ``outputs``: 1 when they came from one node."""
    return len({id(y.grad_fn) for y in outputs})


@pytest.mark.parametrize("base_kind", ["Linear", "Q4_0", "Q4_0 chunked"])
@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("rank_r_kernel", ["lowrank", "torch", "onednn"])
def test_shared_input_lora_against_the_formula_in_float64(base_kind: str, x_grad: bool, rank_r_kernel: str,
                                                          monkeypatch, cpu_policy) -> None:
    """Layers reading one x (q, k, v) as one node: each output x W_i^T + s_i (x A_i^T) B_i^T and every gradient
    against autograd in float64; the rank-r products over the stacked A once per pass of x (one projection
    forward, one reduce for all A's gradients, one expand of x's gradient)."""
    calls = _rank_r_products(rank_r_kernel, monkeypatch, cpu_policy)
    layers, gen = _shared_group(base_kind, seed=6)
    x = torch.randn(3, 50, PRODUCT_SHAPE[1], generator=gen).requires_grad_(x_grad)
    grads = [torch.randn(3, 50, width, generator=gen) for width in SHARED_WIDTHS]
    ys = shared_input(OWNER, layers, x)
    assert {type(y.grad_fn).__name__ for y in ys} == {"_LoRAProductsBackward"}
    torch.autograd.backward(ys, grads)
    if rank_r_kernel == "lowrank":  # forward: 1 project, 3 expands; backward: 3 projects, [1 expand], 1 + 3 reduces
        assert sorted(calls) == sorted(["project"] * 4 + ["expand_"] * (3 + x_grad) + ["reduce"] * 4), calls

    x64 = x.detach().double().requires_grad_()
    for m, y, grad in zip(layers, ys, grads, strict=True):
        w = (m.base.dequantized_weight() if isinstance(m.base, QuantLinear) else m.base.weight).double()
        a, b = (p.detach().double().requires_grad_() for p in (m.lora_a, m.lora_b))
        y64 = x64 @ w.T + m.scale * (x64 @ a.T) @ b.T
        y64.backward(grad.double())
        for got, want in ((y.detach(), y64.detach()), (m.lora_a.grad, a.grad), (m.lora_b.grad, b.grad)):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
        assert m.lora_a.grad.is_contiguous() and m.lora_b.grad.is_contiguous()
        assert m.lora_a.grad._base is None  # its own tensor, not a view of the stacked gradient
    if x_grad:
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5 * float(x64.grad.abs().max()))
    else:
        assert x.grad is None


@pytest.mark.parametrize("autocast", [False, True])
def test_shared_input_lora_computes_as_its_layers_one_by_one(autocast: bool) -> None:
    """The same outputs as each layer's own one-node product, bit for bit (the C loops compute each rank's
    column alone, in the same order), and the same gradients up to the order of their sums; under bf16
    autocast the input gradient is summed in f32 and its LoRA part is not rounded to bf16 first."""
    from ggtorch.ops import lowrank

    if not lowrank.available():
        pytest.skip("no C compiler to build ggtorch/ops/lowrank.c")
    layers, gen = _shared_group("Q4_0", seed=7)
    x0 = torch.randn(2, 40, PRODUCT_SHAPE[1], generator=gen)
    grads = [torch.randn(2, 40, width, generator=gen) for width in SHARED_WIDTHS]
    results = []
    for together in (True, False):
        x = x0.clone().requires_grad_()
        for m in layers:
            m.lora_a.grad = m.lora_b.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            ys = shared_input(OWNER, layers, x) if together else tuple(m(x) for m in layers)
        torch.autograd.backward(ys, [g.to(ys[0].dtype) for g in grads])
        results.append(([y.detach() for y in ys], [x.grad] + [p.grad for m in layers for p in (m.lora_a, m.lora_b)]))
    (ys, got), (ys_ref, want) = results
    assert all(torch.equal(y, r) for y, r in zip(ys, ys_ref, strict=True))
    tol = {"rtol": 2e-2, "atol": 2e-2} if autocast else {"rtol": 1e-5, "atol": 1e-5}
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == torch.float32
        torch.testing.assert_close(g, w, rtol=tol["rtol"], atol=tol["atol"] * float(w.abs().max()))


def test_shared_input_calls_layers_one_by_one_where_one_node_does_not_apply() -> None:
    """A forward hook sees its layer's call; other layer types, a merged layer or dropout in training leave the
    group to the layers' own forwards; the outputs are the same either way."""
    layers, gen = _shared_group("Linear", seed=8)
    x = torch.randn(2, 5, PRODUCT_SHAPE[1], generator=gen)
    want = [m(x) for m in layers]
    seen = []
    handle = layers[1].register_forward_hook(lambda module, args, out: seen.append(module))
    got = shared_input(OWNER, layers, x)
    handle.remove()
    assert seen == [layers[1]]
    assert _nodes(got) == 3  # one node each
    mixed = (layers[0], layers[1].base)
    got_mixed = shared_input(OWNER, mixed, x)
    torch.testing.assert_close(got_mixed[1], layers[1].base(x))
    assert shared_input(SimpleNamespace(group_forward=None), layers, x) and _nodes(got) == 3  # no hook: one by one
    layers[2].merge()
    assert _nodes(shared_input(OWNER, layers, x)) == 3
    layers[2].unmerge()
    layers[0].dropout = nn.Dropout(0.5)
    assert _nodes(shared_input(OWNER, layers, x)) == 3
    layers[0].eval()
    together = shared_input(OWNER, layers, x)
    assert _nodes(together) == 1 and type(together[0].grad_fn).__name__ == "_LoRAProductsBackward"
    for y, w in zip(together, want, strict=True):
        torch.testing.assert_close(y, w, rtol=1e-6, atol=1e-6 * float(w.detach().abs().max()))


def test_lora_keeps_two_nodes_where_the_base_trains_or_dropout_is_on() -> None:
    """A base weight that requires grad still gets its gradient; dropout in training masks only
    the delta; a Linear subclass keeps its own forward: none goes through the one-node product,
    whose base is a frozen plain x @ W.T and input unmasked."""
    base = nn.Linear(16, 8, bias=False)
    m = LoRALinear(base, rank=2)
    y = m(torch.randn(5, 16))
    assert type(y.grad_fn).__name__ != "_LoRAProductsBackward"
    y.sum().backward()
    assert base.weight.grad is not None and base.weight.grad.abs().sum() > 0
    base.weight.requires_grad_(False)

    class Doubled(nn.Linear):  # a subclass's forward may be anything: it must be called
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    doubled = Doubled(16, 8, bias=False).requires_grad_(False)
    x = torch.randn(5, 16)
    y = LoRALinear(doubled, rank=2)(x)
    assert type(y.grad_fn).__name__ != "_LoRAProductsBackward"
    torch.testing.assert_close(y, 2 * F.linear(x, doubled.weight))  # B = 0: the base's own output
    m = LoRALinear(base, rank=2, dropout=0.5)
    assert type(m.train()(torch.randn(5, 16)).grad_fn).__name__ != "_LoRAProductsBackward"
    assert type(m.eval()(torch.randn(5, 16)).grad_fn).__name__ == "_LoRAProductsBackward"


def test_linear_parts_are_the_forwards_product_or_none() -> None:
    """What a fused consumer (the output loss) may compute itself: base, A, B and scale, unless merged or dropout."""
    base = nn.Linear(8, 5, bias=False)
    base.weight.requires_grad_(False)
    layer = LoRALinear(base, rank=2, alpha=4.0)
    with torch.no_grad():
        layer.lora_b.normal_()
    parts = layer.linear_parts()
    assert parts is not None
    inner, a, b, scale = parts
    assert inner is base and a is layer.lora_a and b is layer.lora_b and scale == 2.0
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), inner(x) + scale * (x @ a.T) @ b.T)
    layer.merge()
    assert layer.linear_parts() is None
    layer.unmerge()
    assert layer.linear_parts() is not None
    assert LoRALinear(base, rank=2, dropout=0.1).linear_parts() is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16-autocast"])
def test_expert_lora_is_one_node_with_each_expert_s_one_layer_product(dtype: torch.dtype) -> None:
    """LoRAExperts over a quantized stack: one autograd node for all experts, whose output and gradients (x, A, B)
    equal bit for bit those of each expert's rows through the one-layer LoRA product (lora_products) over that
    expert's matrix, and a float64 formula within rounding; an expert no row reaches gets zero gradients."""
    from ggtorch.lora.layers import LoRAExperts
    from ggtorch.lora.product import _expert_products, lora_products
    from ggtorch.quant import dequantize
    from ggtorch.quant.modules import QuantExperts
    from tests.quant.test_dequant import random_blocks

    n_expert, n_out, n_in = 5, 48, 256
    raw = torch.from_numpy(random_blocks(GGMLQuantizationType.Q4_K, (n_expert, n_out, n_in), seed=2))
    layer = LoRAExperts(QuantExperts(raw.reshape(-1), GGMLQuantizationType.Q4_K, (n_expert, n_out, n_in)), rank=3,
                        alpha=6.0)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        layer.lora_a.normal_(generator=gen)
        layer.lora_b.normal_(generator=gen)
    counts = [4, 0, 7, 1, 3]  # expert 1 gets no row
    x = torch.randn(sum(counts), n_in, generator=gen, requires_grad=True)
    probe = torch.randn(sum(counts), n_out, generator=gen)

    def run(forward) -> tuple[torch.Tensor, ...]:
        x.grad = layer.lora_a.grad = layer.lora_b.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            y = forward()
        (y.float() * probe).sum().backward()
        return y.detach(), x.grad, layer.lora_a.grad, layer.lora_b.grad

    nodes: list[str] = []

    def grouped() -> torch.Tensor:
        y = layer(x, counts)
        nodes.append(type(y.grad_fn).__name__)
        return y

    def per_expert() -> torch.Tensor:
        a, b = layer.lora_a.unbind(0), layer.lora_b.unbind(0)
        parts = [lora_products(rows, (float(layer.scale),), (_expert_products(layer.base, e, dtype),), dtype,
                               [a[e], b[e]])[0] for e, rows in enumerate(x.split(counts)) if rows.shape[0]]
        return torch.cat(parts)

    got, expected = run(grouped), run(per_expert)
    assert nodes == ["_ExpertLoRAProductsBackward"]
    for g, e, name in zip(got, expected, ["y", "x.grad", "A.grad", "B.grad"], strict=True):
        assert g.dtype == e.dtype and torch.equal(g, e), name
    assert not got[2][1].any() and not got[3][1].any() and got[2][0].any()

    w = dequantize(layer.base.raw, GGMLQuantizationType.Q4_K, (n_expert, n_out, n_in)).double()
    a64, b64, x64 = layer.lora_a.double(), layer.lora_b.double(), x.detach().double()
    ids = torch.repeat_interleave(torch.arange(n_expert), torch.tensor(counts))
    formula = torch.einsum("ni,noi->no", x64, w[ids] + float(layer.scale) * b64[ids] @ a64[ids])
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got[0].double(), formula, rtol=tolerance, atol=tolerance * float(formula.abs().max()))
