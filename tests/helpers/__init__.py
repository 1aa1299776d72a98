"""Models, data and helpers shared by the tests (importable as `helpers.*`: pytest puts tests/ on the path)."""
