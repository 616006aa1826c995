"""`rabbitmqctl eval` that read nothing from stdin is run again (nothing was evaluated); any
other failure is reported once, with the tool's last line."""

from pathlib import Path

import pytest

from fedhive.brokerusers import create_users, site_user
from fedhive.errors import FedhiveError

UNREAD = "Error: Expression to evaluate is not provided via argument or stdin"


def fake_ctl(tmp_path: Path, answers: list[str]) -> tuple[str, Path]:
    """A rabbitmqctl stand-in that gives `answers[n]` on its n-th call ("ok" is success; other
    text goes to stderr with exit 64) and counts its calls in a file."""
    calls = tmp_path / "calls"
    calls.write_text("")
    script = tmp_path / "ctl"
    cases = "\n".join(f'  {n}) echo "{a}" {">&2; exit 64" if a != "ok" else ""};;'
                      for n, a in enumerate(answers))
    script.write_text(f"""#!/bin/bash
cat >/dev/null
n=$(wc -c < {calls}); echo -n x >> {calls}
case $n in
{cases}
esac
""")
    script.chmod(0o755)
    return str(script), calls


def test_an_eval_that_read_nothing_is_run_again(tmp_path: Path) -> None:
    ctl, calls = fake_ctl(tmp_path, [UNREAD, "ok"])
    create_users([site_user("ns", "site-1")], "/", (ctl,), namespace="ns")
    assert calls.read_text() == "xx"


def test_other_failures_are_reported_at_once(tmp_path: Path) -> None:
    ctl, calls = fake_ctl(tmp_path, ["Error: unable to perform an operation on node", "ok"])
    with pytest.raises(FedhiveError, match="eval failed: Error: unable to perform"):
        create_users([site_user("ns", "site-1")], "/", (ctl,), namespace="ns")
    assert calls.read_text() == "x"


def test_an_eval_that_never_reads_fails_after_three_tries(tmp_path: Path) -> None:
    ctl, calls = fake_ctl(tmp_path, [UNREAD] * 4)
    with pytest.raises(FedhiveError, match="not provided via argument or stdin"):
        create_users([site_user("ns", "site-1")], "/", (ctl,), namespace="ns")
    assert calls.read_text() == "xxx"
