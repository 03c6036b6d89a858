"""DeepSpeed's op loads see the same ninja on every launch and read py-cpuinfo's answer from zerotrain's cache
(zerotrain/backends/deepspeed/op_builds.py)."""
import json
import os
import shutil

import cpuinfo

from zerotrain.backends.deepspeed import op_builds

PROC = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C
stepping\t: 8
cpu MHz\t\t: {mhz}
flags\t\t: fpu vme {extra}avx2
bogomips\t: 5399.99
"""


def test_the_key_names_the_cpu_not_its_clock():
    a = op_builds.machine_key(PROC.format(mhz="2699.998", extra=""))
    assert a == op_builds.machine_key(PROC.format(mhz="3100.000", extra=""))  # the clock moves: same CPU
    assert a != op_builds.machine_key(PROC.format(mhz="2699.998", extra="avx512f "))  # another CPU: other flags
    assert op_builds.machine_key() is not None  # this machine has /proc/cpuinfo


def test_asked_once_then_read_from_the_cache(tmp_path):
    asked = []

    def ask():
        asked.append(1)
        return {"arch_string_raw": "x86_64", "flags": ["avx2", "fma"]}

    path = tmp_path / "cpuinfo" / "k.json"
    first = op_builds.cached(ask, path)
    assert first() == first() == {"arch_string_raw": "x86_64", "flags": ["avx2", "fma"]}
    assert len(asked) == 1 and json.loads(path.read_text())["flags"] == ["avx2", "fma"]
    assert op_builds.cached(ask, path)() == first() and len(asked) == 1  # another process: the file answers

    path.write_text("{not json")  # a broken cache is asked again and rewritten
    assert op_builds.cached(ask, path)()["flags"] == ["avx2", "fma"] and len(asked) == 2
    assert json.loads(path.read_text())["arch_string_raw"] == "x86_64"


def test_install_answers_deepspeeds_op_builder_from_the_cache(tmp_path, monkeypatch):
    from deepspeed.ops.op_builder.cpu import FusedAdamBuilder

    monkeypatch.setenv("ZEROTRAIN_CACHE", str(tmp_path))
    monkeypatch.setenv("PATH", os.environ["PATH"])  # install() also pins the environment's ninja: undone after
    monkeypatch.setattr(cpuinfo, "get_cpu_info", cpuinfo.get_cpu_info)  # undone after the test
    real = cpuinfo.get_cpu_info()
    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or real)
    op_builds.install()
    op_builds.install()  # twice: still one cache in front of py-cpuinfo
    builder = FusedAdamBuilder()
    assert builder.cpu_arch() and builder.simd_width() is not None
    assert len(calls) == 1  # DeepSpeed asked twice (cpu_arch, simd_width): py-cpuinfo answered once
    cached_file, = (tmp_path / "cpuinfo").glob("*.json")
    assert json.loads(cached_file.read_text())["flags"] == real["flags"]


def test_the_environments_ninja_goes_first_on_path(tmp_path, monkeypatch):
    env_bin, machine_bin = tmp_path / "env" / "bin", tmp_path / "usr" / "bin"
    for folder in (env_bin, machine_bin):
        folder.mkdir(parents=True)
        (folder / "ninja").write_text("#!/bin/sh\n")
        (folder / "ninja").chmod(0o755)
    monkeypatch.setenv("PATH", f"{machine_bin}:/bin:{env_bin}")
    assert op_builds.pin_ninja(str(env_bin / "python")) == env_bin
    assert os.environ["PATH"] == f"{env_bin}:{machine_bin}:/bin"  # first, and once
    assert shutil.which("ninja") == str(env_bin / "ninja")
    assert op_builds.pin_ninja(str(env_bin / "python")) == env_bin and os.environ["PATH"].count(str(env_bin)) == 1
    assert op_builds.pin_ninja(str(tmp_path / "bare" / "python")) is None  # no ninja of its own: PATH untouched
    assert os.environ["PATH"] == f"{env_bin}:{machine_bin}:/bin"
