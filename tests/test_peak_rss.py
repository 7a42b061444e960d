"""benchmarks/peak_rss.py measures every one of our engines (fp32, int8, bf16) in a fresh process."""

import subprocess
import sys

import pytest

from benchmarks import peak_rss
from tests.hf_directories import llama_directory


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return llama_directory(tmp_path_factory.mktemp("llama"))


@pytest.mark.parametrize("engine", [e for e in peak_rss.IN_PROCESS if e.startswith("ours")])
def test_each_of_our_engines_runs_alone_and_reports_its_peak(llama, engine):
    done = subprocess.run([sys.executable, "-m", "benchmarks.peak_rss", engine, str(llama), "1", "5", "3"],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert int(done.stdout.split()[-1]) > 2**20  # VmHWM in bytes: at least torch's own footprint
