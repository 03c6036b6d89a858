"""DeepSpeed's op loads read py-cpuinfo's answer from zerotrain's cache (zerotrain/backends/deepspeed/cpu_info.py)."""
import json

import cpuinfo

from zerotrain.backends.deepspeed import cpu_info

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
    a = cpu_info.machine_key(PROC.format(mhz="2699.998", extra=""))
    assert a == cpu_info.machine_key(PROC.format(mhz="3100.000", extra=""))  # the clock moves: same CPU
    assert a != cpu_info.machine_key(PROC.format(mhz="2699.998", extra="avx512f "))  # another CPU: other flags
    assert cpu_info.machine_key() is not None  # this machine has /proc/cpuinfo


def test_asked_once_then_read_from_the_cache(tmp_path):
    asked = []

    def ask():
        asked.append(1)
        return {"arch_string_raw": "x86_64", "flags": ["avx2", "fma"]}

    path = tmp_path / "cpuinfo" / "k.json"
    first = cpu_info.cached(ask, path)
    assert first() == first() == {"arch_string_raw": "x86_64", "flags": ["avx2", "fma"]}
    assert len(asked) == 1 and json.loads(path.read_text())["flags"] == ["avx2", "fma"]
    assert cpu_info.cached(ask, path)() == first() and len(asked) == 1  # another process: the file answers

    path.write_text("{not json")  # a broken cache is asked again and rewritten
    assert cpu_info.cached(ask, path)()["flags"] == ["avx2", "fma"] and len(asked) == 2
    assert json.loads(path.read_text())["arch_string_raw"] == "x86_64"


def test_install_answers_deepspeeds_op_builder_from_the_cache(tmp_path, monkeypatch):
    from deepspeed.ops.op_builder.cpu import FusedAdamBuilder

    monkeypatch.setenv("ZEROTRAIN_CACHE", str(tmp_path))
    monkeypatch.setattr(cpuinfo, "get_cpu_info", cpuinfo.get_cpu_info)  # undone after the test
    real = cpuinfo.get_cpu_info()
    calls = []
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: calls.append(1) or real)
    cpu_info.install()
    cpu_info.install()  # twice: still one cache in front of py-cpuinfo
    builder = FusedAdamBuilder()
    assert builder.cpu_arch() and builder.simd_width() is not None
    assert len(calls) == 1  # DeepSpeed asked twice (cpu_arch, simd_width): py-cpuinfo answered once
    cached_file, = (tmp_path / "cpuinfo").glob("*.json")
    assert json.loads(cached_file.read_text())["flags"] == real["flags"]
