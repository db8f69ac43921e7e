"""Peak memory of LoRA training on a quantized model: about the GGUF's size, not an f32 copy's.

Each measurement runs in a fresh child process and reads its peak resident set size: Linux's
``VmHWM`` from ``/proc/self/status``, else ``resource.getrusage(RUSAGE_SELF).ru_maxrss``. (On
Linux ``ru_maxrss`` survives ``execve``: a child forked from a big pytest process starts with
the parent's high-water mark, which would hide everything the child does; VmHWM belongs to the
child's own address space.) The child first runs the same steps on a tiny model of the
same vocabulary (so torch's kernels, thread pools and code pages, and the tokenizer, are all
touched), records that high-water mark as the baseline, and then trains the real model; the
figure compared is ``peak - baseline``: the model, the adapters, the optimizer and the
activations of a few training steps. The model has real shapes (n_embd 1024, 4
layers, the 32000-token vocabulary: ~112M parameters, 450 MB as f32).

Budget for everything besides the base weights (stated, asserted): ``EXTRA_BUDGET`` =
160 MiB: LoRA tensors with grads and two AdamW moments (~5 MB at r = 4), the activations
and autograd saves of a (1, 64) batch through 4 layers and a 32000-wide output (logits,
softmax and their grads: ~25 MB), one dequantized chunk (``CHUNK_BYTES``, 16 MiB) at a time,
and the allocator's slack.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ggtorch.io.gguf import read_gguf
from tests.llama_models import RandomLlamaShape

REAL_SHAPE = RandomLlamaShape(n_embd=1024, n_ff=2816, n_layer=4, n_head=16, n_head_kv=8)
EXTRA_BUDGET = 160 << 20
MIB = 1 << 20

CHILD = r"""
import json, resource, sys, time
import torch
import torch.nn.functional as F
from ggtorch.lora import LoraConfig, attach_lora, trainable_parameters
from ggtorch.models.loader import load_model_file

def rss() -> int:
    # peak resident bytes of this address space
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)

def train(path: str, keep_quantized: bool, steps: int) -> list[float]:
    model = load_model_file(path, keep_quantized=keep_quantized).model
    attach_lora(model, LoraConfig(rank=4), seed=1)
    opt = torch.optim.AdamW([p for _, p, _ in trainable_parameters(model)], lr=1e-3)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, model.config.n_vocab, (1, 65), generator=gen)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses

path, keep_quantized, steps, warmup = sys.argv[1], sys.argv[2] == "quantized", int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(2)
train(warmup, keep_quantized, 1)
baseline = rss()
t0 = time.perf_counter()
losses = train(path, keep_quantized, steps)
print(json.dumps({"baseline": baseline, "peak": rss(), "seconds": time.perf_counter() - t0,
                  "losses": losses}))
"""


def measure(path: Path, mode: str, warmup: Path, steps: int = 2) -> dict:
    """Run the training child on ``path`` (``mode`` = quantized | f32) after one step on the
    tiny ``warmup`` model, and return its report."""
    # A fixed mmap threshold: every block of 1 MiB or more is mapped on allocation and unmapped when
    # freed. With glibc's default, the threshold follows the largest block freed so far and freed
    # blocks stay in a fragmented heap, so the same run peaked anywhere from 160 to 285 MiB above
    # its baseline depending on how busy the machine was; fixed, it measures what is live (+-2 MiB).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), mode, str(steps), str(warmup)],
                         check=True, capture_output=True, text=True, timeout=600, env=env)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    report["used"] = report["peak"] - report["baseline"]
    return report


def tensor_bytes(path: Path) -> int:
    return sum(int(t.data.nbytes) for t in read_gguf(path).tensors.values())


@pytest.mark.slow
@pytest.mark.parametrize("ftype", ["Q4_0", "Q8_0"])
def test_quantized_training_memory_is_about_the_file(ftype: str, random_llama) -> None:
    path = random_llama(ftype, REAL_SHAPE)
    data = tensor_bytes(path)
    f32_copy = sum(t.data.size for t in read_gguf(random_llama("F32", REAL_SHAPE)).tensors.values())
    report = measure(path, "quantized", random_llama("Q4_0"))
    print(f"{ftype}: tensor data {data / MIB:.0f} MiB, f32 copy {f32_copy / MIB:.0f} MiB, "
          f"quantized-path training used {report['used'] / MIB:.0f} MiB in {report['seconds']:.1f} s")
    assert all(math.isfinite(v) for v in report["losses"])
    assert report["used"] < data + EXTRA_BUDGET
    assert report["used"] < 0.6 * f32_copy


@pytest.mark.slow
def test_dequantized_path_costs_the_f32_copy(random_llama) -> None:
    """The comparison figure: the same run with the base dequantized to f32 up front."""
    path = random_llama("Q4_0", REAL_SHAPE)
    f32_copy = sum(t.data.size for t in read_gguf(random_llama("F32", REAL_SHAPE)).tensors.values())
    report = measure(path, "f32", random_llama("Q4_0"))
    print(f"Q4_0 dequantized to f32: training used {report['used'] / MIB:.0f} MiB in {report['seconds']:.1f} s")
    assert report["used"] > 0.9 * f32_copy  # the float weights are really resident


LOAD_CHILD = r"""
import json, sys
import torch
from ggtorch.models import loader

def mapped_rss(path: str) -> int:
    # resident bytes of this process's mappings of the file (/proc/self/smaps)
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:  # a mapping's header line
                inside = line.rstrip().endswith(path)
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total

if sys.argv[2] == "keep-pages":
    loader.release_pages = lambda info: None
torch.set_num_threads(1)
loaded = loader.load_model_file(sys.argv[1], dtype=torch.float32)
print(json.dumps({"mapped": mapped_rss(sys.argv[1])}))
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="reads /proc/self/smaps")
def test_a_dequantized_load_does_not_keep_the_files_pages_resident(random_llama) -> None:
    """Loading Q8_0 as f32 reads every byte of the file; without releasing them, those pages would
    stay in RSS next to the f32 copy for as long as the model lives."""
    path = random_llama("Q8_0", REAL_SHAPE)
    data = tensor_bytes(path)
    mapped = {}
    for mode in ("release", "keep-pages"):
        out = subprocess.run([sys.executable, "-c", LOAD_CHILD, str(path), mode], check=True, capture_output=True,
                             text=True, timeout=600)
        mapped[mode] = json.loads(out.stdout.strip().splitlines()[-1])["mapped"]
    print(f"Q8_0 ({data / MIB:.0f} MiB of tensors) loaded as f32: {mapped['release'] / MIB:.1f} MiB of the file "
          f"resident, {mapped['keep-pages'] / MIB:.0f} MiB without releasing pages")
    assert mapped["keep-pages"] > 0.9 * data  # the load did read the whole file
    assert mapped["release"] < 0.05 * data  # and let go of it (metadata pages and page fragments stay)
