"""Wheels for serving on a GPU machine without a package index: ``python scripts/device_wheels.py OUT``.

Writes into OUT (default ``.whl``):

* ``nvidia_pytriton-0.7.0-…whl`` without what a Python 3.12 machine never loads (the python backend
  stubs of other Python versions and the 31 MB ``libpython3.13`` only the 3.13 stub links), so it and
  the numpy wheel fit together in a 64 MiB transfer;
* ``numpy-1.26.4-cp312-…whl`` for Triton's python backend stub (``muse-spark serve --stub-numpy``),
  where the machine's environment has numpy 2;
* ``nlohmann-json`` (the C++ embedding's JSON header: ``scripts/gpu_check.sh cxx`` and ``cxx-bench``);
* ``tritonclient`` and ``protobuf`` (pure wheels, under 0.5 MiB) for bench-serving's gRPC mode, which also
  needs ``grpcio`` on the machine (its 7 MiB binary wheel would pass the 64 MiB transfer: the HTTP
  mode needs none of them).

Install there with ``pip install --no-deps --target DIR OUT/nvidia_pytriton-*.whl`` and serve with
``muse-spark serve --stub-numpy OUT/numpy-1.26.4-*.whl``.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

PYTHON = "3.12"
PYTRITON = "nvidia-pytriton==0.7.0"
NUMPY = "numpy==1.26.4"
GRPC_CLIENT = ("tritonclient==2.73.0", "protobuf==7.36.2")
JSON_HEADER = "nlohmann-json==3.12.0"


def download(spec: str, out: Path, *platform_args: str) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                    "-d", str(out), *platform_args, spec], check=True)
    name = spec.split("==")[0].replace("-", "_")
    version = spec.split("==")[1]
    (wheel,) = out.glob(f"{name}-{version}-*.whl")
    return wheel


def slim(wheel: Path, python: str = PYTHON) -> None:
    """Rewrite ``wheel`` without other Python versions' stubs and the libraries only they link."""
    def unused(name: str) -> bool:
        if "/python_backend_stubs/" in name:
            return f"/python_backend_stubs/{python}/" not in name
        return name.startswith("nvidia_pytriton.libs/libpython3-") and python not in name.split("libpython3-")[1]

    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        for item in src.infolist():
            if unused(item.filename):
                continue
            data = src.read(item)
            if item.filename.endswith(".dist-info/RECORD"):
                data = b"".join(line for line in data.splitlines(keepends=True)
                                if not unused(line.split(b",", 1)[0].decode()))
            dst.writestr(item, data)
    tmp.replace(wheel)


def main(argv: list[str]) -> int:
    out = Path(argv[0] if argv else ".whl")
    out.mkdir(parents=True, exist_ok=True)
    pytriton = download(PYTRITON, out)
    slim(pytriton)
    download(NUMPY, out, "--python-version", PYTHON, "--implementation", "cp",
             "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64")
    download(JSON_HEADER, out)
    for spec in GRPC_CLIENT:
        download(spec, out, "--python-version", PYTHON, "--platform", "manylinux2014_x86_64")
    for p in sorted(out.glob("*.whl")):
        print(f"{p}  {p.stat().st_size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
