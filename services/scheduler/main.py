"""`fedhive-scheduler`: decides when a job may run."""

from fedhive.service import usage_only


def main() -> None:
    usage_only("fedhive-scheduler", "fedhive scheduler: decides when a job may run.", issue=6)
