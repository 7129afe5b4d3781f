"""specdeploy."""
