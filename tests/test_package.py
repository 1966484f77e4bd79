"""The package installs one namespace; generic top-level names must not import."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize("name", ["builder", "runtime", "plugins", "serving"])
def test_bare_generic_import_fails(name, tmp_path):
    # Run from an empty directory so the repository root is not on sys.path.
    r = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode != 0
    assert "ModuleNotFoundError" in r.stderr


def test_namespaced_subpackages_import(tmp_path):
    code = "import muse_spark.builder, muse_spark.plugins, muse_spark.runtime, muse_spark.models; print('ok')"
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


def test_runtime_does_not_import_builder(tmp_path):
    code = ("import sys, muse_spark.runtime; "
            "print([m for m in sys.modules if m.startswith('muse_spark.builder')])")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_console_script_help(tmp_path):
    r = subprocess.run([sys.executable, "-m", "muse_spark.cli", "--help"], cwd=tmp_path, capture_output=True,
                       text=True)
    assert r.returncode == 0
    for sub in ("make-tiny", "build", "generate"):
        assert sub in r.stdout
