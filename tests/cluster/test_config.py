from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import ClusterConfig, ConfigError

CONFIGS = Path(__file__).resolve().parents[2] / "cluster" / "configs"


def test_example_configs_load():
    config = ClusterConfig.from_yaml(CONFIGS / "local-cpu.yaml")
    assert config.model == "smollm2-135m" and config.decode.initial == 1
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
        ({"kv": {"layer_burst_bytes": -1}}, r"kv: .*layer_burst_bytes"),
        ({"router": {"port": 70000}}, r"router: port"),
        ({"engine": {"block_size": 12}}, "block_size"),
        ({"router": {"limits": {"slo_admission": "yes"}}}, r"router.limits: slo_admission"),
        ({"pools": {"decode": {"resources": {"GPU": 1}}}}, r"pools\.decode: resources: set GPU"),
        ({"pools": {"decode": {"resources": {"x": 0}}}}, r"pools\.decode: resources: must"),
        ({"pools": {"decode": {"node_labels": {"zone": 1}}}}, r"pools\.decode: node_labels"),
        ({"pools": {"decode": {"num_cpus": 0}}}, r"pools\.decode: a replica must reserve"),
        ({"pools": {"decode": {"placement_timeout_s": 0}}}, r"placement_timeout_s"),
        ({"kv": {"host": ""}}, r"kv: kv host must be 'auto' or an address"),
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


def test_serve_flags_set_slo_targets_and_admission(tmp_path):
    from cluster.cli import build_parser, serve_config

    path = tmp_path / "c.yaml"
    path.write_text("slo: {percentile: 95}\nrouter: {limits: {max_waiting: 8}}\n")
    args = build_parser().parse_args(
        ["serve", "--config", str(path), "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"]
    )
    config = serve_config(args)
    assert (config.slo.ttft_ms, config.slo.tpot_ms, config.slo.percentile) == (500, 50, 95)
    assert config.limits.slo_admission and config.limits.max_waiting == 8
    args = build_parser().parse_args(["serve", "--no-slo-admission"])
    assert serve_config(args).limits.slo_admission is False


def test_serve_tensor_parallel_flags():
    from cluster.cli import build_parser, serve_config
    from cluster.config import ConfigError
    from workers.pool import Pool

    parse = build_parser().parse_args
    config = serve_config(parse(["serve", "--mode", "colocated", "--tensor-parallel-size", "2"]))
    assert config.engine_config(Pool.COLOCATED).tensor_parallel_size == 2
    config = serve_config(parse(["serve", "--prefill-tensor-parallel-size", "2"]))
    assert config.engine_config(Pool.PREFILL).tensor_parallel_size == 2
    assert config.engine_config(Pool.DECODE).tensor_parallel_size == 1
    config = serve_config(parse(["serve", "--decode-tensor-parallel-size", "3"]))
    assert config.engine_config(Pool.DECODE).tensor_parallel_size == 3
    with pytest.raises(ConfigError, match="moves the KV of tp 1 replicas only"):
        serve_config(parse(["serve", "--kv-transport", "nixl", "--tensor-parallel-size", "2"]))
    with pytest.raises(ConfigError, match="tensor_parallel_size must be a positive integer"):
        serve_config(parse(["serve", "--mode", "colocated", "--tensor-parallel-size", "0"]))


def _nodes_needed(replica_gpus: list[float], node_gpus: float) -> int:
    """Nodes of ``node_gpus`` that hold these replicas, each on one node (first fit)."""
    free: list[float] = []
    for need in sorted(replica_gpus, reverse=True):
        assert need <= node_gpus, f"a {need:g}-GPU replica fits no {node_gpus:g}-GPU node"
        slot = next((i for i, f in enumerate(free) if f >= need), None)
        if slot is None:
            free.append(node_gpus - need)
        else:
            free[slot] -= need
    return len(free)


@pytest.mark.parametrize(
    "name", sorted(p.name for p in CONFIGS.glob("*.yaml") if p.name != "ray-up-gpu.yaml")
)
def test_every_example_config_loads(name):
    ClusterConfig.from_yaml(CONFIGS / name)


def test_the_ray_up_cluster_holds_the_multinode_config_s_pools():
    import yaml

    config = ClusterConfig.from_yaml(CONFIGS / "gpu-multinode.yaml")
    cluster = yaml.safe_load((CONFIGS / "ray-up-gpu.yaml").read_text())
    types = cluster["available_node_types"]
    gpu_types = {name: t for name, t in types.items() if t["resources"].get("GPU")}
    assert list(gpu_types) == ["gpu_8x_h100"]
    node = gpu_types["gpu_8x_h100"]
    pools = [config.prefill, config.decode]
    for pool in pools:  # every replica names the node type, and one node holds it
        assert "accelerator_type:H100" in pool.resources
        assert pool.shape().fits(node["resources"], {})
    node_gpus = node["resources"]["GPU"]
    least = _nodes_needed([p.num_gpus for p in pools for _ in range(p.min)], node_gpus)
    most = _nodes_needed([p.num_gpus for p in pools for _ in range(p.max)], node_gpus)
    assert node["min_workers"] == least and node["max_workers"] == most == cluster["max_workers"]
    assert types[cluster["head_node_type"]]["resources"].get("GPU", 0) == 0


def test_the_8_gpu_node_config_fits_one_node():
    config = ClusterConfig.from_yaml(CONFIGS / "gpu-8x-node.yaml")
    assert (
        config.prefill.max * config.prefill.num_gpus + config.decode.max * config.decode.num_gpus
        <= 8
    )
    assert config.colocated.max * config.colocated.num_gpus <= 8
