"""The fedhive-scheduler service."""
