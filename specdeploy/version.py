"""The package version (installed metadata; the source tree's own when run from a checkout)."""
from __future__ import annotations

SOURCE_VERSION = "0.1.0"  # NOTE: keep equal to pyproject.toml's


def version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as dist_version

        return dist_version("specdeploy")
    except (ImportError, PackageNotFoundError):
        return SOURCE_VERSION
