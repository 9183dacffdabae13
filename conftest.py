"""Load the tests/ conftest for notebook runs too (pytest --nbval solutions/ or chapters/), so cells tagged
`gpu` are skipped on machines without CUDA."""
pytest_plugins = ["tests.conftest"]
