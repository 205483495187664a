"""Scenario files (YAML) and recorded runs (JSONL) shipped with Meshpact."""
