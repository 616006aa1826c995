"""The fedhive-job-store service."""
