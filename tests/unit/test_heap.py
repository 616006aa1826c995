"""fedhive.heap: with the heap bounded, tensor-sized blocks that threads free go back to the
system instead of staying in glibc's per-thread heaps; every service bounds it as it starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fedhive import heap, service
from fedhive.config import Settings
from fedhive.errors import InvalidArgument

pytestmark = pytest.mark.skipif(heap._LIBC is None or not sys.platform.startswith("linux"),
                                reason="glibc's malloc on Linux")

# What a service's transfer threads do: 8 threads, each allocating and freeing 8 MiB blocks
# (boto3's multipart parts); prints how many MiB the process's RSS grew.
CHURN = """
import sys, threading
from fedhive import heap
if sys.argv[1] == "bounded":
    heap.bound_heap()

def rss_mib():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS:"))

def churn():  # a part read as bytes, then copied: two blocks of slightly different sizes
    for _ in range(6):
        part = bytes(8 << 20)
        block = bytearray(part)
        del part, block

before = rss_mib()
threads = [threading.Thread(target=churn) for _ in range(8)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
print(rss_mib() - before)
"""


def _growth_mib(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", CHURN, mode], capture_output=True, text=True,
                          check=True, timeout=120)
    return int(done.stdout)


def test_freed_blocks_of_threads_go_back_to_the_system_once_the_heap_is_bounded() -> None:
    # the premise: by default glibc's threshold rises after the first free, and the blocks then
    # stay in the threads' heaps
    assert _growth_mib("default") >= 24, "glibc returns these blocks by itself now: revisit heap"
    assert _growth_mib("bounded") < 16


def test_release_memory_trims_the_heap() -> None:
    assert heap.release_memory() is True


def test_a_service_bounds_the_heap_before_it_builds_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setattr(service, "bound_heap", lambda: calls.append("bound_heap"))

    def build(settings: Settings, log: object) -> service.Closeable:
        calls.append("build")
        raise InvalidArgument("no such thing", field="thing")

    with pytest.raises(SystemExit) as exited:
        service.run("test-service", build, settings=Settings())
    assert exited.value.code == 2
    assert calls == ["bound_heap", "build"]
