"""``shuffle_samples`` and ``get_example_targets_batch``: the sample order and the batch rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ggtorch.data.samples import DataOptions, Vocab
from ggtorch.errors import BadData
from ggtorch.rng import MT19937

MT19937_MAX_MINUS_1 = 4294967294
"""``rng.max() - 1``: the old offset draw divides by this, so a draw can exceed 1 by a hair."""


@dataclass
class Shuffled:
    """Samples in permuted order, each with the random start offset drawn for it."""

    offsets: np.ndarray
    begins: np.ndarray
    sizes: np.ndarray


def shuffle_samples(rng_state: str, begins: np.ndarray, sizes: np.ndarray) -> tuple[Shuffled, str]:
    """``shuffle_samples``: permute by ``(rnd[i], i)``, draw offsets; return them and the RNG state after.

    The offset draws happen whether or not random offsets are used, as in llama.cpp, so the
    following permutation is the same either way.
    """
    count = len(begins)
    if count == 0:
        return Shuffled(begins.copy(), begins.copy(), sizes.copy()), rng_state
    rng = MT19937.from_state(rng_state)
    order = np.argsort(rng.draw(count), kind="stable")  # ties keep index order
    frac = rng.draw(count).astype(np.float64) / float(MT19937_MAX_MINUS_1)
    sizes_s = sizes[order]
    # (size_t)((size - 1) * frac) in double; an empty sample gets 0 (any offset leaves it empty).
    offsets = np.where(sizes_s > 0, np.trunc((sizes_s - 1).astype(np.float64) * frac), 0).astype(np.int64)
    return Shuffled(offsets, begins[order], sizes_s), rng.state()


# --- batches (get_example_targets_batch) -------------------------------------------------------

def build_batch(tokens: np.ndarray, shuffled: Shuffled, start: int, n_batch: int, n_ctx: int,
                vocab: Vocab, options: DataOptions) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``get_example_targets_batch`` from shuffled sample ``start``: (inputs, targets, samples used).

    Row k takes sample ``(start + used) % count``; its tokens (clamped to the vocabulary) fill
    the targets, padded with EOS or, with fill, followed by [EOS][BOS] and the next samples.
    The inputs are the targets shifted right by one behind BOS.
    """
    count = len(shuffled.begins)
    if count == 0:
        raise BadData("there are no training samples to build a batch from")
    bos, eos, hi = vocab.bos_id, vocab.eos_id, vocab.n_vocab - 1
    fill = options.fill_with_next_samples
    targets = np.full((n_batch, n_ctx), eos, dtype=np.int64)
    used = 0
    for k in range(n_batch):
        row = targets[k]
        idx = (start + used) % count
        used += 1
        offs = int(shuffled.offsets[idx]) if options.sample_random_offsets else 0
        begin, size = int(shuffled.begins[idx]), int(shuffled.sizes[idx])
        eos_done, bos_done = not options.separate_with_eos, not options.separate_with_bos
        i = 0
        while i < n_ctx:
            if offs < size:
                take = min(size - offs, n_ctx - i)
                row[i:i + take] = np.clip(tokens[begin + offs:begin + offs + take], 0, hi)
                i += take
                offs += take
            elif not fill:
                break  # the rest stays EOS
            elif not eos_done:
                eos_done = True
                row[i] = eos
                i += 1
            elif not bos_done:
                bos_done = True
                row[i] = bos
                i += 1
            else:  # separation done: continue with the next sample
                eos_done, bos_done = not options.separate_with_eos, not options.separate_with_bos
                idx = (start + used) % count
                used += 1
                offs, begin, size = 0, int(shuffled.begins[idx]), int(shuffled.sizes[idx])
                if size == 0:
                    row[i] = eos  # the switching position emits the default token
                    i += 1
    inputs = np.empty_like(targets)
    inputs[:, 0] = bos
    inputs[:, 1:] = targets[:, :-1]
    return torch.from_numpy(inputs), torch.from_numpy(targets), used
