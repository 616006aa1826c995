"""The `fedhive` admin command line."""
