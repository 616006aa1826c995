"""docker-compose.yml, deploy/Dockerfile and deploy/cloud/ checked without a Docker engine:
services, the one image, commands and their flags (parsed by the services' own parsers),
environment names (those fedhive.config reads), health checks, restart policies, secrets
(test_compose_scripts.py runs the deployment's scripts; tests/e2e/test_compose_smoke.py runs
the stack when a Docker engine answers)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pika
import pytest
import yaml

from fedhive.auth import Role
from fedhive.config import Settings
from fedhive.names import Names
from fedhive.poc import compose as poc_compose
from fedhive.readiness import ReadyConfig, default_path
from fedhive_services.gateway.main import parse_options
from fedhive_services.job_runner import main as runner_main
from fedhive_services.job_runner.main import parse_args as runner_args
from fedhive_services.scheduler import main as scheduler_main
from fedhive_services.scheduler.main import parse_args as scheduler_args
from fedhive_services.site_agent import main as site_agent_main
from fedhive_services.site_agent.config import load_site
from fedhive_services.site_agent.main import parse_args as site_agent_args

from .deploy_scripts import admins_file, broker_setup, healthcheck

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
ENV_EXAMPLE = ROOT / "deploy" / "compose.env.example"
SCRIPTS = ROOT / "deploy" / "compose"
CLOUD = ROOT / "deploy" / "cloud"
IMAGE_SCRIPTS = "/opt/fedhive/compose/"  # where the Dockerfile copies deploy/compose/

INFRA = {"rabbitmq", "redis", "minio", "create-bucket"}
ONE_SHOTS = {"create-bucket", "broker-users", "admins"}
SERVICES = {"job-store", "scheduler", "job-runner", "gateway"}
SITES = {"site-1", "site-2"}
FEDHIVE = SERVICES | SITES | {"broker-users", "admins"}
LONG_RUNNING = {"rabbitmq", "redis", "minio"} | SERVICES | SITES
# The settings each service uses (it gets no others): broker, Redis, S3.
USES = {"job-store": {"amqp", "redis", "s3"}, "scheduler": {"amqp", "redis"},
        "job-runner": {"amqp", "redis", "s3"}, "gateway": {"amqp", "s3"}}
S3_NAMES = {"FEDHIVE_S3_ENDPOINT_URL", "FEDHIVE_S3_BUCKET", "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY"}
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}")


def env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines (comments and blank lines skipped), as `docker compose --env-file`."""
    found = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path.name}: {line!r} is not KEY=VALUE"
            found[key.strip()] = value.strip()
    return found


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error} and $$ (what the tests use)."""
    def one(match: re.Match[str]) -> str:
        name, op, arg = match.groups()
        got = env.get(name)
        if op in (":-", "-"):
            return got if got or (op == "-" and got is not None) else arg
        if op in (":?", "?") and not got:
            raise AssertionError(f"{name} must be set: {arg}")
        return got or ""

    return _VAR.sub(one, value).replace("$$", "$")


class Recorder(dict[str, str]):
    """An environment that records every name `Settings.from_env` asks for."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: set[str] = set()

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        self.asked.add(key)
        return super().get(key, default)


def setting_names() -> set[str]:
    recorder = Recorder()
    Settings.from_env(recorder)
    return recorder.asked


SETTING_NAMES = setting_names()


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return loaded


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


@pytest.fixture(scope="module", params=["compose.env.example", "the demo's env file"])
def example(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> \
        dict[str, str]:
    """The settings of an operator's deployment (the example, token set) and of the one
    `fedhive demo` generates (fedhive.poc.compose)."""
    if request.param == "compose.env.example":
        return {**env_file(ENV_EXAMPLE), "FEDHIVE_TOKEN": "fh_" + "x" * 43}  # left empty there
    path = tmp_path_factory.mktemp("demo") / "compose.env"
    poc_compose.write_env_file(path, poc_compose.env_values(50051, tag="demo"))
    return env_file(path)


def environment(service: dict[str, Any], example: Mapping[str, str]) -> dict[str, str]:
    return {key: interpolate(str(value), example)
            for key, value in (service.get("environment") or {}).items()}


def script_args(command: list[str], script: str) -> list[str]:
    assert command[:2] == ["python", f"{IMAGE_SCRIPTS}{script}"], command
    assert (SCRIPTS / script).is_file()
    return command[2:]


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Mount target -> volume name."""
    found = {}
    for volume in service.get("volumes", []):
        source, target, *_ = volume.split(":")
        found[target] = source
    return found


# --- the compose file ---------------------------------------------------------------------------
def test_every_expected_service_is_there(services: dict[str, Any]) -> None:
    assert set(services) == INFRA | FEDHIVE
    assert services["rabbitmq"]["image"].endswith("-management")
    assert services["redis"]["command"][:3] == ["redis-server", "--appendonly", "yes"]
    assert "mc mb --ignore-existing" in services["create-bucket"]["command"][0]


def test_the_fedhive_services_run_the_one_image_built_from_the_dockerfile(
        services: dict[str, Any]) -> None:
    images = {services[name]["image"] for name in FEDHIVE}
    assert images == {"fedhive:${FEDHIVE_IMAGE_TAG:-local}"}
    for name in FEDHIVE:
        assert services[name]["build"] == {"context": ".", "dockerfile": "deploy/Dockerfile"}
    assert all("build" not in services[name] for name in INFRA)


def test_long_running_services_have_health_checks_and_restart_policies(
        services: dict[str, Any]) -> None:
    for name in LONG_RUNNING:
        check = services[name]["healthcheck"]
        assert check["test"][0] in ("CMD", "CMD-SHELL") and len(check["test"]) > 1, name
        assert {"interval", "timeout", "retries"} <= set(check), name
        assert services[name]["restart"] == "unless-stopped", name
    for name in ONE_SHOTS:
        assert services[name]["restart"] == "no" and "healthcheck" not in services[name]


def test_the_demo_waits_for_exactly_the_long_running_services(services: dict[str, Any]) -> None:
    assert poc_compose.LONG_RUNNING == LONG_RUNNING and poc_compose.ONE_SHOTS == ONE_SHOTS
    assert set(poc_compose.SITES) == SITES
    published = [_VAR.search(port) for service in services.values()
                 for port in service.get("ports", [])]
    assert {match.group(1) for match in published if match} == set(poc_compose.PORT_SETTINGS)
    assert services["gateway"]["ports"][0].startswith(
        f"127.0.0.1:${{{poc_compose.PORT_SETTINGS[0]}")


def test_the_scheduler_runs_two_replicas(services: dict[str, Any]) -> None:
    scheduler = services["scheduler"]
    assert scheduler["deploy"]["replicas"] == 2
    assert "container_name" not in scheduler and "ports" not in scheduler  # would clash


def test_processes_that_spawn_children_run_under_an_init(services: dict[str, Any]) -> None:
    for name in {"job-runner"} | SITES:
        assert services[name]["init"] is True, name


def test_services_start_after_what_they_need(services: dict[str, Any]) -> None:
    for name in SERVICES | SITES:
        needs = services[name]["depends_on"]
        assert needs["rabbitmq"] == {"condition": "service_healthy"}
        assert needs["broker-users"] == {"condition": "service_completed_successfully"}
        uses = USES.get(name, set())
        assert ("redis" in needs) == ("redis" in uses), name
        assert ("create-bucket" in needs) == ("s3" in uses), name
        if "redis" in uses:
            assert needs["redis"] == {"condition": "service_healthy"}
    gateway = services["gateway"]["depends_on"]
    assert gateway["admins"] == {"condition": "service_completed_successfully"}
    assert gateway["job-store"] == {"condition": "service_healthy"}
    assert services["broker-users"]["depends_on"] == {"rabbitmq": {"condition": "service_healthy"}}


def test_published_ports_are_on_loopback_only(services: dict[str, Any]) -> None:
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), (name, port)


# --- commands: console scripts, flags the services' own parsers accept ---------------------------
def test_each_service_command_is_a_console_script_with_flags_it_accepts(
        services: dict[str, Any]) -> None:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    expected = {"job-store": "fedhive_services.job_store.main:main",
                "scheduler": "fedhive_services.scheduler.main:main",
                "job-runner": "fedhive_services.job_runner.main:main",
                "gateway": "fedhive_services.gateway.main:main",
                "site-1": "fedhive_services.site_agent.main:main",
                "site-2": "fedhive_services.site_agent.main:main"}
    for name, entry_point in expected.items():
        command = services[name]["command"]
        assert scripts[command[0]] == entry_point, name

    assert services["job-store"]["command"] == ["fedhive-job-store"]  # it takes no options
    scheduler_args(services["scheduler"]["command"][1:])
    runner = runner_args(services["job-runner"]["command"][1:]).runner
    assert runner.holder == "job-runner"
    assert mounts(services["job-runner"])[str(runner.work_dir)] == "runner-work"
    gateway = parse_options(services["gateway"]["command"][1:])
    assert mounts(services["gateway"]) == {str(gateway.admins.parent): "gateway-config"}
    assert services["gateway"]["volumes"][0].endswith(":ro")
    assert services["gateway"]["ports"] == ["127.0.0.1:${FEDHIVE_GATEWAY_PORT:-50051}:"
                                            f"{gateway.listen.rsplit(':', 1)[1]}"]
    for site in SITES:
        args = site_agent_args(services[site]["command"][1:])
        assert args.command == "run"
        assert mounts(services[site]) == {str(args.site_dir): site}  # its own folder only


def test_the_one_shots_set_up_what_the_services_read(services: dict[str, Any]) -> None:
    users = broker_setup.parse_args(script_args(services["broker-users"]["command"],
                                                "broker_setup.py"))
    assert set(users.sites) == SITES
    assert users.management_url == "http://rabbitmq:15672"
    for site in SITES:
        site_dir = str(users.sites_root / site)
        assert mounts(services["broker-users"])[site_dir] == site
        assert str(site_agent_args(services[site]["command"][1:]).site_dir) == site_dir
    assert services["broker-users"]["user"] == "root"  # the site volumes start owned by root

    admins = admins_file.parse_args(script_args(services["admins"]["command"], "admins_file.py"))
    assert admins.role is Role.PROJECT_ADMIN
    gateway = parse_options(services["gateway"]["command"][1:])
    assert admins.out == gateway.admins
    assert mounts(services["admins"]) == {str(admins.out.parent): "gateway-config"}


def test_health_checks_read_each_services_own_readiness_file(
        services: dict[str, Any], example: dict[str, str]) -> None:
    written = {"job-store": "fedhive-job-store", "scheduler": scheduler_main.SERVICE,
               "job-runner": runner_main.SERVICE, "gateway": "gateway"}  # what main() runs as
    for name in SERVICES | SITES:
        test = services[name]["healthcheck"]["test"]
        assert test[0] == "CMD"
        args = healthcheck.parse_args(script_args(test[1:], "healthcheck.py"))
        assert args.probe == "ready" and args.file is None, name
        writer = written.get(name, site_agent_main.SERVICE)
        env = environment(services[name], example)
        settings = Settings.from_env(env)
        assert (ReadyConfig.for_service(args.service, settings).path
                == ReadyConfig.for_service(writer, settings).path == default_path(writer)), name


# --- environment: names fedhive.config reads, least privilege, no secrets -----------------------
def test_service_environments_use_only_names_fedhive_config_reads(
        services: dict[str, Any]) -> None:
    assert {"FEDHIVE_AMQP_URL", "FEDHIVE_REDIS_URL", "AWS_ACCESS_KEY_ID"} <= SETTING_NAMES
    for name in SERVICES | SITES:
        assert set(services[name]["environment"]) <= SETTING_NAMES, name
        assert "env_file" not in services[name], name
    own = {"broker-users": ({"RABBITMQ_USER", "RABBITMQ_PASSWORD", "RABBITMQ_SERVICES_PASSWORD"},
                            "broker_setup.py"),
           "admins": ({"FEDHIVE_TOKEN"}, "admins_file.py")}
    for name, (names, script) in own.items():
        assert set(services[name]["environment"]) <= SETTING_NAMES | names
        source = (SCRIPTS / script).read_text()
        assert all(f'"{variable}"' in source for variable in names), script


def test_each_service_environment_is_valid_settings_for_the_compose_network(
        services: dict[str, Any], example: dict[str, str]) -> None:
    service_user = broker_setup.parse_args(
        script_args(services["broker-users"]["command"], "broker_setup.py")).service_user
    for name, uses in USES.items():
        env = environment(services[name], example)
        settings = Settings.from_env(env)
        amqp = pika.URLParameters(settings.amqp_url)
        assert (amqp.host, amqp.credentials.username) == ("rabbitmq", service_user)
        assert amqp.credentials.password == example["RABBITMQ_SERVICES_PASSWORD"]
        assert ("FEDHIVE_REDIS_URL" in env) == ("redis" in uses), name
        assert bool(S3_NAMES & set(env)) == ("s3" in uses), name
        if "redis" in uses:
            assert urlsplit(settings.redis_url).hostname == "redis"
            assert urlsplit(settings.redis_url).password == example["REDIS_PASSWORD"]
        if "s3" in uses:
            assert settings.s3_endpoint_url == "http://minio:9000"
            assert settings.aws_access_key_id == example["MINIO_ROOT_USER"]
            assert settings.s3_bucket == example["FEDHIVE_S3_BUCKET"]
        assert settings.namespace == example.get("FEDHIVE_NAMESPACE", "fedhive")
    broker_env = Settings.from_env(environment(services["broker-users"], example))
    assert urlsplit(broker_env.amqp_url).hostname == "rabbitmq"
    assert urlsplit(broker_env.amqp_url).username is None  # each site gets its own user


def test_site_agents_get_no_redis_s3_or_services_credentials(
        services: dict[str, Any], example: dict[str, str]) -> None:
    for site in SITES:
        agent = services[site]
        assert set(agent["environment"]) == {"FEDHIVE_LOG_LEVEL", "FEDHIVE_INLINE_THRESHOLD"}
        text = json.dumps(agent)
        for secret in ("REDIS", "MINIO", "AWS_", "RABBITMQ", "S3", "AMQP", "TOKEN"):
            assert secret not in text, (site, secret)
        assert "env_file" not in agent and "secrets" not in agent


def test_the_compose_file_holds_no_literal_secret(services: dict[str, Any],
                                                  example: dict[str, str]) -> None:
    text = COMPOSE_FILE.read_text()
    for key, value in env_file(ENV_EXAMPLE).items():
        if any(word in key for word in ("PASSWORD", "TOKEN")) and value:
            assert value not in text, key
    secret_key = re.compile(r"PASS|SECRET|TOKEN|_KEY")
    for name, service in services.items():
        for key, value in (service.get("environment") or {}).items():
            value = str(value)
            if secret_key.search(key):
                assert _VAR.fullmatch(value), (name, key)
            parts = urlsplit(value)
            if "://" in value and parts.password is not None:
                assert _VAR.fullmatch(parts.password), (name, key)
    assert services["redis"]["command"][-1] == "${REDIS_PASSWORD:?set REDIS_PASSWORD}"


def test_every_variable_is_defined_in_the_env_example_and_the_env_file_is_ignored() -> None:
    used = {match.group(1) for match in _VAR.finditer(COMPOSE_FILE.read_text())}
    defined = set(env_file(ENV_EXAMPLE))
    assert used <= defined, sorted(used - defined)
    assert "deploy/compose.env" in (ROOT / ".gitignore").read_text().splitlines()


# --- the Dockerfile and its build context -------------------------------------------------------
def dockerfile_lines() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments left out."""
    text = re.sub(r"\\\n", "", DOCKERFILE.read_text())
    return [line.strip() for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_dockerfile_builds_the_wheel_and_installs_it_as_a_non_root_user() -> None:
    lines = dockerfile_lines()
    stages = [index for index, line in enumerate(lines) if line.startswith("FROM ")]
    assert len(stages) == 2 and all(re.match(r"FROM python:3\.1[1-9]-slim", lines[index])
                                    for index in stages)
    build, image = lines[:stages[1]], lines[stages[1]:]
    name = lines[0].split()[-1]  # FROM ... AS NAME
    # The build stage makes the wheel as `make wheel` does, from what the wheel holds.
    for source in ("pyproject.toml setup.py MANIFEST.in README.md ./", "libs/ libs/",
                   "services/ services/", "examples/ examples/"):
        assert f"COPY {source}" in build
    assert "RUN pip wheel --no-deps --wheel-dir /dist ." in build
    # The image installs that wheel with its extras, never the source tree.
    assert f"COPY --from={name} /dist/ /tmp/dist/" in image
    assert any(re.search(r'pip install "\$wheel\$\{EXTRAS:\+\[\$EXTRAS\]\}"', line)
               for line in image)
    assert not any(re.search(r"pip install \.( |$)", line) for line in lines)
    assert not any(line.startswith(("COPY libs", "COPY services")) for line in image)
    assert f"COPY deploy/compose/ {IMAGE_SCRIPTS}" in image
    users = [line.split()[1] for line in image if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    assert not any(re.match(r"(ENV|ARG)\s+\S*(PASSWORD|SECRET|TOKEN)", line) for line in lines)


def test_the_image_gets_the_torch_extra_with_cpu_torch_at_the_pinned_version() -> None:
    """The dependency layer's requirements are what pyproject.toml gives the core and EXTRAS
    (the Dockerfile's own Python run here), torch pinned, from the CPU wheel index."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pin = next(r for r in project["optional-dependencies"]["torch"] if r.startswith("torch=="))
    lines = dockerfile_lines()
    extras = next(re.fullmatch(r'ARG EXTRAS="([^"]*)"', line) for line in lines
                  if line.startswith("ARG EXTRAS="))
    assert extras is not None and extras.group(1).split(",") == ["torch"]
    run = next(line for line in lines if line.startswith('RUN python -c "'))
    code, _, rest = run.removeprefix('RUN python -c "').partition('" > /tmp/requirements.txt')
    assert "pip install --extra-index-url https://download.pytorch.org/whl/cpu -r " \
           "/tmp/requirements.txt" in rest
    code = code.replace("/tmp/pyproject.toml", str(ROOT / "pyproject.toml"))
    for chosen, expected in (("torch", [*project["dependencies"], pin, "scikit-learn>=1.4"]),
                             ("", project["dependencies"])):
        done = subprocess.run([sys.executable, "-c", code], env={**os.environ, "EXTRAS": chosen},
                              capture_output=True, text=True, timeout=30, check=True)
        assert done.stdout.split() == expected


def test_the_build_context_is_only_what_the_dockerfile_copies() -> None:
    patterns = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]
    assert patterns[0] == "*"  # everything else (.venv, deploy/compose.env, ...) stays out
    included = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = set()
    for line in dockerfile_lines():
        if line.startswith("COPY ") and not line.startswith("COPY --from="):  # not a stage's
            copied |= {source.rstrip("/") for source in line.split()[1:-1]}
    assert copied == included
    assert not any(path.startswith(("deploy/compose.env", ".venv", "deploy/sites"))
                   for path in included)
    assert (ROOT / "libs" / "fedhive" / "proto" / "v1" / "admin_pb2.py").is_file()  # committed


# --- deploy/cloud templates --------------------------------------------------------------------
CLOUD_ROLES = {"job-store": {"amqp", "redis", "s3"}, "scheduler": {"amqp", "redis"},
               "job-runner": {"amqp", "redis", "s3"}, "gateway": {"amqp", "s3"}}


def test_the_cloud_templates_set_only_real_settings_over_tls() -> None:
    for role, uses in CLOUD_ROLES.items():
        path = CLOUD / f"{role}.env.example"
        values = env_file(path)
        commented = set(re.findall(r"^# ([A-Z][A-Z0-9_]+)=", path.read_text(), re.MULTILINE))
        assert set(values) | commented <= SETTING_NAMES, role
        settings = Settings.from_env(values)
        assert settings.amqp_tls, role
        assert ("FEDHIVE_REDIS_URL" in values) == ("redis" in uses), role
        if "redis" in uses:
            assert settings.redis_url.startswith("rediss://"), role
        assert bool(S3_NAMES & (set(values) | commented)) == ("s3" in uses), role
        if "s3" in uses:
            assert settings.s3_endpoint_url is None and values["AWS_REGION"]


def test_the_cloud_site_template_is_a_valid_site_json(tmp_path: Path) -> None:
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "site.json").write_text((CLOUD / "site.json.example").read_text())
    config = load_site(tmp_path)
    assert config.broker_url.startswith("amqps://")
    assert pika.URLParameters(config.broker_url).credentials.username == \
        Names(config.namespace).site_user(config.site)
    assert config.storage_url.startswith("https://")


def test_the_s3_policy_is_limited_to_one_bucket() -> None:
    policy = json.loads((CLOUD / "s3-policy.json").read_text())
    resources = {statement["Resource"] for statement in policy["Statement"]}
    bucket = "arn:aws:s3:::replace-with-your-bucket"
    assert resources == {bucket, f"{bucket}/*"}
    actions = {action for statement in policy["Statement"] for action in statement["Action"]}
    assert {"s3:ListBucket", "s3:GetObject", "s3:PutObject", "s3:DeleteObject"} <= actions
    assert all(statement["Effect"] == "Allow" and "*" not in "".join(statement["Action"])
               for statement in policy["Statement"])
