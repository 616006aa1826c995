"""fedhive.sdk: the admin Python API (what the `fedhive` CLI uses). See `Session`."""

from fedhive.jobs.metrics import RoundMetrics
from fedhive.sdk.session import Session, SiteInfo, SubmitResult

__all__ = ["RoundMetrics", "Session", "SiteInfo", "SubmitResult"]
