"""The distribution as users install it: the wheel and the sdist hold every package of the repository,
and a wheel installed into a fresh virtualenv (no editable install in sight) serves requests."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest
from server_proc import start_server, stop_cleanly, tiny_model_dir

REPO = Path(__file__).resolve().parent.parent
# where each source folder lands in the installed tree (pyproject's package-dir)
INSTALLED_AS = {"kvblocks": "kvblocks", "specdec": "kvblocks/specdec", "adapters": "kvblocks/adapters"}


def source_files() -> list[str]:
    """Files git tracks or would track (untracked but not ignored), relative to the repository."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return [name for name in listed if (REPO / name).is_file()]


def expected_modules() -> set[str]:
    """Every .py file of the three package folders, as its path inside an installed wheel."""
    wanted = set()
    for name in source_files():
        top, _, rest = name.partition("/")
        if top in INSTALLED_AS and name.endswith(".py"):
            wanted.add(f"{INSTALLED_AS[top]}/{rest}")
    return wanted


def source_copy(tmp: Path) -> Path:
    """The source files copied to `tmp/src`: builds write build/ and egg-info beside the sources,
    and the checkout should stay free of them."""
    source = tmp / "src"
    for name in source_files():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    return source


def run(*command: str | Path, cwd: Path | None = None) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"{command} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def build_wheel(source: Path, out: Path) -> Path:
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", out, source)
    (found,) = out.glob("kvblocks-*.whl")
    return found


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    return source_copy(tmp_path_factory.mktemp("source"))


@pytest.fixture(scope="module")
def wheel(source, tmp_path_factory) -> Path:
    return build_wheel(source, tmp_path_factory.mktemp("wheel"))


def wheel_files(path: Path) -> set[str]:
    with zipfile.ZipFile(path) as z:
        return set(z.namelist())


def test_wheel_holds_every_module_of_every_package_folder(wheel):
    missing = expected_modules() - wheel_files(wheel)
    assert not missing, f"not in the wheel: {sorted(missing)}"
    assert "kvblocks/server/app.py" in wheel_files(wheel)


def test_sdist_builds_the_same_wheel(source, wheel, tmp_path):
    """The sdist holds everything the wheel needs: a wheel built from it has the same files."""
    run(sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", tmp_path, source)
    (sdist,) = tmp_path.glob("kvblocks-*.tar.gz")
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    (root,) = (tmp_path / "unpacked").iterdir()
    assert wheel_files(build_wheel(root, tmp_path / "rebuilt")) == wheel_files(wheel)


def fresh_venv(path: Path) -> Path:
    """A virtualenv whose own site-packages is empty; the project venv's site-packages is appended to
    its path (a .pth line) for third-party dependencies only: .pth files there, such as the editable
    install's, are not run from a path added this way."""
    run(sys.executable, "-m", "venv", "--without-pip", path)
    python = path / "bin" / "python"
    own = run(python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])").strip()
    Path(own, "project-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return python


def test_wheel_installed_in_a_fresh_venv_serves_a_completion(wheel, tmp_path):
    python = fresh_venv(tmp_path / "venv")
    # --ignore-installed: pip sees the project venv's editable kvblocks and must leave it alone
    run(python, "-m", "pip", "install", "-q", "--no-deps", "--ignore-installed", wheel, cwd=tmp_path)
    imports = "import kvblocks.server.app, kvblocks.specdec, kvblocks.adapters, kvblocks.bench; print(kvblocks.__file__)"
    located = run(python, "-c", imports, cwd=tmp_path).strip()
    assert Path(located).is_relative_to(tmp_path / "venv"), located
    server = start_server(
        "--model",
        str(tiny_model_dir()),
        "--served-model-name",
        "tiny",
        command=[str(python.with_name("kvblocks"))],
    )
    try:
        with server.client() as client:
            body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 2
    finally:
        stop_cleanly(server)
