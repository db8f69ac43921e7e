"""Fuzz: config files of any shape either configure a run or are refused with one GGTorchError, never a traceback.

Keys are the options' names (and a few that are not), values anything YAML or TOML can hold: wrong types, numbers
past f32, nested lists and maps, nulls, text where numbers go; and files that are not YAML at all.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from ggtorch.errors import GGTorchError
from ggtorch.training.config import FinetuneConfig, TrainConfig, read_config_file

KEYS = sorted(FinetuneConfig.field_names() | TrainConfig.field_names()) + ["lora-rank", "adam alpha", "", "ctx-size"]
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=12) | st.sampled_from(["true", "false", "1e39", "nan", "f32", "quantized", "-1"]))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner,
                                                                                           max_size=2), max_leaves=4)
CONFIGS = st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=8), VALUES, max_size=6)


@seed(57)
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(options=CONFIGS, kind=st.sampled_from([FinetuneConfig, TrainConfig]))
def test_any_yaml_config_configures_or_is_refused(options: dict, kind: type, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("cfg") / "run.yaml"
    path.write_text(yaml.safe_dump(options), encoding="utf-8")
    extra = {"model_base": "m.gguf"} if kind is FinetuneConfig else {"vocab_model": "v.gguf"}
    try:
        kind(**{**extra, **read_config_file(path, kind)})
    except GGTorchError:  # one message; anything else escaping is the bug this looks for
        pass


@seed(58)
@settings(max_examples=80, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=200) | st.text(max_size=200).map(str.encode), suffix=st.sampled_from([".yaml", ".toml"]))
def test_any_bytes_as_a_config_file_are_read_or_refused(raw: bytes, suffix: str, tmp_path_factory) -> None:
    path: Path = tmp_path_factory.mktemp("cfg") / f"run{suffix}"
    path.write_bytes(raw)
    try:
        FinetuneConfig(model_base="m.gguf", **read_config_file(path, FinetuneConfig))
    except GGTorchError:
        pass
