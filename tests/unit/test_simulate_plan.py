"""Which sites `fedhive simulate` runs and the app each gets: the deploy map applied to the
simulated sites; names that do not fit the job are refused before anything runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedhive.errors import InvalidArgument
from fedhive.jobs.definition import JobDefinition, load_job
from fedhive.simulate import plan
from tests.unit.test_jobs_validation import BASE_META, write_job


def job(tmp_path: Path, **meta: object) -> JobDefinition:
    return load_job(write_job(tmp_path / "job", {**BASE_META, **meta}))


def everywhere(tmp_path: Path, **meta: object) -> JobDefinition:
    return load_job(write_job(tmp_path / "all", {**BASE_META, "deploy_map": {"app": ["@ALL"]},
                                                  "resource_spec": {}, "mandatory_clients": [],
                                                  **meta}, {"app": "both"}))


def test_n_sites_are_named_site_1_to_n_and_all_get_the_at_all_app(tmp_path: Path) -> None:
    chosen = plan(everywhere(tmp_path), num_sites=3)
    assert chosen.sites == ["site-1", "site-2", "site-3"]
    assert chosen.apps == {"server": "app", "site-1": "app", "site-2": "app", "site-3": "app"}
    assert chosen.server_app == "app"


def test_named_sites_keep_their_order_and_a_job_naming_its_sites_runs_on_them(
        tmp_path: Path) -> None:
    assert plan(everywhere(tmp_path), names=["b", "a"]).sites == ["b", "a"]
    named = plan(job(tmp_path))
    assert named.sites == ["site-1", "site-2"]
    assert named.apps == {"server": "srv", "site-1": "cli", "site-2": "cli"}


@pytest.mark.parametrize(("meta", "options", "field", "words"), [
    ({}, {"num_sites": 3}, "deploy_map", "site 'site-3'"),
    ({}, {"names": ["site-2", "other"]}, "deploy_map", "'other'"),
    ({"min_clients": 2, "mandatory_clients": []}, {"names": ["site-1"]}, "min_clients",
     "min_clients is 2"),
    ({"min_clients": 1}, {"names": ["site-2"]}, "mandatory_clients", "site-1"),
])
def test_sites_that_do_not_fit_the_job_are_refused_naming_the_field(
        tmp_path: Path, meta: dict[str, object], options: dict[str, object], field: str,
        words: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        plan(job(tmp_path, **meta), **options)  # type: ignore[arg-type]
    assert caught.value.field == field and words in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(("options", "field", "words"), [
    ({}, "num_sites", "deploys to @ALL"),
    ({"num_sites": 0}, "num_sites", "at least 1"),
    ({"num_sites": 3, "names": ["a", "b"]}, "num_sites", "2 site names"),
    ({"names": ["a", "a"]}, "sites", "a named twice"),
    ({"names": ["server"]}, "sites", "reserved"),
    ({"names": ["no.dots"]}, "sites", "invalid site name"),
])
def test_bad_site_options_are_refused_in_one_line(tmp_path: Path, options: dict[str, object],
                                                 field: str, words: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        plan(everywhere(tmp_path, min_clients=1), **options)  # type: ignore[arg-type]
    assert caught.value.field == field and words in str(caught.value)
