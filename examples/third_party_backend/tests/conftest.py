# mm3's pytest plugin (its fixtures: mm3_registry, mm3_case, mm3_conformance...) loads only where a
# project asks for it, so that installing mm3 leaves every other project's pytest runs alone.
pytest_plugins = ["mm3.testing.pytest_plugin"]
