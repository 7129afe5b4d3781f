"""Graph transforms, one file per family (registered in deploy/pipeline.py)."""
