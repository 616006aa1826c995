"""Package discovery only; all metadata is in pyproject.toml.

`libs/fedhive` installs as `fedhive`; `services/` installs as `fedhive_services` so each
service's `main()` can be a console script without a top-level package named `services`.
"""

from setuptools import find_packages, setup

service_packages = ["fedhive_services"] + [
    f"fedhive_services.{name}" for name in find_packages("services")
]
setup(
    packages=find_packages("libs") + service_packages,
    package_dir={"": "libs", "fedhive_services": "services"},
    package_data={"fedhive.proto": ["**/*.pyi", "py.typed"], "fedhive": ["py.typed"]},
)
