"""`fedhive simulate`, the real command in a subprocess with no broker, Redis or S3 settings:
every example job runs to its result (hello-pt: in tests/e2e/test_fl_jobs.py, against its
deployment), a failing site ends the job as a deployment would
(tests/e2e/test_fl_jobs.py compares the two on the same jobs), `-t` makes sites take turns,
Ctrl-C aborts, and input that does not fit is refused before anything is written."""

from __future__ import annotations

import io
import itertools
import json
import signal
import subprocess
import sys
import textwrap
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from fedhive.jobs.status import JobStatus
from tests.fixtures.fl_jobs import sag_job
from tests.fixtures.hello_large import hello_large
from tests.fixtures.infra import wait_for
from tests.fixtures.simulate import FEDHIVE, env, rounds, simulate

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
S = JobStatus


def test_hello_numpy_runs_on_n_sites_and_leaves_what_download_gives(tmp_path: Path) -> None:
    job, result = simulate(EXAMPLES / "hello-numpy", tmp_path, "-n", "3")
    assert job["status"] == S.FINISHED_COMPLETED.value
    assert job["sites"] == ["site-1", "site-2", "site-3"] and job["failed_sites"] == []
    assert [h["to"] for h in job["history"]] == [
        "SUBMITTED", "DISPATCHED", "RUNNING", "FINISHED:COMPLETED"]
    reports = rounds(result)
    assert [r["round"] for r in reports] == [0, 1, 2]
    # min_clients 2, no wait after it: each round uses the first two results
    assert all(len(set(r["metrics"]["sites"]) & {"site-1", "site-2", "site-3"}) >= 2
               for r in reports)
    with np.load(io.BytesIO(result["model.npz"])) as model:  # 1..9, +1 a round
        np.testing.assert_array_equal(model["weights"],
                                      np.arange(1, 10, dtype=np.float64).reshape(3, 3) + 3)
    folder = Path(job["folder"])
    with zipfile.ZipFile(folder / "job.zip") as archive:
        assert "app/custom/np_trainer.py" in archive.namelist()
    assert (folder / "site-3" / "app" / "config" / "config_fed_client.json").is_file()
    assert '"site": "site-2"' in (folder / "site-2" / "client_job.log").read_text()
    assert "server_job.round_completed" in result["server_job.log"].decode()
    assert not (folder / ".blobs").exists()  # the run's objects go with it


def test_cyclic_and_cross_site_eval_run(tmp_path: Path) -> None:
    job, result = simulate(EXAMPLES / "cyclic-numpy", tmp_path, "-n", "2")
    assert job["status"] == S.FINISHED_COMPLETED.value and len(rounds(result)) == 3
    job, result = simulate(EXAMPLES / "cross-site-eval", tmp_path, "--sites", "a-1,b-2")
    assert job["status"] == S.FINISHED_COMPLETED.value
    table = json.loads(result["cross_val_results.json"] if "cross_val_results.json" in result
                       else next(data for name, data in result.items()
                                 if name.endswith("cross_val_results.json")))
    assert {"a-1", "b-2"} <= set(table)
    assert all(set(validators) == {"a-1", "b-2"} for validators in table.values())


def test_hello_large_streams_through_the_local_store(tmp_path: Path) -> None:
    archive = tmp_path / "hello-large.zip"
    archive.write_bytes(hello_large(sites=2, size_mib=16, tensors=4, rounds=2,
                                    frozen_fraction=0.5))  # 4 MiB tensors: not inline
    job, result = simulate(archive, tmp_path / "ws", "-n", "2")
    assert job["status"] == S.FINISHED_COMPLETED.value, job["status_reason"]
    # as in tests/e2e/test_large_model.py: round 1 downloaded only the trained half, reused
    # the frozen half the trainer held, and round 0 uploaded the trained half only
    half = 8 * 1024 * 1024
    for site, counted in rounds(result)[1]["metrics"]["sites"].items():
        assert (counted["bytes_downloaded"], counted["bytes_reused"],
                counted["bytes_uploaded"]) == (half, half, half), site


def test_a_site_whose_code_raises_fails_the_job_naming_it(tmp_path: Path) -> None:
    strict = sag_job(tmp_path, "strict", sites=[], min_clients=2, ignore_result_error=False,
                     fail_sites=("site-2",))
    job, _ = simulate(strict, tmp_path / "ws", "-n", "2")
    assert job["status"] == S.FINISHED_EXECUTION_EXCEPTION.value
    assert "site-2" in job["status_reason"] and "no data at" in job["status_reason"]

    lenient = sag_job(tmp_path, "lenient", sites=[], min_clients=2, ignore_result_error=True,
                      fail_sites=("site-2",))
    job, result = simulate(lenient, tmp_path / "ws", "-n", "2")
    assert job["status"] == S.FINISHED_COMPLETED.value
    assert all(set(r["metrics"]["sites"]) == {"site-1"} for r in rounds(result))


def test_a_site_whose_executors_do_not_build_leaves_the_job(tmp_path: Path) -> None:
    folder = sag_job(tmp_path, "bad-executor", sites=[], min_clients=2, seconds=-1)
    job, _ = simulate(folder, tmp_path / "ws", "-n", "2")
    assert job["status"] == S.FINISHED_EXECUTION_EXCEPTION.value
    assert job["failed_sites"] == ["site-1", "site-2"]
    gone = job["site_states"]["site-1"]["gone"]
    assert "client job could not start" in gone and "seconds must be" in gone


def test_threads_make_sites_take_turns(tmp_path: Path) -> None:
    trace = tmp_path / "trace.txt"
    folder = sag_job(tmp_path, "turns", sites=[], min_clients=3, num_rounds=1, seconds=0.3,
                     trace=trace)
    job, _ = simulate(folder, tmp_path / "ws", "-n", "3", "-t", "1")
    assert job["status"] == S.FINISHED_COMPLETED.value
    spans = sorted((float(start), float(end))
                   for _, start, end in (line.split() for line in trace.read_text().splitlines()))
    assert len(spans) == 3
    assert all(earlier[1] <= later[0] for earlier, later in itertools.pairwise(spans))


def test_ctrl_c_aborts_the_job_and_still_writes_its_files(tmp_path: Path) -> None:
    folder = sag_job(tmp_path, "slow", sites=[], min_clients=2, num_rounds=1, seconds=60)
    proc = subprocess.Popen([FEDHIVE, "simulate", str(folder), "-n", "2", "--workspace",
                             str(tmp_path / "ws"), "--json"], env=env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any("task.scheduled" in path.read_text()
                             for path in (tmp_path / "ws").glob("*/server/workspace/*.log")),
                 timeout=30, what="a task running")
        time.sleep(0.5)
        started = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert time.monotonic() - started < 30  # the 60 s task was stopped
    job = json.loads(out.strip().splitlines()[-1])
    assert job["status"] == S.FINISHED_ABORTED.value
    assert Path(job["files"][1]).is_file()


@pytest.mark.parametrize(("args", "words"), [
    (("-n", "1"), "min_clients is 2"),
    ((), "deploys to @ALL"),
    (("--sites", "a,a"), "a named twice"),
])
def test_options_that_do_not_fit_the_job_are_refused_before_anything_runs(
        tmp_path: Path, args: tuple[str, ...], words: str) -> None:
    done = subprocess.run([FEDHIVE, "simulate", str(EXAMPLES / "hello-numpy"), "--workspace",
                           str(tmp_path / "ws"), *args], env=env(), capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert words in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "ws").exists()


def test_an_invalid_job_lists_its_violations(tmp_path: Path) -> None:
    folder = sag_job(tmp_path, "bad", sites=[], min_clients=2)
    (folder / "meta.json").write_text(json.dumps({"name": "bad", "deploy_map": {"nope": []}}))
    done = subprocess.run([FEDHIVE, "simulate", str(folder), "-n", "2", "--workspace",
                           str(tmp_path / "ws")], env=env(), capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 2 and "nope" in done.stderr
    assert not (tmp_path / "ws").exists()


def test_a_site_failing_before_the_server_side_serves_still_leaves_the_job(
        tmp_path: Path) -> None:
    """The server side and the sites start at once: a site whose executors do not build may
    send its WorkerExit before the server's queue exists (a CI run hung on it). It is retried
    until the server side serves. The server side held back half a second, in a process of
    its own (a simulation configures the process's logging)."""
    script = textwrap.dedent("""
        import json, sys, time
        from pathlib import Path
        from fedhive.simulate import run
        serve_app = run.serve_app
        def late(*args):
            time.sleep(0.5)
            return serve_app(*args)
        run.serve_app = late
        done = run.simulate(Path(sys.argv[1]), run.Options(num_sites=2,
                                                           workspace=Path(sys.argv[2])))
        print(json.dumps([done.record.status.value, done.record.failed_sites]))
    """)
    folder = sag_job(tmp_path, "bad-executor", sites=[], min_clients=2, seconds=-1)
    done = subprocess.run([sys.executable, "-c", script, str(folder), str(tmp_path / "ws")],
                          env=env(), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    status, failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert (status, failed) == (S.FINISHED_EXECUTION_EXCEPTION.value, ["site-1", "site-2"])
