"""The ``ray up`` configs in deploy/ pass Ray's own cluster-config validation: the steps
``ray up`` runs before it touches a machine (``prepare_config``: defaults filled in, the local
provider's node list turned into a node type; then ``validate_config``: Ray's JSON schema and
its cross-field checks). Nothing here reaches a cloud provider or a node."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from specmesh.cluster.config import ROLES

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
CONFIGS = ["cluster.yaml", "cluster-aws.yaml", "cluster-local.yaml"]


def _load(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def _validated(config: dict) -> dict:
    """``config`` as ``ray up`` prepares it, after Ray's validation (raises on failure)."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    if prepared["provider"]["type"] == "local":
        # the local provider's own fill-out step (no cloud call); AWS would ask EC2 for the
        # instance types' resources, which the config declares itself
        from ray.autoscaler._private.local.node_provider import LocalNodeProvider

        prepared = LocalNodeProvider.fillout_available_node_types_resources(prepared)
    validate_config(prepared)
    return prepared


@pytest.mark.parametrize("name", CONFIGS)
def test_ray_up_config_passes_rays_validation(name):
    prepared = _validated(_load(name))
    assert prepared["head_node_type"] in prepared["available_node_types"]
    text = (DEPLOY / name).read_text()
    for role in ROLES:  # every role's custom resource is offered by some node
        assert f'"{role}": 1' in text, (name, role)


def test_aws_node_types_offer_every_role_resource():
    types = _validated(_load("cluster-aws.yaml"))["available_node_types"]
    offered = {r for t in types.values() for r in t.get("resources", {})}
    assert set(ROLES) <= offered, offered


@pytest.mark.parametrize("name", CONFIGS)
def test_the_validator_refuses_a_broken_config(name):
    """The check is not vacuous: an unknown field and a wrong type are refused."""
    import jsonschema

    bad = _load(name)
    bad["worker_start_ray_commandz"] = []
    with pytest.raises(jsonschema.ValidationError):
        _validated(bad)
    bad = _load(name)
    bad["idle_timeout_minutes"] = "soon"  # a number
    with pytest.raises(jsonschema.ValidationError):
        _validated(bad)
