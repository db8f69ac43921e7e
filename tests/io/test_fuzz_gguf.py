"""Fuzz: mutated model, adapter (GGUF, ggla, PEFT) and checkpoint files either load or raise a GGTorchError.

A small fixed budget runs in the normal suite; bench/fuzz_gguf.py runs the same strategies
for many more examples.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, seed, settings

from .gguf_fuzz import FAMILY_SEEDS, Mutation, Seed, check_outcome, make_seeds, mutations

EXAMPLES = 70  # per file kind: ~200 in all


@pytest.fixture(scope="module")
def seeds(stories260k: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Seed]:
    return {s.name: s for s in make_seeds(tmp_path_factory.mktemp("fuzz-seeds"), stories260k)}


@pytest.mark.parametrize("kind", ["model", *(f"model-{name}" for name in FAMILY_SEEDS), "adapter", "checkpoint",
                                  "ggla", "peft-config", "peft-weights"])
def test_mutated_files_load_or_raise_ggtorch_errors(seeds: dict[str, Seed], kind: str,
                                                    tmp_path: Path) -> None:
    outcomes: Counter[str] = Counter()

    @seed(10 + len(kind))
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(edits=mutations(seeds[kind]))
    def run(edits: list[Mutation]) -> None:
        outcomes[check_outcome(seeds[kind], edits, tmp_path / "mutated.gguf")] += 1

    run()
    assert sum(outcomes.values()) >= EXAMPLES
    # The mutations reach past the first check: some files are refused, some still load.
    refused = sum(n for outcome, n in outcomes.items() if outcome != "loaded")
    assert refused > 0 and (outcomes["BadGGUF"] > 0 or not kind.startswith(("model", "adapter", "checkpoint")))
