"""Runs a real client job (fedhive_services.site_agent.client_job) with instruments, for the
client-API tests: `python -m tests.integration.client_api_probe OUT.jsonl -- CLIENT_JOB_ARGS`.

It appends one JSON line to OUT.jsonl for every
* frame the client job writes to or reads from a trainer's pipe: its direction, kind, size in
  bytes and, for tasks and results, each tensor ref (inline or key, URL or not, length);
* TCP connection the process opens (an audit hook on `socket.connect`);
* boto/botocore client the process creates (there must be none: the CJ holds no S3 client);
each line also carries the process's peak RSS so far (`peak_rss_kb`).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from typing import Any

_lock = threading.Lock()
_out_path = sys.argv[1]


def peak_rss_kb() -> int:
    """VmHWM: this process's own peak (ru_maxrss would include the parent's, across exec)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0


def record(**entry: Any) -> None:
    entry["peak_rss_kb"] = peak_rss_kb()
    line = json.dumps(entry)
    with _lock, open(_out_path, "a") as out:
        out.write(line + "\n")


def audit(event: str, args: tuple[Any, ...]) -> None:
    if event == "socket.connect":
        sock, address = args
        if getattr(sock, "family", None) in (socket.AF_INET, socket.AF_INET6):
            record(what="connect", address=list(address)[:2])


def refs(dxo: Any) -> list[dict[str, Any]]:
    return [{"name": t.name, "inline": not t.key, "key": t.key, "url": bool(t.url),
             "length": t.length, "inline_bytes": len(t.inline_data)} for t in dxo.tensors]


def instrument() -> None:
    import botocore.session

    from fedhive.client import pipe

    send, recv = pipe.Pipe.send, pipe.Pipe.recv

    def frame(direction: str, message: Any) -> None:
        kind = message.WhichOneof("body")
        entry: dict[str, Any] = {"what": "frame", "direction": direction, "kind": kind,
                                 "bytes": message.ByteSize()}
        if kind == "task":
            entry["refs"] = refs(message.task.data)
        elif kind == "result":
            entry["refs"] = refs(message.result.data)
        record(**entry)

    def spy_send(self: Any, message: Any) -> None:
        frame("to_trainer", message)
        send(self, message)

    def spy_recv(self: Any) -> Any:
        message = recv(self)
        if message is not None:
            frame("from_trainer", message)
        return message

    pipe.Pipe.send = spy_send  # type: ignore[method-assign]
    pipe.Pipe.recv = spy_recv  # type: ignore[method-assign]
    create_client = botocore.session.Session.create_client

    def spy_client(self: Any, *args: Any, **kwargs: Any) -> Any:
        record(what="s3_client", args=[str(a) for a in args])
        return create_client(self, *args, **kwargs)

    botocore.session.Session.create_client = spy_client  # type: ignore[method-assign]


def main() -> None:
    argv = sys.argv[sys.argv.index("--") + 1:]
    sys.addaudithook(audit)
    instrument()
    from fedhive_services.site_agent import client_job

    record(what="started")
    client_job.main(argv)


if __name__ == "__main__":
    main()
