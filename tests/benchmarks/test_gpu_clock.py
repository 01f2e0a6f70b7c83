"""benchmarks/harness/gpu_clock.py: nvidia-smi's samples parsed, summarized and described, the
sampler run against a stand-in nvidia-smi, and no summary where there is none."""

import os
import stat

from benchmarks.harness.gpu_clock import ClockSampler, describe, parse_samples, summarize

LINES = """1350, 1980, 697.12, 700.00, 0x0000000000000004
1410, 1980, 689.50, 700.00, 0x0000000000000004
1980, 1980, 120.00, 700.00, 0x0000000000000000
[N/A], 1980, 10, 700.00, 0x0
"""


def test_samples_parse_and_summarize():
    samples = parse_samples(LINES)
    assert len(samples) == 3  # the [N/A] line is skipped
    s = summarize(samples)
    assert s["sm_mhz_median"] == 1410 and s["sm_mhz_max"] == 1980 and s["power_limit_w"] == 700
    assert abs(s["power_w_median"] - 689.5) < 1e-9 and abs(s["power_capped_share"] - 2 / 3) < 1e-9
    line = describe(s)
    assert "1410 MHz" in line and "1980 max" in line and "690 W of its 700 W limit" in line and "67% of 3" in line
    assert summarize([]) is None and describe(None) == ""


def test_the_sampler_reads_a_stand_in_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '1335, 1980, 698.0, 700.0, 0x4\\n1350, 1980, 699.0, 700.0, 0x4\\n'\nexec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    import time

    with ClockSampler() as clock:
        time.sleep(0.5)
    s = clock.summary()
    assert s is not None and s["samples"] == 2 and s["power_capped_share"] == 1.0 and s["sm_mhz_median"] == 1342.5


def test_no_nvidia_smi_no_summary(monkeypatch):
    monkeypatch.setattr("shutil.which", lambda name: None)
    with ClockSampler() as clock:
        pass
    assert clock.summary() is None
