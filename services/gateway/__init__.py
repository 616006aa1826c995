"""The fedhive-gateway service."""
