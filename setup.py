"""Packaging hook (the project's metadata is in pyproject.toml): a wheel carries what dflash builds
llama.cpp from beside the pinned source, the files named by dflash.core.paths.SOURCE_ENTRIES, under
dflash/_source/ at the same relative paths, so an installed wheel reaches the build keys a checkout
does. An editable install reads them from the checkout itself and copies nothing."""
import runpy
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
ENTRIES = runpy.run_path(str(ROOT / "dflash" / "core" / "paths.py"))["SOURCE_ENTRIES"]
SKIP = shutil.ignore_patterns("build", "__pycache__", "*.pyc", ".*")


class BuildPyWithSources(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        dest = Path(self.build_lib) / "dflash" / "_source"
        shutil.rmtree(dest, ignore_errors=True)
        dest.mkdir(parents=True)
        for rel in ENTRIES:
            src = ROOT / rel
            if src.is_dir():
                shutil.copytree(src, dest / rel, ignore=SKIP)
            else:
                shutil.copy2(src, dest / rel)


setup(cmdclass={"build_py": BuildPyWithSources})
