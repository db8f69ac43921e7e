"""Long fuzz run over mutated GGUF files (the strategies of tests/io/test_fuzz_gguf.py).

    python bench/fuzz_gguf.py --examples 5000 [--kind model|adapter|checkpoint] [--seed 0]

Every mutated model, adapter and checkpoint must load or raise a GGTorchError with a message.
Unlike the test, the run does not stop at the first bug: it prints each distinct escaped
exception once, then the outcome counts per file kind.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, seed, settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fixtures import STORIES260K  # noqa: E402
from tests.io.gguf_fuzz import Mutation, Seed, check_outcome, make_seeds, mutations  # noqa: E402


def fuzz(target: Seed, examples: int, rng_seed: int, path: Path, bugs: dict[str, list[Mutation]]) -> Counter[str]:
    """Run ``examples`` mutations of one file; record each distinct escaped exception in ``bugs``."""
    outcomes: Counter[str] = Counter()

    @seed(rng_seed)
    @settings(max_examples=examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(edits=mutations(target))
    def run(edits: list[Mutation]) -> None:
        try:
            outcomes[check_outcome(target, edits, path)] += 1
        except AssertionError as e:
            outcomes["BUG"] += 1
            bugs.setdefault(str(e)[:160], edits)

    run()
    return outcomes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=2000, help="mutated files per kind")
    ap.add_argument("--kind", choices=["model", "adapter", "checkpoint", "ggla", "peft-config", "peft-weights"],
                    action="append")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", type=Path, default=STORIES260K, help="the F32 llama GGUF every seed is made from")
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="ggtorch-fuzz-"))
    seeds = {s.name: s for s in make_seeds(folder, args.model)}
    bugs: dict[str, list[Mutation]] = {}
    for kind in args.kind or list(seeds):
        outcomes = fuzz(seeds[kind], args.examples, args.seed, folder / "mutated.gguf", bugs)
        print(f"{kind}: {sum(outcomes.values())} cases: {dict(outcomes)}", flush=True)
    for message, edits in bugs.items():
        print(f"BUG {message}\n    {edits}")
    return 1 if bugs else 0


if __name__ == "__main__":
    raise SystemExit(main())
