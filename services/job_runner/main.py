"""`fedhive-job-runner`: deploys, starts, monitors and finishes jobs."""

from fedhive.service import usage_only


def main() -> None:
    usage_only(
        "fedhive-job-runner",
        "fedhive job-runner: deploys, starts, monitors and finishes jobs.",
        issue=6,
    )
