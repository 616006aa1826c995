"""What every service's `main()` shares before its own issue gives it a loop: a usage line."""

from __future__ import annotations

import argparse


def usage_only(command: str, summary: str, issue: int) -> None:
    """Print usage and exit 2: the service's main loop arrives with issue `issue`."""
    parser = argparse.ArgumentParser(prog=command, description=summary)
    parser.parse_args()
    parser.print_usage()
    parser.exit(2, f"{command}: not runnable yet; its main loop arrives with issue #{issue}\n")
