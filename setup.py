"""The package list, which pyproject.toml cannot express: a `find` of actors* cannot add a
package mapped from another folder, so the CUDA kernel sources (cuda_src/, mapped to
actors._cuda_src in pyproject.toml) are appended here. Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(packages=[*find_packages(include=["actors*"]), "actors._cuda_src"])
