"""fedhive services: one package per long-running process."""
