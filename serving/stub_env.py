"""The Python environment Triton's python-backend stub runs the model in.

Why this exists: the stub shipped in ``nvidia-pytriton`` 0.7.0 (tritonserver
2.51) is compiled against numpy 1.x with a pybind11 that reads numpy's dtype
struct directly. numpy 2 changed that struct's layout, so under numpy 2 the stub
reads every dtype's item size as 0:

* every input tensor is built with strides of zero, so ``input_ids`` [1, 2, 3]
  reaches the model as [1, 1, 1] and a ``text_input`` string as its first byte
  repeated (its length prefix then asks for ~84 MB and the stub dies);
* every output tensor's byte size is computed as 0, so each response fails
  with "output tensor shape does not match size of output".

Nothing in the model can repair that: the data is lost inside the stub before
Python sees it. So when this environment has numpy ≥ 2, ``muse-spark serve``
runs the stub in an *overlay* environment: a tiny venv whose own
site-packages put a numpy 1.x first and then add every site directory of this
interpreter (torch, ``muse_spark`` and the rest come from there unchanged). Only
the stub process sees numpy 1.x; torch, safetensors and tokenizers work with
either. The numpy 1.x comes from ``--stub-numpy`` (a wheel file or a directory
holding ``numpy/``) or is installed once with pip into the user's cache.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import site
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

# The numpy the stub was built for (nvidia-pytriton declares numpy>=1.21,<2).
STUB_NUMPY = "numpy>=1.21,<2"


class StubEnvError(RuntimeError):
    """The stub's environment cannot be prepared; the message says what to do."""


def numpy_major(version: str | None = None) -> int:
    version = version or importlib.metadata.version("numpy")
    return int(version.split(".", 1)[0])


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "muse-spark" / f"stub-numpy-py{sys.version_info.major}{sys.version_info.minor}"


def _numpy_version_in(site_dir: Path) -> str | None:
    """The version of the numpy installed in ``site_dir`` (from its dist-info), or None."""
    if not (site_dir / "numpy" / "__init__.py").is_file():
        return None
    for info in sorted(site_dir.glob("numpy-*.dist-info")):
        return info.name[len("numpy-"):-len(".dist-info")]
    return None


def _checked(site_dir: Path, source: str) -> Path:
    version = _numpy_version_in(site_dir)
    if version is None:
        raise StubEnvError(f"{source} holds no numpy package (expected numpy/ and numpy-*.dist-info)")
    if numpy_major(version) >= 2:
        raise StubEnvError(f"{source} holds numpy {version}; Triton's python backend stub needs {STUB_NUMPY}")
    return site_dir


def _install(target: Path, fill, source: str) -> Path:
    """``fill(tmp)`` puts numpy into a fresh directory beside ``target``, which then replaces ``target``
    in one rename (a killed install never leaves a half-filled cache)."""
    tmp = Path(tempfile.mkdtemp(prefix=".fill-", dir=_made(target.parent)))
    try:
        fill(tmp)
        _checked(tmp, source)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _from_wheel(wheel: Path, log) -> Path:
    target = cache_dir() / wheel.stem
    if _numpy_version_in(target):
        return target
    log(f"unpacking {wheel.name} for the python backend stub into {target}")

    def unzip(tmp: Path) -> None:
        try:
            with zipfile.ZipFile(wheel) as z:
                z.extractall(tmp)
        except zipfile.BadZipFile:
            raise StubEnvError(f"--stub-numpy {wheel} is not a wheel (a zip file)") from None

    return _install(target, unzip, f"--stub-numpy {wheel}")


def _from_pip(log) -> Path:
    target = cache_dir() / "site"
    if _numpy_version_in(target):
        return target
    log(f"this environment has numpy {importlib.metadata.version('numpy')}, but Triton's python backend stub "
        f"needs {STUB_NUMPY}: installing it for the stub alone into {target} (once)")

    def pip(tmp: Path) -> None:
        cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--only-binary=:all:",
               "--target", str(tmp), STUB_NUMPY]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            last = ((done.stderr or done.stdout).strip().splitlines() or ["no output"])[-1]
            raise StubEnvError(
                f"could not install {STUB_NUMPY} for Triton's python backend stub ({' '.join(cmd)}: {last}). "
                f"On a machine without a package index, download a numpy 1.x wheel for Python "
                f"{sys.version_info.major}.{sys.version_info.minor} elsewhere (pip download '{STUB_NUMPY}' "
                f"--only-binary=:all:) and pass it with --stub-numpy WHEEL")

    return _install(target, pip, "the pip install")


def _made(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def numpy1_site(stub_numpy: str | None, log) -> Path | None:
    """A directory holding numpy 1.x for the stub, or None when this environment's numpy already is 1.x
    (and no ``--stub-numpy`` was given)."""
    if stub_numpy:
        src = Path(stub_numpy).expanduser()
        if src.is_file():
            return _from_wheel(src.resolve(), log)
        if src.is_dir():
            return _checked(src.resolve(), f"--stub-numpy {src}")
        raise StubEnvError(f"--stub-numpy {src} does not exist (give a numpy 1.x wheel or a directory holding numpy/)")
    if numpy_major() < 2:
        return None
    return _from_pip(log)


def site_dirs() -> list[str]:
    """This interpreter's site directories, in its own order (the overlay adds them after numpy 1.x)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if os.path.isdir(d)]


def write_overlay(workdir: Path, numpy_site: Path) -> Path:
    """An overlay venv under ``workdir`` → its ``bin`` directory (to put first on the stub's PATH).

    The stub finds its prefix from ``python3`` on PATH, the way the interpreter does: the ``pyvenv.cfg``
    beside ``bin/`` makes the overlay a venv over this interpreter's base installation, and the ``.pth``
    in its site-packages puts ``numpy_site`` first, then this interpreter's site directories (whose own
    ``.pth`` files, an editable install's included, are processed as usual)."""
    base = Path(getattr(sys, "_base_executable", sys.executable))
    env = workdir / "stub-env"
    bindir = env / "bin"
    pyver = f"python{sys.version_info.major}.{sys.version_info.minor}"
    sp = env / "lib" / pyver / "site-packages"
    bindir.mkdir(parents=True)
    sp.mkdir(parents=True)
    (bindir / "python3").symlink_to(base)
    (env / "pyvenv.cfg").write_text(f"home = {base.parent}\ninclude-system-site-packages = false\n"
                                    f"version = {sys.version.split()[0]}\n")
    lines = [str(numpy_site)] + [f"import site; site.addsitedir({d!r})" for d in site_dirs()]
    (sp / "00-muse-spark-stub.pth").write_text("\n".join(lines) + "\n")
    return bindir
