from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "cluster" / "configs"


def test_example_configs_load():
    config = ClusterConfig.from_yaml(CONFIGS / "local-cpu.yaml")
    assert config.model == "tiny" and config.decode.initial == 1
    assert config.engine_config("decode").num_kv_blocks == 1024
    assert config.kv.wire_dtype == "fp8" and config.router.port == 8000


@pytest.mark.parametrize(
    "data, message",
    [
        ({"modle": "tiny"}, "unknown key.*modle"),
        ({"mode": "split"}, "mode"),
        ({"pools": {"prefill": {"replicas": 0}}}, r"pools\.prefill: replicas"),
        (
            {"pools": {"decode": {"min_replicas": 3, "max_replicas": 2}}},
            r"pools\.decode: replicas: need min",
        ),
        ({"slo": {"percentile": 100}}, r"slo: percentile"),
        ({"planner": {"max_step": 0}}, r"planner: max_step"),
        ({"pools": {"prefil": {}}}, r"pools\.prefil: unknown pool"),
        ({"pools": {"decode": {"gpus": 1}}}, r"pools\.decode: unknown key.*gpus"),
        ({"kv": {"wire_dtype": "int4"}}, r"kv: .*wire_dtype"),
        ({"router": {"port": 70000}}, r"router: port"),
        ({"engine": {"block_size": 12}}, "block_size"),
    ],
)
def test_invalid_configs_name_the_key(data, message):
    with pytest.raises(ConfigError, match=message):
        ClusterConfig.from_dict(data)


def test_bad_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        ClusterConfig.from_yaml(path)
    with pytest.raises(ConfigError, match="cannot read"):
        ClusterConfig.from_yaml(tmp_path / "missing.yaml")
