"""Package discovery and the bundled examples; all metadata is in pyproject.toml.

`libs/fedhive` installs as `fedhive`; `services/` installs as `fedhive_services` so each
service's `main()` can be a console script without a top-level package named `services`.
The example jobs (every `examples/NAME/` with a `meta.json`) are copied into the built package as
`fedhive/examples/NAME/`, so `fedhive demo` finds them where no checkout is (an installed wheel);
git keeps them once, in examples/. An editable install reads them from the checkout instead.
"""

from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

EXAMPLES = Path("examples")


def example_files() -> list[Path]:
    """Every file of every example job, relative to the repository (no bytecode)."""
    jobs = sorted(meta.parent for meta in EXAMPLES.glob("*/meta.json"))
    if not jobs:  # a wheel without them would fail only later, in `fedhive demo`
        raise FileNotFoundError(f"no example job (NAME/meta.json) in {EXAMPLES.resolve()}")
    return [path for job in jobs for path in sorted(job.rglob("*")) if path.is_file()
            and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo")]


class BuildPyWithExamples(build_py):
    def _example_targets(self) -> list[tuple[Path, Path]]:
        package = Path(self.build_lib) / "fedhive"
        return [(path, package / path) for path in example_files()]

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return
        for source, target in self._example_targets():
            self.mkpath(str(target.parent))
            self.copy_file(str(source), str(target))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if self.editable_mode:
            return outputs
        return outputs + [str(target) for _, target in self._example_targets()]


service_packages = ["fedhive_services"] + [
    f"fedhive_services.{name}" for name in find_packages("services")
]
setup(
    packages=find_packages("libs") + service_packages,
    package_dir={"": "libs", "fedhive_services": "services"},
    package_data={"fedhive.proto": ["**/*.pyi", "py.typed"], "fedhive": ["py.typed"]},
    cmdclass={"build_py": BuildPyWithExamples},
)
