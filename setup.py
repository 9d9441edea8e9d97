"""Package discovery for the folder mapping in pyproject.toml.

The import package ``stage_cosim`` is assembled from four folders: ``stage_cosim/`` itself and
the top-level ``adapters/``, ``hardware/`` and ``search/``, which install as
``stage_cosim.adapters``, ``stage_cosim.hardware`` and ``stage_cosim.search``. setuptools'
automatic discovery cannot follow such a mapping, so every package under each folder is found
here rather than listed by hand: a hand-kept list drifts, and a wheel without a subpackage
installs a tool that fails on import. Folders without an ``__init__.py`` (the ``data/`` tables)
are found too, as setuptools wants every folder that ships files to be a listed package.
"""

from setuptools import find_namespace_packages, setup

# Import package prefix -> folder in the repository.
FOLDERS = {
    "stage_cosim": "stage_cosim",
    "stage_cosim.adapters": "adapters",
    "stage_cosim.hardware": "hardware",
    "stage_cosim.search": "search",
}


def discover() -> list[str]:
    packages = []
    for prefix, folder in FOLDERS.items():
        packages.append(prefix)
        packages.extend(f"{prefix}.{name}" for name in find_namespace_packages(folder, exclude=["*__pycache__*"]))
    return sorted(set(packages))


setup(package_dir=FOLDERS, packages=discover())
