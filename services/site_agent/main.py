"""`fedhive-site-agent`: one site: resources, heartbeats, client jobs."""

from fedhive.service import usage_only


def main() -> None:
    usage_only(
        "fedhive-site-agent",
        "fedhive site-agent: one site: resources, heartbeats, client jobs.",
        issue=5,
    )
