"""`fedhive-gateway`: gRPC admin gateway."""

from fedhive.service import usage_only


def main() -> None:
    usage_only("fedhive-gateway", "fedhive gateway: gRPC admin gateway.", issue=4)
