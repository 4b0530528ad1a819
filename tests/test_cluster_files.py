"""The Azure cluster files validate against Ray's own schema and carry what the Serve configs ask for."""

import json
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from kairos_ray.messages import Role
from kairos_ray.serve import CLUSTER_ENV
from kairos_ray.serve.args import AppArgs

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())
PAIRS = [
    ("azure-1p1d.yaml", "1p1d.yaml"),
    ("azure-2p2d.yaml", "2p2d.yaml"),
    ("azure-2p2d-h100.yaml", "2p2d-h100.yaml"),
    ("azure-mixed.yaml", "2p2d-mixed.yaml"),
]
VM_SIZES = {"A100": "Standard_ND96amsr_A100_v4", "H100": "Standard_ND96isr_H100_v5"}  # 8 GPUs of 80 GB each


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.mark.parametrize("cluster", [c for c, _ in PAIRS])
def test_cluster_file_validates_offline(cluster):
    config = load(ROOT / "cluster" / cluster)
    jsonschema.validate(config, SCHEMA)
    validate_config(prepare_config(config))  # what `ray up` does: Azure defaults filled in, then checked
    assert config["provider"]["type"] == "azure"
    for name, node_type in config["available_node_types"].items():
        for value in node_type["resources"].values():
            assert isinstance(value, int), f"{name}: custom resources must be integers"


@pytest.mark.parametrize("cluster, serve_config", PAIRS)
def test_node_groups_provide_what_the_pools_ask_for(cluster, serve_config):
    node_types = load(ROOT / "cluster" / cluster)["available_node_types"]
    (app,) = load(ROOT / "serve_configs" / serve_config)["applications"]
    args = AppArgs.model_validate(app["args"])
    for role in Role:
        given = app["args"][f"{role.value}_config"]
        for raw, pool in zip(given if isinstance(given, list) else [given], args.groups(role), strict=True):
            deployment = raw["deployment_config"]
            wanted = deployment["ray_actor_options"]
            (resource,) = wanted["resources"]  # the custom resource of the node group it runs on
            # one replica per VM: its placement group fits on one node of its group and on no node of another group
            (group,) = [name for name, t in node_types.items() if resource in t["resources"]]
            node = node_types[group]
            accelerator = raw["accelerator_type"]
            assert node["node_config"]["azure_arm_parameters"]["vmSize"] == VM_SIZES[accelerator]
            assert node["resources"][f"accelerator_type:{accelerator}"] == 1
            assert wanted["resources"] == {resource: 1} and node["resources"][resource] == 1
            placement = pool.placement()
            assert placement.strategy == "STRICT_PACK"
            for key in {k for bundle in placement.bundles for k in bundle}:
                assert sum(bundle.get(key, 0) for bundle in placement.bundles) <= node["resources"][key], key
            # enough nodes at start, and room for the group's autoscaling
            scaling = raw["autoscaling"]
            assert node["min_workers"] >= max(deployment["num_replicas"], scaling["min_replicas"])
            assert node["max_workers"] >= scaling["max_replicas"] > scaling["min_replicas"]
            assert raw["engine_kwargs"]["tensor_parallel_size"] == node["resources"]["GPU"]
            # its profile is of its GPUs (the group's own, else the predictor's)
            assert accelerator.lower() in (pool.profile or args.kairos.predictor.profile)


def test_dashboard_and_metrics_listen_on_the_private_address_only():
    for cluster, _ in PAIRS:
        head = " ".join(load(ROOT / "cluster" / cluster)["head_start_ray_commands"])
        assert '--dashboard-host="$(hostname -I' in head
        assert "0.0.0.0" not in head


@pytest.mark.parametrize("cluster", [c for c, _ in PAIRS])
def test_every_node_starts_ray_with_the_apps_cluster_env(cluster):
    config = load(ROOT / "cluster" / cluster)
    for commands in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[commands] if "ray start" in c]
        assert starts and all(f"{name}={value} " in c for c in starts for name, value in CLUSTER_ENV.items())


@pytest.mark.parametrize("cluster, serve_config", PAIRS)
def test_production_clusters_authenticate_and_fence_the_metrics_port(cluster, serve_config):
    config = load(ROOT / "cluster" / cluster)
    subnet = config["provider"]["subnet_mask"]
    for commands in ("head_start_ray_commands", "worker_start_ray_commands"):
        starts = [c for c in config[commands] if "ray start" in c]
        assert starts and all("RAY_AUTH_MODE=token ray start" in c for c in starts)  # Ray's token auth
    assert config["file_mounts"]["~/.ray/auth_token"] and config["file_mounts"]["~/.kairos/api_keys"]
    fence = [c for c in config["setup_commands"] if "iptables" in c]
    assert fence and f"--dport 8080 ! -s {subnet} -j DROP" in fence[0]
    (app,) = load(ROOT / "serve_configs" / serve_config)["applications"]
    serving = app["args"]["serving"]
    assert serving["require_api_key"] and serving["api_key_file"] == "~/.kairos/api_keys"
