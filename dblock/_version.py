"""The version, written in one place: pyproject.toml reads it from here
(``[tool.hatch.version]``), the package top re-exports it, and telemetry
names its meter and tracer with it. A ``.devN`` version while
CHANGELOG.md's first heading says unreleased. (Its own module on the ground
floor, so the modules below the package top read it without an import that
runs up.)"""

__version__ = "0.2.0.dev0"
