# setuptools refuses `cffi_modules` in pyproject.toml, so this file exists only for it.
from setuptools import setup

setup(cffi_modules=["native/build.py:ffibuilder"])
