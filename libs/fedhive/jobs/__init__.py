"""Jobs: status state machine, meta.json model, validation, archive safety."""
