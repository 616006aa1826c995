"""The pure pieces of shared job logs (`fedhive.joblogs`): clipping, error lines, reading a
growing file in batches from a saved position, verifying a site's batch, the CLI's lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedhive.cli.logs import as_json_line, plain, private_note
from fedhive.errors import MalformedMessage, PermissionDenied
from fedhive.joblogs import intake
from fedhive.joblogs.lines import Line, TracebackState, clip_line, error_summary, is_json_error
from fedhive.joblogs.tail import Batch, Position, read_batch
from fedhive.joblogs.wire import LogEntry, batch_to_proto, entry_from_proto, entry_to_proto
from fedhive.names import Names
from fedhive.proto.v1 import site_pb2

TRACEBACK = [
    "starting at site-1",
    "Traceback (most recent call last):",
    '  File "custom/train.py", line 3, in <module>',
    '    raise RuntimeError("boom at site-1")',
    "    ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
    "RuntimeError: boom at site-1",
    "after",
]


# lines --------------------------------------------------------------------------------------
def test_a_line_is_clipped_and_says_how_much_was_left_out() -> None:
    assert clip_line(b"short\r") == "short"
    assert clip_line("é".encode() * 3, limit=5) == "éé [... 1 bytes clipped]"
    assert clip_line(b"\xff ok") == "\ufffd ok"


def test_error_lines_structlog_and_traceback_ends() -> None:
    state = TracebackState()
    assert [state.classify(text) for text in TRACEBACK] == [False] * 5 + [True, False]
    assert not state.inside
    assert is_json_error('{"event": "x", "level": "error"}')
    assert is_json_error('{"level":"CRITICAL","event": "x"... clipped')
    assert not is_json_error('{"event": "x", "level": "warning"}')
    assert not is_json_error('prefix {"level": "error"}')


def test_a_traceback_split_across_reads_is_still_recognised() -> None:
    first = TracebackState()
    for text in TRACEBACK[:3]:
        first.classify(text)
    assert first.inside
    again = TracebackState(inside=first.inside)  # what a saved position keeps
    assert [again.classify(text) for text in TRACEBACK[3:6]] == [False, False, True]


def test_error_summary() -> None:
    assert error_summary(json.dumps({"event": "worker.executor_failed", "level": "error",
                                     "error": "no data"})) == "worker.executor_failed: no data"
    exc = json.dumps({"event": "failed", "level": "error",
                      "exception": "Traceback ...\n  File x\nValueError: bad\n"})
    assert error_summary(exc) == "failed: ValueError: bad"
    assert error_summary("RuntimeError:   boom\tthere") == "RuntimeError: boom there"
    assert len(error_summary("x" * 2000)) == 500


# tail ---------------------------------------------------------------------------------------
def write(path: Path, text: str | bytes) -> None:
    with path.open("ab") as out:
        out.write(text.encode() if isinstance(text, str) else text)


def texts(batch: Batch) -> list[str]:
    return [line.text for line in batch.lines]


def test_complete_lines_only_until_the_writer_ends(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    assert read_batch(log, Position()).drained  # no file yet
    write(log, "one\ntwo\nthr")
    batch = read_batch(log, Position())
    assert texts(batch) == ["one", "two"] and batch.drained
    assert [line.end for line in batch.lines] == [4, 8]
    assert batch.after == Position(8)
    write(log, "ee\nfour")
    batch = read_batch(log, batch.after)
    assert texts(batch) == ["three"] and batch.start == 8
    final = read_batch(log, batch.after, final=True)
    assert texts(final) == ["four"] and final.after.offset == log.stat().st_size
    assert read_batch(log, final.after, final=True).lines == ()


def test_batches_are_bounded_and_resume_from_their_position(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    write(log, "".join(f"line {i:03d}\n" for i in range(100)))  # 9 bytes a line
    seen: list[str] = []
    at = Position()
    while True:
        batch = read_batch(log, at, max_bytes=100)
        assert batch.size <= 100
        seen += texts(batch)
        at = batch.after
        if batch.drained:
            break
    assert seen == [f"line {i:03d}" for i in range(100)]


def test_a_batch_holds_a_bounded_number_of_lines(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    write(log, "\n" * 10 + "last")
    first = read_batch(log, Position(), max_lines=4, final=True)
    assert texts(first) == [""] * 4 and first.after == Position(4) and not first.drained
    rest = read_batch(log, first.after, max_lines=7, final=True)
    assert texts(rest) == [""] * 6 + ["last"] and rest.drained


def test_an_over_long_line_is_clipped_once_and_its_rest_skipped(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    write(log, "a" * 50)  # no newline yet, already past a line's size
    batch = read_batch(log, Position(), max_line=10)
    assert texts(batch) == ["a" * 10 + " [... 40 bytes clipped]"]
    assert batch.after.skipping
    write(log, "b" * 30)
    batch = read_batch(log, batch.after, max_line=10)
    assert batch.lines == () and batch.after.skipping  # still the same line
    write(log, "c\nnext\n")
    batch = read_batch(log, batch.after, max_line=10)
    assert texts(batch) == ["next"] and not batch.after.skipping


def test_a_log_far_behind_is_skipped_ahead_with_a_note(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    write(log, "".join(f"{i:09d}\n" for i in range(1000)))  # 10 kB
    batch = read_batch(log, Position(), max_bytes=100, max_backlog=1000)
    assert batch.lines[0].text.startswith("[fedhive: 9900 bytes of this log were skipped")
    assert texts(batch)[1:] == [f"{i:09d}" for i in range(990, 1000)]


def test_a_partial_line_skipped_ahead_into_is_dropped(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    write(log, "x" * 95 + "\n" + "tail\n")
    batch = read_batch(log, Position(), max_bytes=20, max_backlog=50)
    assert texts(batch)[1:] == ["tail"]


def test_traceback_error_flag_survives_positions(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    write(log, "\n".join(TRACEBACK[:3]) + "\n")
    first = read_batch(log, Position())
    assert first.after.in_traceback
    write(log, "\n".join(TRACEBACK[3:]) + "\n")
    second = read_batch(log, Position.from_json(json.loads(json.dumps(first.after.to_json()))))
    assert [line.error for line in second.lines] == [False, False, True, False]


def test_position_from_bad_json_starts_over() -> None:
    assert Position.from_json(None) == Position()
    assert Position.from_json({"offset": -3, "skipping": "yes"}) == Position()


# wire and intake ----------------------------------------------------------------------------
NAMES = Names("ns")


def proto(site: str = "a", job_id: str = "job-1", start: int = 0,
          lines: tuple[Line, ...] = (Line(4, "one"), Line(9, "two", True))) -> site_pb2.LogBatch:
    return batch_to_proto(job_id, site, Batch(start, lines, Position(9), True))


def test_a_batch_from_its_own_site_is_accepted() -> None:
    accepted = intake.accept(proto(), "site.a.logs", "ns.a", NAMES)
    assert (accepted.site, accepted.job_id, accepted.start) == ("a", "job-1", 0)
    assert accepted.lines == [Line(4, "one"), Line(9, "two", True)]


@pytest.mark.parametrize(("routing_key", "user_id", "site"), [
    ("site.a.logs", "ns.b", "a"),  # another site's user
    ("site.a.logs", "ns.a", "b"),  # the payload claims another site
    ("site.b.logs", "ns.a", "b"),  # routing key and payload claim another site
    ("site.a.logs", None, "a"),  # unsigned
])
def test_a_batch_claiming_another_site_is_refused(routing_key: str, user_id: str | None,
                                                  site: str) -> None:
    with pytest.raises(PermissionDenied, match="refused"):
        intake.accept(proto(site=site), routing_key, user_id, NAMES)


@pytest.mark.parametrize(("message", "routing_key"), [
    (proto(), "site.a.heartbeat"),
    (proto(job_id=""), "site.a.logs"),
    (proto(start=5), "site.a.logs"),  # a line ending before the batch starts
    (proto(lines=(Line(4, "one"), Line(4, "two"))), "site.a.logs"),
    (proto(lines=(Line(9000, "x" * 9000),)), "site.a.logs"),
])
def test_a_malformed_batch_is_refused(message: site_pb2.LogBatch, routing_key: str) -> None:
    with pytest.raises(MalformedMessage):
        intake.accept(message, routing_key, "ns.a", NAMES)


def test_log_entries_round_trip_and_print() -> None:
    entry = LogEntry("1-0", "site-1", "client_job", "RuntimeError: boom")
    assert entry_from_proto(entry_to_proto(entry)) == entry
    assert plain(entry) == "site-1 client_job | RuntimeError: boom"
    assert json.loads(as_json_line(entry)) == {"id": "1-0", "site": "site-1",
                                               "source": "client_job",
                                               "line": "RuntimeError: boom"}
    assert "site-2 does not share its logs" in private_note("site-2")
