"""`fedhive-job-store`: job definitions, validation, status history."""

from fedhive.service import usage_only


def main() -> None:
    usage_only(
        "fedhive-job-store",
        "fedhive job-store: job definitions, validation, status history.",
        issue=4,
    )
