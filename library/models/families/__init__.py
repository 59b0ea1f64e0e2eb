"""The model families, one folder each (docs/FAMILIES.md); the registry is registry.py."""
