"""Full-finetune throughput: ggtorch's ``train --model-base`` vs llama.cpp's own training, same model/data/ctx.

llama.cpp side: ``llama_opt_init`` + ``llama_opt_epoch`` as llama.cpp's examples/training/finetune.cpp
calls them, through llama-cpp-python's context and model pointers. What the Python binding
lacks is reached with ctypes in the libraries llama-cpp-python installs:
- ``ggml_opt_dataset_init`` / ``ggml_opt_dataset_data`` / ``_labels`` / ``ggml_get_data`` build the
  dataset as common_opt_dataset_init does (datapoint i = tokens[i*stride : i*stride+ctx], labels
  shifted by one);
- llama-cpp-python 0.3.36's ``llama_opt_params`` misses the trailing ``optimizer_type`` field of
  llama.h, so the struct is declared here in full (AdamW);
- a ctypes callback cannot return a C struct by value, so the optimizer parameters come from
  ggml's own ``ggml_opt_get_constant_optimizer_params`` reading a struct we own.

llama.cpp trains one sequence of ``ctx`` tokens per optimizer step (n_batch = n_ubatch = ctx,
so K and V get gradients); ggtorch runs the same shape (batch 1, one step per sequence), f32.
Each side trains every weight; the first steps (graph allocation / warm-up) are not timed.

Both sides live in this one process, set up once, and run in alternating rounds (``--rounds``, 5): each
round ``warmup`` untimed steps, then ``steps`` timed ones. A round's figure is its tokens over the wall time
of its timed steps; each round's median and slowest step are printed beside it, so a stall shows. Each side's
figure is its fastest round: a slow spell of the machine (its speed drifts by 10-25% within minutes) then
costs neither side its figure, as in bench_vs_peft.py's repeated rows.

Usage: python bench/bench_full_finetune.py [--model M.gguf] [--ctx 256] [--steps 100] [--rounds 5]
       [--threads 2] [--quick]
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures import SHAKESPEARE, STORIES260K  # noqa: E402

GGML_TYPE_I32 = 26
GGML_TYPE_F32 = 0


class OptimizerParams(ctypes.Structure):
    """ggml_opt_optimizer_params (ggml-opt.h)."""

    _fields_ = [("alpha", ctypes.c_float), ("beta1", ctypes.c_float), ("beta2", ctypes.c_float),
                ("eps", ctypes.c_float), ("wd", ctypes.c_float), ("sgd_alpha", ctypes.c_float),
                ("sgd_wd", ctypes.c_float)]


def _opt_params_struct(llama_cpp: object) -> type[ctypes.Structure]:
    class LlamaOptParams(ctypes.Structure):
        """llama_opt_params as llama.h declares it (with optimizer_type)."""

        _fields_ = [("n_ctx_train", ctypes.c_uint32), ("param_filter", llama_cpp.llama_opt_param_filter),
                    ("param_filter_ud", ctypes.c_void_p), ("get_opt_pars", ctypes.c_void_p),
                    ("get_opt_pars_ud", ctypes.c_void_p), ("optimizer_type", ctypes.c_int)]

    return LlamaOptParams


class LlamaCppTraining:
    """llama.cpp's full finetune (``llama_opt_epoch``) of ``model`` on ``rows`` sequences of ``ctx`` tokens,
    set up once; each :meth:`round` runs one epoch over them."""

    def __init__(self, model: Path, tokens: list[int], ctx: int, rows: int, threads: int) -> None:
        import llama_cpp

        self.ctx, self.rows = ctx, rows
        libdir = Path(llama_cpp.__file__).parent / "lib"
        ggml_base = ctypes.CDLL(str(libdir / "libggml-base.so"))
        ggml = ctypes.CDLL(str(libdir / "libggml.so"))
        for lib in (ggml_base, ggml):
            if hasattr(lib, "ggml_opt_dataset_init"):
                opt = lib
                break
        else:
            raise RuntimeError("ggml_opt_dataset_init is in none of llama-cpp-python's ggml libraries")
        opt.ggml_opt_dataset_init.restype = ctypes.c_void_p
        opt.ggml_opt_dataset_init.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                              ctypes.c_int64, ctypes.c_int64]
        opt.ggml_opt_dataset_data.restype = ctypes.c_void_p
        opt.ggml_opt_dataset_data.argtypes = [ctypes.c_void_p]
        opt.ggml_opt_dataset_labels.restype = ctypes.c_void_p
        opt.ggml_opt_dataset_labels.argtypes = [ctypes.c_void_p]
        opt.ggml_opt_result_init.restype = ctypes.c_void_p
        opt.ggml_opt_result_loss.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_double),
                                             ctypes.POINTER(ctypes.c_double)]
        opt.ggml_opt_result_free.argtypes = [ctypes.c_void_p]
        opt.ggml_opt_dataset_free.argtypes = [ctypes.c_void_p]
        ggml_base.ggml_get_data.restype = ctypes.c_void_p
        ggml_base.ggml_get_data.argtypes = [ctypes.c_void_p]
        self.opt = opt

        self.dataset = opt.ggml_opt_dataset_init(GGML_TYPE_I32, GGML_TYPE_I32, ctx, ctx, rows, 1)
        data = (ctypes.c_int32 * (ctx * rows)).from_address(
            ggml_base.ggml_get_data(opt.ggml_opt_dataset_data(self.dataset)))
        labels = (ctypes.c_int32 * (ctx * rows)).from_address(
            ggml_base.ggml_get_data(opt.ggml_opt_dataset_labels(self.dataset)))
        for i in range(rows):  # stride = ctx: disjoint sequences, the same ones ggtorch trains on
            for j in range(ctx):
                data[i * ctx + j] = tokens[i * ctx + j]
                labels[i * ctx + j] = tokens[i * ctx + j + 1]

        self.llm = llama_cpp.Llama(model_path=str(model), n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, use_mmap=False,
                                   n_threads=threads, n_threads_batch=threads, type_k=GGML_TYPE_F32,
                                   type_v=GGML_TYPE_F32, flash_attn=False, verbose=False)
        self.pars = OptimizerParams(1e-5, 0.9, 0.999, 1e-8, 0.0, 1e-5, 0.0)  # read by ggml through a pointer
        params_cls = _opt_params_struct(llama_cpp)
        filter_all = ctypes.cast(llama_cpp.llama_cpp._lib.llama_opt_param_filter_all,
                                 llama_cpp.llama_opt_param_filter)
        lopt = params_cls(0, filter_all, None,
                          ctypes.cast(opt.ggml_opt_get_constant_optimizer_params, ctypes.c_void_p).value,
                          ctypes.cast(ctypes.pointer(self.pars), ctypes.c_void_p).value, 0)
        init = llama_cpp.llama_cpp._lib.llama_opt_init
        init.argtypes = [ctypes.c_void_p, ctypes.c_void_p, params_cls]
        init.restype = None
        init(self.llm._ctx.ctx, self.llm._model.model, lopt)
        self.epoch = llama_cpp.llama_cpp._lib.llama_opt_epoch
        self.epoch.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_void_p, ctypes.c_void_p]
        self.epoch.restype = None

    def round(self, warmup: int, steps: int) -> tuple[float, list[float], float]:
        """One epoch of ``warmup + steps`` (its rows): tokens/s over the steps after the first ``warmup``, their
        seconds, the epoch's mean loss."""
        if warmup + steps != self.rows:
            raise ValueError(f"an epoch is {self.rows} steps, not {warmup} + {steps}")
        times: list[float] = []

        @ctypes.CFUNCTYPE(None, ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                          ctypes.c_int64, ctypes.c_int64)
        def on_step(train: bool, *_: object) -> None:
            times.append(time.perf_counter())

        result_train, result_eval = self.opt.ggml_opt_result_init(), self.opt.ggml_opt_result_init()
        self.epoch(self.llm._ctx.ctx, self.dataset, result_train, result_eval, self.rows,
                   ctypes.cast(on_step, ctypes.c_void_p), None)
        loss, unc = ctypes.c_double(), ctypes.c_double()
        self.opt.ggml_opt_result_loss(result_train, ctypes.byref(loss), ctypes.byref(unc))
        self.opt.ggml_opt_result_free(result_train), self.opt.ggml_opt_result_free(result_eval)
        if len(times) != self.rows:
            raise RuntimeError(f"llama_opt_epoch ran {len(times)} steps, expected {self.rows}")
        step_s = [t1 - t0 for t0, t1 in zip(times[warmup - 1:-1], times[warmup:], strict=True)]
        return steps * self.ctx / (times[-1] - times[warmup - 1]), step_s, loss.value

    def close(self) -> None:
        self.opt.ggml_opt_dataset_free(self.dataset)


class GgtorchTraining:
    """ggtorch's full finetune as ``ggtorch train --model-base`` runs it (its ``Trainer``), batch 1, f32."""

    def __init__(self, model: Path, text: Path, ctx: int, threads: int, steps: int, directory: str) -> None:
        from ggtorch.training.config import TrainConfig
        from ggtorch.training.trainer import Trainer

        config = TrainConfig(model_base=str(model), train_data=str(text), ctx=ctx, batch=1, adam_iter=steps,
                             threads=threads, seed=1, save_every=0, checkpoint_in="", checkpoint_out="",
                             model_out="", log_file=str(Path(directory) / "log.jsonl"), use_checkpointing=False)
        self.trainer, self.ctx = Trainer(config, manage_process=True), ctx

    def round(self, warmup: int, steps: int) -> tuple[float, list[float], float]:
        """``warmup`` untimed steps, then ``steps`` timed ones: tokens/s over their wall time, their seconds,
        the last loss."""
        self.trainer.train(warmup)
        t0 = time.perf_counter()
        results = self.trainer.train(steps)
        return steps * self.ctx / (time.perf_counter() - t0), [r.seconds for r in results], results[-1].loss

    def close(self) -> None:
        self.trainer.close()


def _spread(seconds: list[float]) -> str:
    """The timed steps' median and slowest, in ms."""
    return f"step ms median {1e3 * statistics.median(seconds):.1f}, slowest {1e3 * max(seconds):.1f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=STORIES260K, help="F32 llama GGUF")
    p.add_argument("--text", type=Path, default=SHAKESPEARE)
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--steps", type=int, default=100, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="rounds per side, the sides alternating")
    p.add_argument("--quick", action="store_true", help="one round of 4 timed steps")
    args = p.parse_args()
    if args.quick:
        args.steps, args.rounds = 4, 1
    if args.rounds < 1 or args.steps < 1 or args.warmup < 1:
        p.error("--rounds, --steps and --warmup must be at least 1")
    if args.ctx % 256:
        # llama.cpp pads a context's n_ctx up to a multiple of 256, and opt_epoch takes one dataset row
        # per n_ctx: any other ctx would train llama.cpp on a different sequence length than ggtorch.
        raise SystemExit("--ctx must be a multiple of 256 (llama.cpp pads n_ctx to 256)")
    torch.set_num_threads(args.threads)

    from ggtorch.io.gguf import read_gguf
    from ggtorch.models.tokenizer import Tokenizer

    tokens = Tokenizer.from_gguf(read_gguf(args.model)).encode(args.text.read_text(encoding="utf-8"))
    need = (args.warmup + args.steps) * args.ctx + 1
    if len(tokens) < need:
        raise SystemExit(f"{args.text} has {len(tokens)} tokens, {need} needed")
    print(f"model {args.model.name}, ctx {args.ctx}, {args.rounds} rounds per side of {args.steps} timed steps "
          f"after {args.warmup}, alternating, {args.threads} threads, f32, all weights trained")
    best: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as d:
        per_side = args.rounds * (args.warmup + args.steps)
        sides = {"ggtorch": GgtorchTraining(args.model, args.text, args.ctx, args.threads, per_side, d),
                 "llama.cpp": LlamaCppTraining(args.model, tokens, args.ctx, args.warmup + args.steps, args.threads)}
        rounds: dict[str, list[float]] = {side: [] for side in sides}
        for r in range(args.rounds):
            for side, training in sides.items():
                tok_s, step_s, loss = training.round(args.warmup, args.steps)
                rounds[side].append(tok_s)
                print(f"round {r + 1} {side}: {tok_s:.0f} tokens/s, {_spread(step_s)}, loss {loss:.4f}", flush=True)
        for training in sides.values():
            training.close()
    for side, figures in rounds.items():
        best[side] = max(figures)
        print(f"{side:9s} {best[side]:10.0f} tokens/s")
    print(f"ratio ggtorch / llama.cpp: {best['ggtorch'] / best['llama.cpp']:.2f}x")


if __name__ == "__main__":
    main()
