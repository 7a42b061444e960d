"""Hostile adapter uploads (issue 15, items 2-5 and the adapter parts of 7), each against a real server on
127.0.0.1 with archives built here:

- a pax header of 200,000 "1"s (CVE-2024-6232 froze every thread for 47 s): refused at once; a parser
  that hangs anyway is killed at its deadline while the server serves, one out of memory is a 422;
- a GNU long name declaring 128 MiB, a million ``./`` entries, a zip of 50,000 entries: refused from
  their headers, the server's memory unchanged; errors quote a short prefix of any name;
- SIGKILL at each step of an upload (tests/reliability/upload_kill_points.py): the restarted server
  serves one complete version and no leftovers remain;
- adapter_config.json nested 100,000 deep, ``r`` of 5,000 digits, ``lora_alpha`` 1e300: a 422 on
  upload, and on disk at start-up only that adapter is skipped;
- responses carry paths relative to the adapters directory; OPTIONS on an adapter lists DELETE and PUT.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
import zlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from model.lora_io import CONFIG_FILE, WEIGHTS_FILE
from service.api import archive_sandbox
from service.api.archive import ArchiveError, read_adapter_archive
from tests.helpers import error_of
from tests.reliability.helpers import (
    adapter_archive,
    adapter_variant,
    health_latencies,
    inprocess_server,
    rss_bytes,
    wait_until,
)
from tests.reliability.upload_kill_points import __name__ as KILL_POINTS
from tests.service.conftest import ADAPTERS, LM
from tests.service.server import ROOT, free_port, running_server, stop, wait_ready

MIB = 2**20
GZIP = {"Content-Type": "application/gzip"}
UPLOAD_LIMIT = 8 * MIB  # the subprocess server's max_adapter_upload_bytes
SHORT = 300  # no 422 message here may be longer (names in it are quoted at most 64 characters)


# ---- archives ---------------------------------------------------------------------------------------


def tar_header(name: bytes, size: int, kind: bytes) -> bytes:
    """A raw ustar header block (checksum included): what a hostile client writes by hand."""
    header = bytearray(512)
    header[: len(name)] = name
    header[100:136] = b"0000644\0" + b"0000000\0" + b"0000000\0" + b"%011o\0" % size
    header[136:148] = b"00000000000\0"
    header[148:156] = b" " * 8
    header[156:157] = kind
    header[257:265] = b"ustar\x0000"
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


def gzipped(chunks: Iterable[bytes]) -> bytes:
    compressor = zlib.compressobj(1, zlib.DEFLATED, 16 + zlib.MAX_WBITS)  # fast: these chunks repeat
    return b"".join(compressor.compress(c) for c in chunks) + compressor.flush()


def tar_of(members: dict[str, bytes], form: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz", format=form) as tar:
        for name, content in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))
    return buf.getvalue()


def pax_of_ones(count: int) -> bytes:
    return gzip.compress(tar_header(b"././@PaxHeader", count, b"x") + b"1" * count + b"\0" * (-count % 512 + 1024))


def long_name(declared: int) -> bytes:
    """A GNU long-name header declaring a ``declared``-byte name, followed by that name (it compresses to ~0.1%)."""
    return gzipped([tar_header(b"././@LongLink", declared, b"L"), *(b"a" * MIB for _ in range(declared // MIB))])


def directory_entries(count: int) -> bytes:
    block = tar_header(b"./", 0, b"5")
    return gzipped(block * 10_000 for _ in range(count // 10_000))


def zip_of(members: Iterable[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name, content in members:
            z.writestr(zipfile.ZipInfo(name), content)
    return buf.getvalue()


def with_config(good: Path, config: bytes) -> bytes:
    return tar_of({CONFIG_FILE: config, WEIGHTS_FILE: (good / WEIGHTS_FILE).read_bytes()})


def zeros_member(size: int) -> bytes:
    """adapter_model.safetensors as ``size`` zero bytes, tar.gz'd (~0.1% of it)."""
    header = tar_header(WEIGHTS_FILE.encode(), size, b"0")
    return gzipped([tar_header(CONFIG_FILE.encode(), 0, b"0"), header, *(bytes(MIB) for _ in range(size // MIB))])


# ---- servers ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_only(models_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lm-only")
    (root / LM).symlink_to(models_dir / LM, target_is_directory=True)
    return root


def lm_adapters(adapters_dir: Path, root: Path) -> Path:
    shutil.copytree(adapters_dir / LM / ADAPTERS[LM], root / LM / ADAPTERS[LM])
    return root


@pytest.fixture(scope="module")
def server(lm_only, adapters_dir, tmp_path_factory):
    adapters = lm_adapters(adapters_dir, tmp_path_factory.mktemp("hostile") / "adapters")
    with running_server(lm_only, adapters, TSERVE_WARMUP="false",
                        TSERVE_MAX_ADAPTER_UPLOAD_BYTES=str(UPLOAD_LIMIT)) as s:
        yield s, adapters


def put(client: httpx.Client, name: str, data: bytes = b"") -> httpx.Response:
    return client.put(f"/v1/models/{LM}/adapters/{name}", content=data, headers=GZIP if data else {})


def outputs(client: httpx.Client, adapter: str | None) -> list:
    r = client.post(f"/v1/models/{LM}/generate", json={"inputs": ["hello", "the cat"], "max_new_tokens": 8,
                                                       "adapter": adapter})
    assert r.status_code == 200, r.text
    return r.json()["outputs"]


def hidden(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.startswith("."))


# ---- item 2: the pax header of CVE-2024-6232; parsing off the serving process ------------------------


def test_a_pax_header_of_200000_ones_is_refused_at_once(server):
    s, adapters = server
    data = pax_of_ones(200_000)
    with s.client() as c:
        start = time.perf_counter()
        error = error_of(put(c, "pax", data), 422, "invalid_request")
        took = time.perf_counter() - start
        assert "pax header of 200000 bytes" in error["message"] and len(error["message"]) < SHORT
        assert c.get("/health").status_code == 200
    assert hidden(adapters / LM) == []
    print(f"FIGURE pax_200000_ones: a {len(data)}-byte upload refused (422) in {took * 1000:.0f} ms")


GATED_CHILD = """
import os, pathlib, runpy, sys, time
pathlib.Path({marker!r}).write_text(str(os.getpid()))
while not pathlib.Path({release!r}).exists():
    time.sleep(0.01)
sys.argv = ["archive_sandbox", *sys.argv[1:]]
runpy.run_module("service.api.archive_sandbox", run_name="__main__")
"""


def test_the_server_serves_while_a_parse_hangs_and_kills_it_at_the_deadline(
        lm_only, adapters_dir, tmp_path, monkeypatch):
    """The parser is a child process held at a gate: /health and a load that takes the adapter lock answer
    while it waits; released, it parses (200); never released, it is killed at its deadline (422)."""
    adapters = lm_adapters(adapters_dir, tmp_path / "adapters")
    good = adapter_archive(adapters / LM / ADAPTERS[LM])
    with inprocess_server(lm_only, adapters) as s, s.client() as c, s.client() as uploader, \
            ThreadPoolExecutor(1) as pool:
        idle = health_latencies(c, 30)
        parses = []
        for attempt in ("released", "hung"):
            marker, release = tmp_path / f"{attempt}.pid", tmp_path / f"{attempt}.release"
            monkeypatch.setattr(archive_sandbox, "CHILD", (sys.executable, "-c", GATED_CHILD.format(
                marker=str(marker), release=str(release))))
            if attempt == "hung":
                monkeypatch.setattr(archive_sandbox, "PARSE_BASE_S", 1.0)
                monkeypatch.setattr(archive_sandbox, "PARSE_S_PER_MIB", 0.0)
            upload = pool.submit(put, uploader, "gated", good)
            assert wait_until(lambda m=marker: m.exists() and m.read_text(), 60), "the parser did not start"
            pid = int(marker.read_text())
            if attempt == "released":
                during = health_latencies(c, 30)
                assert put(c, ADAPTERS[LM]).status_code == 200  # takes the adapter lock: free during a parse
                assert not upload.done()  # the gate is still closed: all of the above happened during the parse
                release.touch()
            parses.append(upload.result(60))
            assert not Path(f"/proc/{pid}").exists()  # the child is gone (reaped)
        released, hung = parses
        assert released.status_code == 200, released.text
        message = error_of(hung, 422)["message"]
        assert "adapter archive rejected: parsing took longer than 1 s" in message
        assert hidden(adapters / LM) == []
        assert statistics.median(during) < 20 * statistics.median(idle), (during, idle)
    print(f"FIGURE health_during_parse: median {statistics.median(during) * 1000:.1f} ms (idle "
          f"{statistics.median(idle) * 1000:.1f} ms), max {max(during) * 1000:.1f} ms over {len(during)}; "
          "hung parser killed at its 1 s deadline")


def test_a_parser_out_of_memory_is_a_422(lm_only, adapters_dir, tmp_path, monkeypatch):
    adapters = lm_adapters(adapters_dir, tmp_path / "adapters")
    bounds = archive_sandbox.Limits(memory_bytes=64 * MIB, cpu_s=60, wall_s=60.0)
    monkeypatch.setattr(archive_sandbox, "limits_for", lambda limit: bounds)
    data = zeros_member(96 * MIB)  # 96 MiB once decompressed; the child may have 64
    with inprocess_server(lm_only, adapters, max_adapter_upload_bytes=128 * MIB) as s, s.client() as c:
        message = error_of(put(c, "zeros", data), 422)["message"]
        assert "parsing needs more than 64 MiB of memory" in message
        assert hidden(adapters / LM) == []
    print(f"FIGURE parser_memory: a {len(data) // 1024} KiB upload of 96 MiB, 64 MiB allowed: 422")


# ---- item 3: limits on what headers declare; short quotes ---------------------------------------------


@pytest.mark.parametrize(
    ("kind", "build", "says"),
    [
        ("gnu-long-name-128MiB", lambda: long_name(128 * MIB), "GNU long-name headers are not allowed"),
        ("a-million-dot-entries", lambda: directory_entries(1_000_000), "more than 3 members"),
        ("zip-50000-entries", lambda: zip_of((f"{i}/", b"") for i in range(50_000)),
         "central directory lists 50000 members"),
        ("member-over-the-limit", lambda: zeros_member(UPLOAD_LIMIT + MIB), "over the limit of 8388608"),
    ],
)
def test_declared_sizes_and_counts_are_refused_before_reading(server, kind, build, says):
    s, adapters = server
    data = build()
    with s.client() as c:
        rss = rss_bytes(s.process.pid)
        start = time.perf_counter()
        error = error_of(put(c, "declared", data), 422)
        took = time.perf_counter() - start
        grew = rss_bytes(s.process.pid) - rss
        assert says in error["message"] and len(error["message"]) < SHORT, error
        assert grew < 16 * MIB, grew
        assert put(c, ADAPTERS[LM]).status_code == 200  # the adapter lock is free
    assert hidden(adapters / LM) == []
    print(f"FIGURE {kind}: {len(data) / 1024:.0f} KiB upload refused (422) in {took * 1000:.0f} ms, "
          f"server RSS {grew / MIB:+.1f} MiB")


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (tar_of({"x" * 100: b"{}"}), "unexpected member 'xxx"),
        (tar_of({"d" * 150 + "/" + "x" * 99: b"{}"}, tarfile.USTAR_FORMAT), "unexpected member 'ddd"),  # 250 chars
        (tar_of({"d" * 150 + "/" + "x" * 150: b"{}"}), "a pax header sets 'path'"),
        (tar_of({"../" + "y" * 90: b"{}"}), "leaves the archive"),
        (tar_of({"/" + "z" * 90: b"{}"}), "absolute path"),
        (zip_of([("v" * 3000, b"")]), "unexpected member 'vvv"),
    ],
    ids=["long-name", "ustar-prefix", "pax-path", "dotdot", "absolute", "zip-3000"],
)
def test_errors_quote_a_short_prefix_of_names(server, data, says):
    s, _ = server
    with s.client() as c:
        message = error_of(put(c, "names", data), 422)["message"]
    assert says in message and len(message) < SHORT, message
    assert not any(ch * 65 in message for ch in "dxyzv"), message  # names cut at 64 characters


def _record(keyword: str, value: str) -> bytes:
    """One pax record, "<length> <keyword>=<value>\\n", its length counting itself."""
    body = f" {keyword}={value}\n".encode()
    length = len(body) + 1
    while len(str(length).encode() + body) != length:
        length += 1
    return str(length).encode() + body


def _pax(records: bytes, kind: bytes = b"x") -> bytes:
    return tar_header(b"././@PaxHeader", len(records), kind) + records + bytes(-len(records) % 512)


def _member(name: str, content: bytes) -> bytes:
    return tar_header(name.encode(), len(content), b"0") + content + bytes(-len(content) % 512)


def _base256_size() -> bytes:
    header = bytearray(tar_header(WEIGHTS_FILE.encode(), 0, b"0"))
    header[124:136] = b"\x80" + (2**40).to_bytes(11, "big")
    header[148:156] = b" " * 8
    header[148:156] = b"%06o\0 " % sum(header)
    return bytes(header)


GOOD = _member(CONFIG_FILE, b"{}") + _member(WEIGHTS_FILE, b"\0" * 8)
END = bytes(1024)


@pytest.mark.parametrize(
    ("tar", "says"),
    [
        (_pax(_record("mtime", "1732437097.7712069") + _record("atime", "1")) + GOOD + END, None),
        (_pax(_record("size", "99999999999")) + GOOD + END, "pax header sets 'size'"),
        (_pax(_record("GNU.sparse.major", "1")) + GOOD + END, "pax header sets 'GNU.sparse.major'"),
        (_pax(b"99 mtime=1\n") + GOOD + END, "malformed pax header"),
        (_pax(_record("comment", "x"), b"g") * 5 + GOOD + END, "more than 4 pax headers"),
        (tar_header(b"././@LongLink", 20, b"K") + GOOD + END, "GNU long-name headers"),
        (tar_header(b"./", 512, b"5") + GOOD + END, "declares 512 bytes"),
        (tar_header(WEIGHTS_FILE.encode(), 0, b"S") + GOOD + END, "not a regular file"),
        (GOOD[:-512], "ends inside a member"),
        (GOOD[:100] + b"!" + GOOD[101:] + END, "invalid header checksum"),
        (_base256_size() + END, "8 GiB or more"),
    ],
    ids=["pax-times", "pax-size", "pax-sparse", "pax-malformed", "pax-too-many", "gnu-long-link", "dir-with-data",
         "sparse", "truncated", "checksum", "base-256-size"],
)
def test_tar_headers_are_checked_before_use(tar, says):
    data = gzip.compress(tar)
    if says is None:
        assert set(read_adapter_archive(data, limit=4096)) == {CONFIG_FILE, WEIGHTS_FILE}
        return
    with pytest.raises(ArchiveError, match=says):
        read_adapter_archive(data, limit=4096)


# ---- item 4: SIGKILL mid-upload ------------------------------------------------------------------------

# (point, which version <name> holds right after the kill there, and after the restart's recovery)
KILLS = [("parsed", "current"), ("exchanged", "uploaded"), ("aside", None)]


def _start(models: Path, adapters: Path, point: str | None, marker: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    module = ["-m", KILL_POINTS, point, str(marker), "--"] if point else ["-m", "service"]
    args = [sys.executable, *module, "--models", str(models), "--adapters", str(adapters), "--host", "127.0.0.1",
            "--port", str(port)]
    env = {**os.environ, "TSERVE_THREADS": "1", "TSERVE_LOG_LEVEL": "warning", "TSERVE_WARMUP": "false"}
    process = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, process, 60)
    return process, url


def _serves(url: str, adapters: Path, weights: bytes) -> None:
    """After a restart: ``swap`` holds ``weights`` in full, is listed and served, and nothing hidden is left."""
    assert (adapters / LM / "swap" / WEIGHTS_FILE).read_bytes() == weights
    assert hidden(adapters / LM) == []
    with httpx.Client(base_url=url, timeout=60) as c:
        listed = c.get(f"/v1/models/{LM}/adapters").json()["adapters"]
        assert [a["path"] for a in listed if a["name"] == "swap"] == [f"{LM}/swap"]
        outputs(c, "swap")


def test_an_upload_killed_at_any_point_leaves_one_complete_adapter(lm_only, adapters_dir, tmp_path):
    adapters = lm_adapters(adapters_dir, tmp_path / "adapters")
    versions = [adapters_dir / LM / ADAPTERS[LM], adapter_variant(adapters_dir / LM / ADAPTERS[LM], tmp_path / "v2")]
    shutil.copytree(versions[0], adapters / LM / "swap")
    current = 0
    for point, after in KILLS:
        marker = tmp_path / f"{point}.reached"
        process, url = _start(lm_only, adapters, point, marker)
        try:
            if point != KILLS[0][0]:
                _serves(url, adapters, (versions[current] / WEIGHTS_FILE).read_bytes())
            data = adapter_archive(versions[1 - current])
            threading.Thread(target=_quietly, args=(url, data), daemon=True).start()
            assert wait_until(marker.exists, 60), f"{point} not reached"
            process.send_signal(signal.SIGKILL)
            process.wait()
        finally:
            stop(process)
        swap = adapters / LM / "swap"
        if after is None:  # caught between the two renames: only the copy moved aside is left
            assert not swap.exists() and any(".old.upload-" in n for n in hidden(adapters / LM))
        else:
            current = current if after == "current" else 1 - current
            assert (swap / WEIGHTS_FILE).read_bytes() == (versions[current] / WEIGHTS_FILE).read_bytes()
        leftovers = hidden(adapters / LM)
        assert leftovers, point
        print(f"FIGURE upload_kill_{point}: left {leftovers}")
    process, url = _start(lm_only, adapters, None, tmp_path / "unused")
    try:
        _serves(url, adapters, (versions[current] / WEIGHTS_FILE).read_bytes())
    finally:
        stop(process)


def _quietly(url: str, data: bytes) -> None:
    """PUT the upload of ``swap``; the server is killed mid-request."""
    with contextlib.suppress(httpx.TransportError):
        httpx.put(f"{url}/v1/models/{LM}/adapters/swap", content=data, headers=GZIP, timeout=120)


# ---- item 5: adapter_config.json ------------------------------------------------------------------------


def _changed(good: Path, key: str, raw: str) -> bytes:
    """``good``'s adapter_config.json with the value of ``key`` replaced by ``raw`` (JSON text)."""
    text, count = re.subn(f'"{key}": [^,\n}}]+', lambda _: f'"{key}": {raw}', (good / CONFIG_FILE).read_text())
    assert count == 1
    return text.encode()


def _nested(levels: int) -> str:
    return "[" * levels + "]" * levels


# kind -> (key, its new value, what the 422 says)
BAD_CONFIGS = {
    "nested-100000": ("task_type", _nested(100_000), "over 65536 bytes"),
    "nested-20000": ("task_type", _nested(20_000), "nested more than 16 levels deep"),
    "r-5000-digits": ("r", "7" * 5000, "Exceeds the limit (4300 digits)"),
    "r-4000-digits": ("r", "7" * 4000, "invalid LoRAConfig: r=777"),
    "alpha-1e300": ("lora_alpha", "1e300", "over 1000 times the layer's largest weight"),
    "alpha-1e30": ("lora_alpha", "1e30", "over 1000 times the layer's largest weight"),
}


@pytest.mark.parametrize("kind", list(BAD_CONFIGS))
def test_a_bad_adapter_config_upload_is_a_422(server, adapters_dir, kind):
    s, adapters = server
    key, raw, says = BAD_CONFIGS[kind]
    good = adapters_dir / LM / ADAPTERS[LM]
    config = _changed(good, key, raw)
    with s.client() as c:
        before = outputs(c, ADAPTERS[LM])
        message = error_of(put(c, ADAPTERS[LM], with_config(good, config)), 422)["message"]
        assert says in message and len(message) < SHORT, message
        assert outputs(c, ADAPTERS[LM]) == before
    assert (adapters / LM / ADAPTERS[LM] / CONFIG_FILE).read_bytes() == (good / CONFIG_FILE).read_bytes()


def test_a_bad_adapter_config_on_disk_skips_that_adapter_only(lm_only, adapters_dir, tmp_path):
    adapters = lm_adapters(adapters_dir, tmp_path / "adapters")
    good = adapters / LM / ADAPTERS[LM]
    for kind, (key, raw, _) in BAD_CONFIGS.items():
        shutil.copytree(good, adapters / LM / kind)
        (adapters / LM / kind / CONFIG_FILE).write_bytes(_changed(good, key, raw))
    with inprocess_server(lm_only, adapters) as s, s.client() as c:
        assert s.engine.load_errors == {}
        assert c.get("/ready").json()["models"] == [LM]
        assert [a["name"] for a in c.get(f"/v1/models/{LM}/adapters").json()["adapters"]] == [ADAPTERS[LM]]
        outputs(c, ADAPTERS[LM])
        for kind in BAD_CONFIGS:
            error_of(c.post(f"/v1/models/{LM}/generate", json={"inputs": ["x"], "adapter": kind}), 404)


# ---- item 7: no server paths; every allowed method in Allow ---------------------------------------------


def test_paths_in_responses_are_relative_to_the_adapters_directory(server, adapters_dir):
    s, adapters = server
    root = str(adapters.resolve())
    with s.client() as c:
        r = c.get(f"/v1/models/{LM}/adapters")
        assert [a["path"] for a in r.json()["adapters"]] == [f"{LM}/{ADAPTERS[LM]}"]
        broken = tar_of({CONFIG_FILE: (adapters_dir / LM / ADAPTERS[LM] / CONFIG_FILE).read_bytes(),
                         WEIGHTS_FILE: b"not safetensors"})
        error = error_of(put(c, "broken", broken), 422)
        assert "safetensors" in error["message"] and root not in error["message"], error
        assert root not in put(c, ADAPTERS[LM]).text


@pytest.mark.parametrize("method", ["OPTIONS", "GET", "POST", "PATCH"])
def test_a_method_an_adapter_lacks_lists_every_allowed_one(server, method):
    s, _ = server
    with s.client() as c:
        r = c.request(method, f"/v1/models/{LM}/adapters/{ADAPTERS[LM]}")
    error_of(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "DELETE, PUT"
