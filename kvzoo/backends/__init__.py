"""Backends. Each module listed in kvzoo.registry.BACKEND_MODULES exposes register(registry)."""
