"""The fedhive-job-runner service."""
