"""The fedhive-site-agent service."""
