"""fedhive.sdk: the admin Python API (what the `fedhive` CLI uses). See `Session`."""

from fedhive.joblogs.wire import LogEntry
from fedhive.jobs.metrics import RoundMetrics
from fedhive.sdk.logs import LogStream
from fedhive.sdk.session import Session, SiteInfo, SubmitResult

__all__ = ["LogEntry", "LogStream", "RoundMetrics", "Session", "SiteInfo", "SubmitResult"]
