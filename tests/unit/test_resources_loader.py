"""Building a site's manager and consumer from resources.json, and every way that can fail."""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from fedhive.errors import ConfigError
from fedhive.resources import (
    GPUResourceConsumer,
    GPUResourceManager,
    ListResourceManager,
    ResourceConsumerSpec,
    load_resources,
)


class StaticConsumer(ResourceConsumerSpec):
    """A site's own consumer, named by import path in resources.json."""

    def __init__(self, env: dict[str, str]) -> None:
        if not env:
            raise ValueError("env must not be empty")
        self.env = env

    def consume(self, resources: Mapping[str, Any]) -> dict[str, str]:
        return dict(self.env)


# The seed's POC resources.json, on a site without GPUs.
FLARE_POC: dict[str, Any] = {
    "format_version": 2,
    "client": {"retry_timeout": 30, "compression": "Gzip"},
    "components": [
        {
            "id": "resource_manager",
            "path": "nvflare.app_common.resource_managers.gpu_resource_manager.GPUResourceManager",
            "args": {"num_of_gpus": 0, "mem_per_gpu_in_GiB": 0},
        },
        {
            "id": "resource_consumer",
            "path": "nvflare.app_common.resource_consumers.gpu_resource_consumer"
            ".GPUResourceConsumer",
            "args": {},
        },
    ],
}


def write(tmp_path: Path, config: Any) -> Path:
    path = tmp_path / "resources.json"
    path.write_text(json.dumps(config))
    return path


def test_flare_poc_file_builds_fedhive_classes(tmp_path: Path) -> None:
    site = load_resources(write(tmp_path, FLARE_POC))
    assert isinstance(site.manager, GPUResourceManager)
    assert isinstance(site.consumer, GPUResourceConsumer)
    assert site.manager.check_resources({}).ok


def test_own_paths_and_custom_classes(tmp_path: Path) -> None:
    config = {
        "components": [
            {"id": "logger", "path": "somewhere.else.Logger"},  # not ours: left alone
            {
                "id": "resource_manager",
                "path": "fedhive.resources.listed.ListResourceManager",
                "args": {"resources": {"gpu": [0, 1]}, "expiration_period": 300},
            },
            {
                "id": "resource_consumer",
                "path": "tests.unit.test_resources_loader.StaticConsumer",
                "args": {"env": {"OMP_NUM_THREADS": "4"}},
            },
        ]
    }
    site = load_resources(write(tmp_path, config))
    assert isinstance(site.manager, ListResourceManager)
    token = site.manager.check_resources({"gpu": 2}).token
    allocation = site.manager.allocate_resources(token)
    assert site.consumer.consume(allocation) == {"OMP_NUM_THREADS": "4"}


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    missing = tmp_path / "resources.json"
    with pytest.raises(ConfigError, match=r"resources.json: cannot read"):
        load_resources(missing)
    missing.write_text('{"components": [\n  {"id": 1,}\n]}')
    with pytest.raises(ConfigError) as err:
        load_resources(missing)
    assert str(err.value).startswith(f"{missing}: invalid JSON at line 2 column")
    assert err.value.field == "resources.json"


def manager_with(**changes: Any) -> dict[str, Any]:
    config = copy.deepcopy(FLARE_POC)
    config["components"][0].update(changes)
    return config


CASES: list[tuple[str, Any, str, str]] = [
    ("not an object", [], "resources.json", "must be a JSON object"),
    ("no components", {"client": {}}, "components", "'components' must be a list"),
    ("component not object", {"components": [3]}, "components[0]", "must be an object"),
    ("id not str", {"components": [{"id": 7}]}, "components[0].id", "must be a string"),
    (
        "duplicate id",
        {"components": [*FLARE_POC["components"], FLARE_POC["components"][0]]},
        "components[2].id",
        "appears twice (components[0] and components[2])",
    ),
    (
        "no consumer",
        {"components": FLARE_POC["components"][:1]},
        "components",
        "no component with id 'resource_consumer'",
    ),
    ("undotted path", manager_with(path="GPUResourceManager"), "components[0].path", "dotted"),
    (
        "unimportable module",
        manager_with(path="nope.mod.Cls"),
        "components[0].path",
        "cannot import module 'nope.mod': ModuleNotFoundError",
    ),
    (
        "missing class",
        manager_with(path="fedhive.resources.gpu.Nope"),
        "components[0].path",
        "module 'fedhive.resources.gpu' has no 'Nope'",
    ),
    (
        "not a class",
        manager_with(path="fedhive.resources.gpu.GiB"),
        "components[0].path",
        "is not a class",
    ),
    (
        "wrong spec",
        manager_with(path="fedhive.resources.gpu.GPUResourceConsumer"),
        "components[0].path",
        "does not implement ResourceManagerSpec",
    ),
    (
        "abstract",
        manager_with(path="fedhive.resources.auto_clean.AutoCleanResourceManager"),
        "components[0].path",
        "is abstract (does not implement _claim, _free, _invalid",
    ),
    ("args not object", manager_with(args=[1]), "components[0].args", "must be an object"),
    (
        "unknown argument",
        manager_with(args={"num_of_gpus": 0, "mem_per_gpu_in_GiB": 0, "ignore_host": True}),
        "components[0].args.ignore_host",
        "has no argument 'ignore_host' (accepted: num_of_gpus, mem_per_gpu_in_GiB, device_ids",
    ),
    (
        "missing argument",
        manager_with(args={"num_of_gpus": 0}),
        "components[0].args.mem_per_gpu_in_GiB",
        "needs argument 'mem_per_gpu_in_GiB'",
    ),
    (
        "bad argument value",
        manager_with(args={"num_of_gpus": -1, "mem_per_gpu_in_GiB": 0}),
        "components[0].args.num_of_gpus",
        "num_of_gpus must be an integer >= 0, got -1",
    ),
    (
        # Without NVML (here) "cannot be detected", with it "this machine has N GPU(s)".
        "more GPUs than the machine has",
        manager_with(args={"num_of_gpus": 64, "mem_per_gpu_in_GiB": 1}),
        "components[0].args.num_of_gpus",
        "num_of_gpus=64 ",
    ),
]


@pytest.mark.parametrize(
    ("config", "field", "fragment"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_bad_files_name_file_component_and_field(
    tmp_path: Path, config: Any, field: str, fragment: str
) -> None:
    path = write(tmp_path, config)
    with pytest.raises(ConfigError) as err:
        load_resources(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and "\n" not in message
    assert fragment in message
    assert err.value.field == field
    if field.startswith(("components[0].path", "components[0].args")):
        assert "'resource_manager'" in message


def test_constructor_failure_of_a_custom_class_is_a_config_error(tmp_path: Path) -> None:
    config = copy.deepcopy(FLARE_POC)
    config["components"][1] = {
        "id": "resource_consumer",
        "path": "tests.unit.test_resources_loader.StaticConsumer",
        "args": {"env": {}},
    }
    with pytest.raises(ConfigError) as err:
        load_resources(write(tmp_path, config))
    assert "component 'resource_consumer'" in str(err.value)
    assert "ValueError: env must not be empty" in str(err.value)
    assert err.value.field == "components[1].args"
