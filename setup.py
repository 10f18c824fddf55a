"""Which packages the distribution holds, found rather than listed (metadata lives in pyproject.toml).

`kvblocks/` and its subpackages are found where they lie; `specdec/` and `adapters/` sit at the
repository's top level but install as `kvblocks.specdec` and `kvblocks.adapters` (pyproject's
package-dir maps them), so their subpackages are found there and renamed.
"""

from setuptools import find_packages, setup

MAPPED = {"kvblocks.specdec": "specdec", "kvblocks.adapters": "adapters"}

packages = find_packages(include=["kvblocks", "kvblocks.*"])
for name, folder in MAPPED.items():
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(where=folder)]

setup(packages=packages)
