"""Test-only helpers (tests/ is on sys.path under pytest): tiny random models and the Hugging
Face references every exactness test compares against. Runtime packages never import this
(the import-direction test enforces it)."""
