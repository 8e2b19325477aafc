"""The wheel: built from this checkout and installed into a fresh virtual environment, it carries
what dflash builds llama.cpp from (dflash/_source/), reaches the same build keys as the checkout,
and runs the README's first command to "identical to q1" from a folder outside the checkout."""
import json
import os
import site
import subprocess
import sys
import zipfile

import pytest

from dflash.core.paths import SOURCE_ENTRIES
from dflash.native import build

from .conftest import CLEAN_ENV, ROOT


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp / "dist"), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    (wheel,) = (tmp / "dist").glob("dflash_exact-*.whl")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    r = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", str(wheel)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    # the dependencies come from this environment's site-packages (a path, so its editable-install
    # hook for the checkout is not run: `import dflash` finds the wheel's copy)
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(purelib, "deps-from-test-env.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    env = {k: v for k, v in os.environ.items() if k not in CLEAN_ENV and k != "PYTHONPATH"}
    return wheel, venv, env, tmp / "elsewhere"


def test_the_wheel_carries_the_build_inputs(installed):
    wheel = installed[0]
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", *SOURCE_ENTRIES], capture_output=True, text=True, cwd=ROOT,
                             check=True).stdout.split()
    missing = [t for t in tracked if f"dflash/_source/{t}" not in names]
    assert tracked and not missing, missing[:10]
    assert "dflash_exact-0.1.0.dist-info/licenses/LICENSE" in names


def test_an_installed_wheel_builds_as_a_clone_does_and_runs_the_first_command(installed):
    _, venv, env, cwd = installed
    cwd.mkdir(exist_ok=True)
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import json, dflash; from dflash.core import paths; from dflash.native import build; "
                            "print(json.dumps([dflash.__file__, str(paths.SOURCE_ROOT), build.build_key('exact'), "
                            "build.build_key('stock', 'vulkan')]))"],
                           capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
    assert where.returncode == 0, where.stderr
    module, source, exact_key, vulkan_key = json.loads(where.stdout)
    assert module.startswith(str(venv)) and source.startswith(str(venv)) and source.endswith("dflash/_source")
    assert (exact_key, vulkan_key) == (build.build_key("exact"), build.build_key("stock", "vulkan"))
    r = subprocess.run([str(venv / "bin" / "dflash"), "prefill", "--compare-q1", "--threads", "2"],
                       capture_output=True, text=True, cwd=cwd, env={**env, "DFLASH_DS4_EXACT_PREFILL_BANDS": "1"},
                       timeout=900)
    assert r.returncode == 0 and "identical to q1" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
