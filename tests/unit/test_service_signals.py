"""`fedhive.service.run` stops on a SIGTERM whichever thread the kernel hands it to (a fenced
job-runner signals itself from its lease thread; seen in CI: a runner that never stopped)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

SERVICE = textwrap.dedent("""
    import os, signal, threading, time
    from fedhive.service import run

    class Idle:
        def ready_checks(self):
            return []

        def close(self):
            print("closed", flush=True)

    def later():
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)

    def build(settings, log):
        threading.Thread(target=later).start()  # started unmasked: it may take the signal
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})  # the main thread will not
        return Idle()

    run("test-service", build)
""")


def test_a_sigterm_taken_by_another_thread_stops_the_service(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SERVICE], capture_output=True, text=True,
                          timeout=30, env={"FEDHIVE_READY_FILE": str(tmp_path / "ready")},
                          check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "closed\n"
