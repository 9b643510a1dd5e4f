"""Adapters for launchers and frameworks. Each submodule imports its framework, so import only
the one you use (megapatch itself never imports this package)."""
